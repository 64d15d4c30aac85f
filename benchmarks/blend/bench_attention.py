"""Attention without a dense mask (client/attention.py) against SDPA with the mask, before/after.

Why this file exists: the constants of client/attention.py (rows per group, when to pad
a short prefix) and CacheBlend's speed-ups over the dense mask come from here. In one process,
interleaved, medians of --repeats runs after a warm-up:

1. kernels: one attention of 8 heads (4 KV heads) of 64 over T keys, queries = the last
   T - P tokens (a cached prefix of P), a CacheBlend-like random 15% of the rows plus the
   last 3, or LegoLink-like runs of 16 rows every 512 plus the last 3: SDPA with the
   boolean mask (before) vs `attend_at_positions` (after), for several group sizes;
2. blend: TTFT of a full prefill, CacheBlend 0.15 and LegoLink 16 (`blend_prefill`) on
   the random-weight 8-layer Llama of bench_blend.py (hidden 1024, 16/4 heads), prompts
   of a 15-token system prompt, 512-token documents stored alone beforehand and a 3-token
   question (bench_blend's TTFT prompts, random token ids), three ways: "today" (the
   dense-mask path: layer loop, executors and re-rotation of
   blend_baseline.BASELINE_REV, the selected rows' attention as SDPA with the dense
   mask), "mask" (this tree with only the attention swapped for SDPA with the mask) and
   "after" (this tree); today / after is the issue's gain, mask / after the attention's
   share of it; and the largest |logit| difference and the KL between today and after.

    .venv/bin/python -m benchmarks.blend.bench_attention                 # kernels + blend 4k
    .venv/bin/python -m benchmarks.blend.bench_attention --kernel-keys 0 --blend-lengths 8192
"""

import argparse
import contextlib
import os
import sys
import time

import torch

from benchmarks.blend.bench_blend import BIG_CONFIG
from benchmarks.blend.blend_baseline import Baseline, masked_attention
from benchmarks.common import median, record_block_size, running_daemon
from transformers import LlamaConfig, LlamaForCausalLM

from lmcached.client import hf_blend
from lmcached.client.attention import attend_at_positions
from lmcached.client.engine import CacheEngine
from lmcached.client.hf import blend_prefill, layout_for_model, store_segments

SEP = BIG_CONFIG["vocab_size"] - 1
DOC_TOKENS = 512
VARIANTS = ("today", "mask", "after")


def interleaved(fns: dict, repeats: int) -> dict:
    """Median seconds of each callable, runs interleaved, one warm-up each."""
    samples = {name: [] for name in fns}
    names = list(fns)
    for run in range(1 + repeats):
        for name in names[run % len(names):] + names[:run % len(names)]:
            started = time.perf_counter()
            fns[name]()
            if run:
                samples[name].append(time.perf_counter() - started)
    return {name: median(s) for name, s in samples.items()}


def bench_kernels(num_keys: int, repeats: int) -> None:
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(1, 4, num_keys, 64, generator=gen)
    value = torch.randn(1, 4, num_keys, 64, generator=gen)
    cases = {f"prefix {p}": torch.arange(p, num_keys) for p in (0, 64, 256, num_keys // 4,
                                                                 num_keys // 2, num_keys - 256)}
    picked = torch.randperm(num_keys - 3, generator=gen)[:int(0.15 * num_keys)].sort().values
    cases["cacheblend 15%"] = torch.cat((picked, torch.arange(num_keys - 3, num_keys)))
    heads = [torch.arange(start, start + 16) for start in range(15 + 512, num_keys - 19, 512)]
    cases["legolink 16"] = torch.cat((*heads, torch.arange(num_keys - 3, num_keys)))
    print(f"kernels, {num_keys} keys, 8 heads (4 kv) of 64, fp32:", flush=True)
    for name, positions in cases.items():
        query = torch.randn(1, 8, positions.numel(), 64, generator=gen)
        fns = {"mask": lambda: masked_attention(query, key, value, positions)}
        groups = (32, 64, 128, 256) if name.startswith("cacheblend") else (64,)
        for rows in groups:
            fns[f"groups of {rows}"] = (lambda rows=rows: attend_at_positions(
                query, key, value, positions, group_rows=rows))
        times = interleaved(fns, repeats)
        print(f"  {name}: " + ", ".join(
            f"{n} {t * 1e3:.1f} ms ({times['mask'] / t:.2f}x)" for n, t in times.items()),
            flush=True)


def blend_prompt(num_tokens: int, seed: int) -> tuple[torch.Tensor, int]:
    """System prompt + documents of DOC_TOKENS (separator included) + 3-token question;
    and the number of tokens before the question."""
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randint(0, SEP, (14,), generator=gen), torch.tensor([SEP])]
    length = 15
    while length + 3 < num_tokens:
        size = min(DOC_TOKENS, num_tokens - 3 - length)
        parts += [torch.randint(0, SEP, (size - 1,), generator=gen), torch.tensor([SEP])]
        length += size
    parts.append(torch.randint(0, SEP, (3,), generator=gen))
    return torch.cat(parts), length


@torch.inference_mode()
def bench_blend(lengths: list[int], repeats: int, seed: int, with_full: bool) -> None:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**BIG_CONFIG)).eval()
    layout = layout_for_model(model, 256, model_name="bench-attention")
    capacity_mib = max(256, 3 * layout.record_bytes(1) * max(lengths) // 2**20)
    methods = {"cacheblend 0.15": dict(strategy="cacheblend", recompute_ratio=0.15),
               "legolink 16": dict(strategy="legolink", legolink_k=16)}
    baseline = Baseline()
    rows = []
    with running_daemon(f"{capacity_mib}MiB", record_block_size(layout)) as socket, \
            CacheEngine.connect(layout, socket=socket, strict=True,
                                data_timeout_s=60) as engine:
        for num_tokens in lengths:
            ids, num_docs = blend_prompt(num_tokens, seed + num_tokens)
            store_segments(model, engine, ids[:num_docs], SEP)
            logits = {}

            def run(name: str, kwargs: dict, variant: str):
                real = hf_blend.attend_at_positions
                if variant == "mask":
                    hf_blend.attend_at_positions = masked_attention
                try:
                    with baseline.active() if variant == "today" else contextlib.nullcontext():
                        logits[name] = blend_prefill(model, engine, ids, SEP, **kwargs).logits
                finally:
                    hf_blend.attend_at_positions = real

            fns = {"full": lambda: model(ids[None], logits_to_keep=1)} if with_full else {}
            for name, kwargs in methods.items():
                for variant in VARIANTS:
                    fns[f"{name} {variant}"] = (lambda n=f"{name} {variant}", k=kwargs,
                                                v=variant: run(n, k, v))
            load = os.getloadavg()[0]
            times = interleaved(fns, repeats)
            load = max(load, os.getloadavg()[0])
            full = times.get("full", float("nan"))
            print(f"  {num_tokens} tokens (load {load:.1f}): full {full * 1e3:.0f} ms",
                  flush=True)
            for name in methods:
                today, mask, after = (times[f"{name} {v}"] for v in VARIANTS)
                a, b = logits[f"{name} today"].double(), logits[f"{name} after"].double()
                kl = float((a.softmax(-1) * (a.log_softmax(-1) - b.log_softmax(-1))).sum())
                diff = float((a - b).abs().max())
                rows.append((num_tokens, load, name, full, today, mask, after, diff, kl))
                print(f"    {name}: today {today * 1e3:.0f} ms ({full / today:.2f}x), mask "
                      f"{mask * 1e3:.0f} ms, after {after * 1e3:.0f} ms ({full / after:.2f}x); "
                      f"today / after {today / after:.2f}x, mask / after {mask / after:.2f}x; "
                      f"max |logit diff| {diff:.1e}, KL(today || after) {kl:.1e}", flush=True)
    print("\n| prompt | load | method | full prefill | today | mask | after | today / after | "
          "mask / after | max abs logit diff | KL |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for num_tokens, load, name, full, today, mask, after, diff, kl in rows:
        print(f"| {num_tokens} | {load:.1f} | {name} | {full * 1e3:.0f} ms | {today * 1e3:.0f} ms "
              f"({full / today:.2f}x) | {mask * 1e3:.0f} ms | {after * 1e3:.0f} ms "
              f"({full / after:.2f}x) | {today / after:.2f}x | {mask / after:.2f}x | "
              f"{diff:.1e} | {kl:.1e} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel-keys", type=int, default=4096,
                        help="keys of the kernel runs (default 4096; 0 skips them)")
    parser.add_argument("--blend-lengths", default="4096",
                        help="prompt lengths of the blend runs, comma-separated (default "
                        "4096; 'none' skips them)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per method (3)")
    parser.add_argument("--no-full", action="store_true",
                        help="skip the full prefill of the blend runs (today / after needs "
                        "none; it takes most of their time)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads", flush=True)
    if args.kernel_keys:
        bench_kernels(args.kernel_keys, args.repeats)
    if args.blend_lengths != "none":
        print(f"blend, random Llama {BIG_CONFIG}:", flush=True)
        bench_blend([int(x) for x in args.blend_lengths.split(",")], args.repeats, args.seed,
                    not args.no_full)
    return 0


if __name__ == "__main__":
    sys.exit(main())
