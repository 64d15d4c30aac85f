"""CacheBlend's quality inside vLLM against the Hugging Face path, on the trained model.

    .venv-vllm/bin/python -m benchmarks.vllm.bench_vllm_blend_quality --out-dir /tmp/lmc-quality \\
        [--num-prompts 40] [--pool-docs 24]

Why: the vLLM blend (client/vllm/blend_worker.py) and `blend_prefill` (client/hf.py) share
the selection and re-rotation of `lmcached.client.blend`, but not the layer loop, the
attention, vLLM's paged cache or its sampler. On the same prompts, over the same trained
weights, their KL divergence and top-1 agreement against a full prefill should be equal
within noise; a gap points at a RoPE, dtype or row-selection difference.

Needs the model of benchmarks/blend/train_blend_model.py in its cache (run that first; this
script never trains). The prompts are bench_blend.py's quality prompts (same seeds: 4-6
held-out pydoc chunks, "continue" and "fact" kinds in turn). For the first answer token
of each prompt (the distribution after the prompt's last token), in one run:

- Hugging Face: a full prefill, and `blend_prefill` for each method over documents stored
  by `store_segments` (a private daemon; float32);
- vLLM (tests/vllm_e2e.py, one in-process vLLM 0.32 CPU instance, float32,
  `LMCachedLlamaForCausalLM`, the connector on a second private daemon, vLLM's own prefix
  cache off so that no request is served another's blended blocks, all requests under
  one cache salt): one pass of blend requests that meets (stores) the documents, a pass of
  plain requests (vLLM's full prefill), then one pass per method; logprobs over the whole
  vocabulary (`logprobs` = `max_logprobs` = vocab size).

Reports KL(full || method) (nats, mean and p90 over the prompts) and the top-1 agreement,
each path against its own full prefill, plus how far the two paths are from each other
(max |logprob difference| of the full prefills; KL(HF method || vLLM method)). Writes
OUT_DIR/quality-figures.json.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import time

import torch

from benchmarks.blend.bench_blend import methods
from benchmarks.vllm.bench_vllm_blend import E2E
from benchmarks.common import median, record_block_size, running_daemon
from benchmarks.blend.train_blend_model import CACHE_ROOT, cache_key, load_or_train

from lmcached.client.engine import CacheEngine
from lmcached.client.hf import blend_prefill, layout_for_model, store_segments
from lmcached.launcher import temporary_daemon


def transfer_params(kwargs: dict, sep: int) -> dict:
    """blend_prefill's kwargs as a vLLM request's `lmcached_blend` parameters."""
    if kwargs["strategy"] == "legolink":
        return {"separator": sep, "strategy": "legolink", "legolink_k": kwargs["legolink_k"]}
    return {"separator": sep, "recompute_ratio": kwargs["recompute_ratio"]}


@torch.inference_mode()
def hf_logprobs(model, task, prompts, socket: str) -> tuple[dict, float]:
    """First-answer-token log-probabilities on the Hugging Face path.

    Returns:
        ({"full" or method: float64 `[num_prompts, vocab]`}, seconds spent).
    """
    started = time.perf_counter()
    layout = layout_for_model(model, 256, model_name="bench-vllm-quality-hf")
    out: dict[str, list[torch.Tensor]] = {"full": []}
    with CacheEngine.connect(layout, socket=socket, strict=True, data_timeout_s=30) as engine:
        for prompt in prompts:
            ids = torch.tensor(prompt.input_ids)
            last = len(ids) - 1 - prompt.input_ids[::-1].index(task.sep_id)
            store_segments(model, engine, ids[:last + 1], task.sep_id)
        for prompt in prompts:
            ids = torch.tensor(prompt.input_ids)
            out["full"].append(model(ids[None], logits_to_keep=1).logits[0, -1])
            for name, kwargs in methods():
                result = blend_prefill(model, engine, ids, task.sep_id, **kwargs)
                out.setdefault(name, []).append(result.logits)
    logprobs = {name: torch.log_softmax(torch.stack(rows).double(), -1)
                for name, rows in out.items()}
    return logprobs, time.perf_counter() - started


def vllm_logprobs(model_dir: str, task, prompts, vocab: int, out_dir: str) -> tuple[dict, dict]:
    """The same on vLLM: (log-probabilities as in hf_logprobs, the run's JSON result)."""
    sep = task.sep_id
    store = {"recompute_ratio": 1.0, "strategy": "cacheblend"}
    passes = [("store", store)] + [("full", None)] + methods()
    requests = []
    for _, kwargs in passes:
        for prompt in prompts:
            request = {"prompt_token_ids": prompt.input_ids}
            if kwargs is not None:
                request["kv_transfer_params"] = {"lmcached_blend": transfer_params(kwargs, sep)}
            requests.append(request)
    prompts_path = os.path.join(out_dir, "quality.in.json")
    result_path = os.path.join(out_dir, "quality.json")
    with open(prompts_path, "w") as f:
        json.dump(requests, f)
    max_len = max(len(p.input_ids) for p in prompts) + 8
    with temporary_daemon("--capacity", "512MiB",
                          name=f"bench-vllm-quality-{os.getpid()}") as socket:
        cmd = [sys.executable, E2E, "run", "--model", model_dir, "--prompts", prompts_path,
               "--out", result_path, "--socket", socket, "--mode", "outputs",
               "--max-tokens", "1", "--batch", str(len(prompts)), "--logprobs", str(vocab),
               "--blend-model", "--dtype", "float32", "--max-model-len", str(max_len),
               "--cache-salt", "quality", "--no-prefix-caching"]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        with open(os.path.join(out_dir, "quality.log"), "w") as log:
            subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=True,
                           timeout=1200)
    with open(result_path) as f:
        run = json.load(f)
    logprobs = {}
    for index, (name, _) in enumerate(passes):
        rows = torch.full((len(prompts), vocab), float("-inf"), dtype=torch.float64)
        for row, entry in enumerate(run["logprobs"][index * len(prompts):(index + 1) * len(prompts)]):
            for token, value in entry.items():
                rows[row, int(token)] = value
        if bool(torch.isinf(rows).any()):
            raise RuntimeError("vLLM returned fewer logprobs than the vocabulary: raise "
                               "--logprobs / max_logprobs to the vocab size")
        logprobs[name] = torch.log_softmax(rows, -1)  # renormalize fp32 rounding
    return logprobs, run


def compare(ref: torch.Tensor, other: torch.Tensor) -> dict:
    """KL(ref || other) per prompt (nats) and top-1 agreement, float64 `[P, vocab]` each."""
    kl = (ref.exp() * (ref - other)).sum(-1).clamp_min(0)
    ordered = sorted(kl.tolist())
    return {"kl_mean": float(kl.mean()), "kl_median": median(ordered),
            "kl_p90": ordered[int(0.9 * (len(ordered) - 1))],
            "top1_agreement": float((ref.argmax(-1) == other.argmax(-1)).double().mean())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--pool-docs", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0, help="model seed and prompt seed")
    parser.add_argument("--train-steps", type=int, default=600)
    parser.add_argument("--rope", choices=("default", "llama3"), default="default")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (HF path)")
    args = parser.parse_args()
    out_dir = os.path.abspath(args.out_dir)
    os.makedirs(out_dir, exist_ok=True)
    cache_dir = os.path.join(CACHE_ROOT, cache_key(args.train_steps, args.seed, args.rope))
    if not os.path.exists(os.path.join(cache_dir, "meta.json")):
        parser.error(f"no trained model in {cache_dir}: run python -m "
                     f"benchmarks.blend.train_blend_model "
                     f"--steps {args.train_steps} --seed {args.seed} --rope {args.rope} first")
    torch.set_num_threads(args.threads)
    model, task, meta = load_or_train(steps=args.train_steps, seed=args.seed, rope=args.rope)
    pool = task.chunks(random.Random(args.seed + 10), args.pool_docs, "held_out")
    prompts = task.prompts(random.Random(args.seed + 11), pool, args.num_prompts)
    vocab = model.config.vocab_size
    with running_daemon("256MiB", record_block_size(layout_for_model(model, 256)),
                        name=f"bench-vllm-quality-hf-{os.getpid()}") as socket:
        hf, hf_s = hf_logprobs(model, task, prompts, socket)
    started = time.perf_counter()
    vl, run = vllm_logprobs(cache_dir, task, prompts, vocab, out_dir)
    vllm_s = time.perf_counter() - started
    names = [name for name, _ in methods()]
    figures = {"hf": {n: compare(hf["full"], hf[n]) for n in names},
               "vllm": {n: compare(vl["full"], vl[n]) for n in names},
               "hf_vs_vllm": {n: compare(hf[n], vl[n]) for n in ["full"] + names},
               "full_max_abs_logprob_diff": float((hf["full"] - vl["full"]).abs().max()),
               "blend_counters": run.get("blend"), "num_prompts": len(prompts),
               "prompt_tokens_median": median([len(p.input_ids) for p in prompts]),
               "model": meta["cache_dir"], "hf_s": hf_s, "vllm_s": vllm_s}
    print(f"first answer token of {len(prompts)} prompts (median "
          f"{figures['prompt_tokens_median']} tokens), trained model {meta['key']}, float32; "
          "each path against its own full prefill")
    print("method".ljust(18) + "KL mean HF / vLLM".rjust(24) + "KL p90 HF / vLLM".rjust(24)
          + "top-1 HF / vLLM".rjust(20) + "KL(HF || vLLM)".rjust(18))
    for name in names:
        h, v, x = figures["hf"][name], figures["vllm"][name], figures["hf_vs_vllm"][name]
        print(name.ljust(18) + f"{h['kl_mean']:.2e} / {v['kl_mean']:.2e}".rjust(24)
              + f"{h['kl_p90']:.2e} / {v['kl_p90']:.2e}".rjust(24)
              + f"{h['top1_agreement']:.1%} / {v['top1_agreement']:.1%}".rjust(20)
              + f"{x['kl_mean']:.1e}".rjust(18))
    print(f"full prefills, HF vs vLLM: max |logprob difference| "
          f"{figures['full_max_abs_logprob_diff']:.1e}, KL {figures['hf_vs_vllm']['full']['kl_mean']:.1e}")
    print("vLLM blend counters:", run.get("blend"))
    print(f"HF path {hf_s:.0f} s, vLLM path {vllm_s:.0f} s")
    with open(os.path.join(out_dir, "quality-figures.json"), "w") as f:
        json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
