"""CacheBlend benchmark: answer quality against a full prefill, and TTFT, on a trained model.

Why this file exists: blending reuses each retrieved document's KV computed alone, so its
output differs from a full prefill; how much, and what recomputing some tokens buys back,
is only measurable on a model that learnt to attend across documents. This script

1. loads (or trains, benchmarks/blend/train_blend_model.py) a small Llama trained on chunks of
   pydoc text with retrieval facts spread over them (benchmarks/blend/blend_task.py);
2. starts a private `lmcached serve`, stores a pool of chunks alone (store_segments), and
   builds RAG prompts of 4-6 pool chunks (a few unrelated ones, then a run of consecutive
   ones, so a chunk sits at different offsets) ending with the start of the next chunk
   ("continue") or a question about a fact ("fact");
3. quality: for CacheBlend ratios 0, 0.05, 0.15, 0.3, 1.0, LegoLink k 1, 4, 16, and
   prefix-only caching, the KL divergence KL(full || method) and the top-1 agreement of the
   next-token distributions over the answer positions (teacher-forced: the answer tokens are
   fed after the prompt over the method's past_key_values), and the task accuracy;
4. speed: TTFT of each method against a full prefill and prefix-only at 2k/4k/8k prompt
   tokens, on the trained model (mostly Python overhead at this size) and on a larger
   random-weight Llama (the compute balance of a real model), on CPU and on CUDA if present.

Figures are medians of runs taken in the same process, methods interleaved (the machine is
shared: ratios to the full prefill of the same run hold, absolute times drift). Output: a
table on stdout, <out-dir>/<date>-blend[-quick].json (written first), .md and -quality.png
(benchmarks/blend/blend_report.py).

    .venv/bin/python -m benchmarks.blend.bench_blend            # full run
    .venv/bin/python -m benchmarks.blend.bench_blend --quick    # smoke run, a minute or two
    .venv/bin/python -m benchmarks.blend.bench_blend --quality-only --compare-today

`--compare-today` also runs the quality part on today's path (blend_baseline.py: the
layer loop, executors and re-rotation of blend_baseline.BASELINE_REV with the dense-mask
attention), in the same process, and prints the largest difference of each method's KL
and top-1 agreement between the two (the speed-ups keep quality: equal to 1e-6).
"""

import argparse
import datetime
import json
import os
import random
import sys
import time

import torch

from benchmarks import RESULTS
from benchmarks.blend import blend_report
from benchmarks.blend.blend_baseline import Baseline
from benchmarks.common import machine_info, median, record_block_size, running_daemon
from benchmarks.blend.train_blend_model import load_or_train
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from lmcached.client.engine import CacheEngine
from lmcached.client.hf import CACHE_ARG, blend_prefill, layout_for_model, store_segments
from lmcached.client.hf_attention import prefix_attention

RATIOS = (0.0, 0.05, 0.15, 0.3, 1.0)
LEGOLINK_KS = (1, 4, 16)
# A larger random-weight Llama for TTFT (weights do not change the time): 8 layers,
# hidden 1024, GQA 16/4 heads of 64.
BIG_CONFIG = dict(vocab_size=2048, hidden_size=1024, intermediate_size=2816,
                  num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                  max_position_embeddings=16384, rope_theta=500000.0, tie_word_embeddings=True)
TTFT_DOC_TOKENS = 512  # documents of the TTFT prompts, <sep> included
# Timed at every length; the other methods only up to --all-methods-max tokens.
CORE_METHODS = ("full", "prefix", "cacheblend 0.15", "legolink 16")


def methods() -> list[tuple[str, dict]]:
    """(name, blend_prefill kwargs) of every blended method; "full" and "prefix" aside."""
    out = [(f"cacheblend {r:g}", {"strategy": "cacheblend", "recompute_ratio": r})
           for r in RATIOS]
    out += [(f"legolink {k}", {"strategy": "legolink", "legolink_k": k}) for k in LEGOLINK_KS]
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def cache_from_kv(kv: tuple, num_tokens: int, device: torch.device) -> DynamicCache:
    """A DynamicCache on `device` from `engine.retrieve`'s per-layer (K, V)
    `[kv_heads, n, head_size]` (cpu)."""
    cache = DynamicCache()
    for layer, (k, v) in enumerate(kv):
        cache.update(k[None, :, :num_tokens].to(device), v[None, :, :num_tokens].to(device),
                     layer)
    return cache


def prefix_prefill(model, engine: CacheEngine, ids: torch.Tensor, prefix_len: int,
                   extra: torch.Tensor | None = None) -> torch.Tensor:
    """Prefix caching at its best: the KV of the prompt's first segment (a true prefix,
    `ids[:prefix_len]`) from the cache, everything after it computed.

    Args:
        ids: int64 `[num_tokens]`, the prompt; extra: tokens fed after it (teacher forcing).

    Returns:
        float32 `[1 + len(extra), vocab]`: logits from the prompt's last token on.
    """
    kv, ret_mask = engine.retrieve(ids[:prefix_len].cpu())
    num_cached = min(int(ret_mask.sum()), ids.numel() - 1)
    cache = cache_from_kv(kv, num_cached, model.device) if num_cached else DynamicCache()
    rest = ids[num_cached:] if extra is None else torch.cat([ids[num_cached:], extra])
    with prefix_attention(model):  # as generate_with_cache: no dense mask over the prefix
        logits = model(rest[None].to(model.device), **{CACHE_ARG: cache},
                       logits_to_keep=1 + (0 if extra is None else extra.numel())).logits[0]
    return logits.float()


def blended_logits(model, engine, ids, sep_id, extra, kwargs) -> tuple[torch.Tensor, object]:
    """blend_prefill, then `extra` fed over its cache: logits `[1 + len(extra), vocab]`."""
    out = blend_prefill(model, engine, ids, sep_id, **kwargs)
    rest = model(extra[None].to(model.device), **{CACHE_ARG: out.past_key_values}).logits[0]
    return torch.cat([out.logits[None], rest.float()]), out


@torch.inference_mode()
def run_quality(model, task, engine, num_prompts: int, pool_docs: int, seed: int) -> dict:
    """KL(full || method), top-1 agreement and accuracy over the answer positions.

    A pool of `pool_docs` held-out chunks is stored alone (store_segments); the prompts
    hold 4-6 of them (blend_task.BlendTask.prompts), kinds "continue" and "fact" in turn.
    """
    pool = task.chunks(random.Random(seed + 10), pool_docs, "held_out")
    prompts = task.prompts(random.Random(seed + 11), pool, num_prompts)
    sep = task.sep_id
    prefix_len = len(task.system_ids)
    started = time.perf_counter()
    # Chunks are stored alone (the last segment never is): every segment up to the last <sep>.
    num_stored = sum(store_segments(model, engine, torch.tensor(_docs_part(p, sep)), sep)
                     for p in prompts)
    store_s = time.perf_counter() - started
    names = ["full", "prefix"] + [name for name, _ in methods()]
    per = {name: {"kl": {"continue": [], "fact": []}, "top1": {"continue": [], "fact": []},
                  "hit": {"continue": [], "1_hop": [], "2_hop": []}, "recomputed": []}
           for name in names}
    for prompt in prompts:
        ids = torch.tensor(prompt.input_ids)
        answer = torch.tensor(prompt.answer_ids)
        extra = answer[:-1]
        full = model(torch.cat([ids, extra])[None], logits_to_keep=answer.numel()).logits[0]
        results = {"full": (full.float(), ids.numel()),
                   "prefix": (prefix_prefill(model, engine, ids, prefix_len, extra),
                              ids.numel() - prefix_len)}
        for name, kwargs in methods():
            logits, out = blended_logits(model, engine, ids, sep, extra, kwargs)
            results[name] = (logits, out.num_recomputed_tokens)
        ref = torch.log_softmax(results["full"][0].double(), -1)
        for name, (logits, recomputed) in results.items():
            d = per[name]
            logp = torch.log_softmax(logits.double(), -1)
            d["kl"][prompt.kind] += (ref.exp() * (ref - logp)).sum(-1).clamp_min(0).tolist()
            top = logits.argmax(-1)
            d["top1"][prompt.kind] += (top == ref.argmax(-1)).tolist()
            hit = top[:prompt.num_scored] == answer[:prompt.num_scored]
            if prompt.kind == "continue":
                d["hit"]["continue"] += hit.tolist()
            else:
                d["hit"][f"{prompt.hops}_hop"].append(bool(hit.all()))
            d["recomputed"].append(recomputed / ids.numel())
    summary = {}
    for name, d in per.items():
        kl_all = d["kl"]["continue"] + d["kl"]["fact"]
        entry = {"kl_mean": _mean(kl_all), "kl_median": median(kl_all),
                 "kl_p90": sorted(kl_all)[int(0.9 * (len(kl_all) - 1))],
                 "top1_agreement": _mean(d["top1"]["continue"] + d["top1"]["fact"]),
                 "recomputed_fraction_mean": _mean(d["recomputed"]), "num_positions": len(kl_all)}
        for kind in ("continue", "fact"):
            entry[f"kl_mean_{kind}"] = _mean(d["kl"][kind])
            entry[f"top1_agreement_{kind}"] = _mean(d["top1"][kind])
        entry["accuracy_continue"] = _mean(d["hit"]["continue"])
        entry["accuracy_1_hop"] = _mean(d["hit"]["1_hop"])
        entry["accuracy_2_hop"] = _mean(d["hit"]["2_hop"])
        summary[name] = entry
    lengths = [len(p.input_ids) for p in prompts]
    return {"num_prompts": len(prompts), "pool_docs": pool_docs,
            "prompt_tokens_median": median(lengths), "prompt_tokens_max": max(lengths),
            "num_prompts_by_kind": {"continue": sum(p.kind == "continue" for p in prompts),
                                    "fact_1_hop": sum(p.hops == 1 for p in prompts),
                                    "fact_2_hop": sum(p.hops == 2 for p in prompts)},
            "answer_positions": {"continue": len(prompts[0].answer_ids),
                                 "fact": len(prompts[1].answer_ids)},
            "store_tokens": num_stored, "store_s": store_s, "methods": summary}


def compare_quality(tree: dict, today: dict) -> str:
    """A table of each method's KL mean and top-1 agreement on this tree and on today's
    path (`run_quality`'s "methods"), with their absolute differences."""
    lines = ["| method | KL mean (tree / today) | top-1 (tree / today) | KL difference | "
             "top-1 difference |",
             "|---|---|---|---|---|"]
    for name, entry in tree.items():
        other = today[name]
        lines.append(f"| {name} | {entry['kl_mean']:.6f} / {other['kl_mean']:.6f} | "
                     f"{entry['top1_agreement']:.4f} / {other['top1_agreement']:.4f} | "
                     f"{abs(entry['kl_mean'] - other['kl_mean']):.1e} | "
                     f"{abs(entry['top1_agreement'] - other['top1_agreement']):.1e} |")
    return "\n".join(lines)


def _mean(values: list) -> float:
    return sum(values) / len(values) if values else float("nan")


def _docs_part(prompt, sep: int) -> list[int]:
    """The prompt up to and including its last <sep>: system prompt and documents."""
    last = len(prompt.input_ids) - 1 - prompt.input_ids[::-1].index(sep)
    return prompt.input_ids[:last + 1]


def ttft_prompt(task, rng: random.Random, num_tokens: int) -> tuple[list[int], int]:
    """`num_tokens` ids: system prompt, pydoc documents of TTFT_DOC_TOKENS, a question;
    and how many of them precede the question (the part stored by store_segments)."""
    question, _ = task.question(rng.choice(task.key_ids), (task.value_ids[0], task.value_ids[1]))
    ids = list(task.system_ids)
    while len(ids) + TTFT_DOC_TOKENS + len(question) <= num_tokens:
        ids += task.text(rng, TTFT_DOC_TOKENS - 1, "train") + [task.sep_id]
    ids += task.text(rng, num_tokens - len(ids) - len(question) - 1, "train") + [task.sep_id]
    return ids + question, len(ids)


@torch.inference_mode()
def run_speed(model, task, engine, lengths: list[int], repeats: int, names: list[str],
              seed: int, all_methods_max: int) -> dict:
    """TTFT of the methods at each prompt length (medians of `repeats` runs after a warm-up,
    methods interleaved): every method in `names` up to `all_methods_max` tokens, only
    CORE_METHODS above it.

    The documents are stored first (untimed here: `store_s` is their precompute); each
    timed call returns the first token (`argmax` of the last logits), CUDA synchronized.
    """
    device = model.device
    kwargs = dict(methods())
    out = {}
    for num_tokens in lengths:
        prompt, num_docs_tokens = ttft_prompt(task, random.Random(seed + num_tokens), num_tokens)
        ids_dev = torch.tensor(prompt, device=device)
        started = time.perf_counter()
        store_segments(model, engine, ids_dev[:num_docs_tokens], task.sep_id)
        sync(device)
        store_s = time.perf_counter() - started
        info = {}

        def call(name: str):
            if name == "full":
                return model(ids_dev[None], logits_to_keep=1).logits[0, -1].argmax()
            if name == "prefix":
                return prefix_prefill(model, engine, ids_dev, len(task.system_ids))[-1].argmax()
            result = blend_prefill(model, engine, ids_dev, task.sep_id, **kwargs[name])
            info[name] = (result.num_reused_tokens, result.num_recomputed_tokens)
            return result.logits.argmax()

        chosen = names if num_tokens <= all_methods_max else \
            [n for n in names if n in CORE_METHODS]
        samples = {name: [] for name in chosen}
        for run in range(1 + repeats):  # run 0 warms up
            order = chosen[run % len(chosen):] + chosen[:run % len(chosen)]
            for name in order:
                sync(device)
                start = time.perf_counter()
                int(call(name))
                sync(device)
                if run:
                    samples[name].append(time.perf_counter() - start)
        full_s = median(samples["full"])
        out[str(num_tokens)] = {
            "store_s": store_s,
            "methods": {name: {"median_s": median(s), "samples_s": s,
                               "x_full": full_s / median(s),
                               "num_reused_tokens": info.get(name, (None,))[0],
                               "num_recomputed_tokens": info.get(name, (None, None))[1]}
                        for name, s in samples.items()}}
        print(f"  {num_tokens} tokens: " + ", ".join(
            f"{n} {median(s) * 1e3:.0f} ms" for n, s in samples.items()), flush=True)
    return out


def speed_suite(label: str, model, task, lengths, repeats, names, seed, devices,
                all_methods_max: int) -> dict:
    """run_speed on each device, each model with its own private daemon."""
    out = {}
    for device in devices:
        model = model.to(device)
        layout = layout_for_model(model, 256, model_name=f"bench-blend-{label}")
        capacity_mib = max(256, 4 * layout.record_bytes(1) * sum(lengths) // 2**20)
        with running_daemon(f"{capacity_mib}MiB", record_block_size(layout),
                            name=f"bench-blend-{os.getpid()}-{label}-{device}") as socket, \
                CacheEngine.connect(layout, socket=socket, strict=True,
                                    data_timeout_s=30) as engine:
            print(f"TTFT, {label} model, {device}:", flush=True)
            out[device] = run_speed(model, task, engine, lengths, repeats, names, seed,
                                    all_methods_max)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 8 prompts, 1k-token TTFT prompts, 1 timed run per method")
    parser.add_argument("--out-dir", default=RESULTS, help="where the JSON, .md and PNG go")
    parser.add_argument("--num-prompts", type=int, help="quality prompts (default 40; quick 8)")
    parser.add_argument("--pool-docs", type=int, default=24,
                        help="documents stored once and shared by the prompts (default 24)")
    parser.add_argument("--lengths", help="TTFT prompt lengths, comma-separated "
                        "(default 2048,4096,8192; quick 1024)")
    parser.add_argument("--big-lengths", help="TTFT lengths of the 8-layer random model, "
                        f"methods {', '.join(CORE_METHODS)} (default 2048,4096, quick 1024; "
                        "'none' skips it; on 2 CPU cores its full prefill of 2k tokens takes "
                        "seconds)")
    parser.add_argument("--all-methods-max", type=int, default=4096,
                        help="time every method up to this prompt length, above it only "
                        f"{', '.join(CORE_METHODS)} (default 4096)")
    parser.add_argument("--repeats", type=int, help="timed runs per method (default 5; quick 1)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="model seed and prompt seed")
    parser.add_argument("--rope", choices=("default", "llama3"), default="default",
                        help="the trained model's RoPE (llama3: Llama 3 scaling; its own "
                        "weights, trained on first use)")
    parser.add_argument("--quality-only", action="store_true",
                        help="skip the TTFT runs; write <date>-blend-quality.json")
    parser.add_argument("--compare-today", action="store_true",
                        help="also run the quality part on today's path (blend_baseline.py) "
                        "and print the largest KL / top-1 differences")
    parser.add_argument("--train-steps", type=int, default=600,
                        help="steps of the trained model (train_blend_model.py --steps)")
    args = parser.parse_args()
    quick = args.quick
    num_prompts = args.num_prompts or (8 if quick else 40)
    lengths = [int(x) for x in (args.lengths or ("1024" if quick else "2048,4096,8192")).split(",")]
    big = args.big_lengths or ("1024" if quick else "2048,4096")
    all_methods_max = args.all_methods_max
    big_lengths = [] if big == "none" else [int(x) for x in big.split(",")]
    repeats = args.repeats or (1 if quick else 5)
    torch.set_num_threads(args.threads)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    started = time.perf_counter()
    model, task, meta = load_or_train(steps=args.train_steps, seed=args.seed, rope=args.rope)
    machine = machine_info()
    accuracy = meta["accuracy"]
    print(f"model {meta['cache_dir']}: held-out accuracy under full prefill: continuation "
          f"tokens {accuracy['continue']:.1%}, facts 1-hop {accuracy['1_hop']:.1%}, 2-hop "
          f"{accuracy['2_hop']:.1%}", flush=True)

    layout = layout_for_model(model, 256, model_name=f"bench-blend-{meta['key']}")
    with running_daemon("256MiB", record_block_size(layout),
                        name=f"bench-blend-{os.getpid()}-q") as socket, \
            CacheEngine.connect(layout, socket=socket, strict=True, data_timeout_s=30) as engine:
        print(f"quality: {num_prompts} prompts ...", flush=True)
        quality = run_quality(model, task, engine, num_prompts, args.pool_docs, args.seed)
        if args.compare_today:
            print(f"quality, today's path (blend_baseline.py): {num_prompts} prompts ...",
                  flush=True)
            with Baseline().active():
                today = run_quality(model, task, engine, num_prompts, args.pool_docs,
                                    args.seed)
            quality["today"] = today["methods"]
            print(compare_quality(quality["methods"], today["methods"]), flush=True)
    if args.quality_only:
        stem = f"{datetime.date.today().isoformat()}-blend-quality"
        path = os.path.join(args.out_dir, f"{stem}.json")
        os.makedirs(args.out_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump({"meta": {"command": " ".join(["python", "-m", "benchmarks.blend.bench_blend"]
                                                    + sys.argv[1:]), "machine": machine,
                                "duration_s": time.perf_counter() - started},
                       "model": {k: meta[k] for k in ("key", "cache_dir", "train", "accuracy")},
                       "quality": quality}, f, indent=1, default=blend_report.json_default)
        print(f"wrote {path}")
        return 0
    names = ["full", "prefix"] + [name for name, _ in methods()]
    speed = {"trained": speed_suite("trained", model, task, lengths, repeats, names,
                                    args.seed, devices, all_methods_max)}
    if big_lengths:
        torch.manual_seed(args.seed)
        big_model = LlamaForCausalLM(LlamaConfig(**BIG_CONFIG)).eval()
        speed["random_8l_1024"] = speed_suite("random", big_model, task, big_lengths, repeats,
                                              list(CORE_METHODS), args.seed, devices, 0)
    results = {
        "meta": {"date": datetime.date.today().isoformat(), "mode": "quick" if quick else "full",
                 "command": " ".join(["python", "-m", "benchmarks.blend.bench_blend"]
                                     + sys.argv[1:]),
                 "machine": machine, "threads": args.threads, "devices": devices,
                 "cuda": torch.cuda.get_device_name() if "cuda" in devices else None,
                 "duration_s": time.perf_counter() - started},
        "model": {k: meta[k] for k in ("key", "cache_dir", "model", "train", "accuracy")},
        "big_model": BIG_CONFIG, "quality": quality, "speed": speed,
    }
    stem = f"{results['meta']['date']}-blend" + ("-quick" if quick else "")
    paths = blend_report.write_outputs(results, args.out_dir, stem)
    print(blend_report.render(results, markdown=False))
    print("wrote " + ", ".join(paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
