"""Prefix caching with transformers: TTFT of generate_with_cache with a cached prefix vs none.

Why this file exists: a cache hit must never make the first token slower.
With transformers' "sdpa" attention, queries that follow cached keys get an explicit
mask, and PyTorch's CPU kernel with a mask is about twice as slow as its causal kernel,
so a short hit cost more than it saved. This script times, in one process, methods
interleaved, medians (and minima: the machines here are shared) of --repeats runs after a
warm-up:

    no cache   generate_with_cache(model, None, ids)
    before     the cached prefix with transformers' sdpa (what generate_with_cache did
               before client/hf_attention.py: `prefix_attention` replaced by a no-op here)
    after      the cached prefix with "lmcached_sdpa" (client/attention.py)

on a random-weight Llama (4 layers, hidden 512, 8/4 heads of 64, vocab 8000: the demo's
shape, fewer layers), the prompt's first tokens stored beforehand by another call
(chunks of 256). `--crossover` times short hits (chunks of 16) against no cache: where
using a hit stops paying, which sets `DEFAULT_MIN_CACHED_TOKENS` in client/hf.py.
TTFT is `GenerationResult.ttft_s` (retrieve + prefill + first token).

    .venv/bin/python -m benchmarks.hf.bench_hf                       # the issue's table
    .venv/bin/python -m benchmarks.hf.bench_hf --crossover 4096:0,16,32,64,256
"""

import argparse
import contextlib
import sys

import torch

from benchmarks.common import median, record_block_size, running_daemon
from transformers import LlamaConfig, LlamaForCausalLM

from lmcached.client import hf
from lmcached.client.engine import CacheEngine
from lmcached.client.hf import generate_with_cache, layout_for_model

CONFIG = dict(vocab_size=8000, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=8192)
DEFAULT_CASES = "2048:256,2048:1024,4096:256,4096:2048,4096:3840"


def ttft(model, engine, ids, method: str) -> float:
    """Seconds to the first token of one generate_with_cache call (nothing stored)."""
    if method == "no cache":
        return generate_with_cache(model, None, ids, max_new_tokens=1).ttft_s
    patch = contextlib.nullcontext if method == "before" else hf.prefix_attention
    real, hf.prefix_attention = hf.prefix_attention, patch
    try:
        result = generate_with_cache(model, engine, ids, max_new_tokens=1, store=False,
                                     min_cached_tokens=0)
    finally:
        hf.prefix_attention = real
    return result.ttft_s


def run_cases(model, engine, cases, methods, repeats: int, seed: int) -> list[dict]:
    """Per (prompt tokens, cached tokens): median TTFT of each method."""
    rows = []
    for num_tokens, num_cached in cases:
        ids = torch.randint(0, CONFIG["vocab_size"], (num_tokens,),
                            generator=torch.Generator().manual_seed(seed + num_tokens + num_cached))
        if num_cached:  # another call stored the first tokens
            generate_with_cache(model, engine, ids[:num_cached], max_new_tokens=1,
                                min_cached_tokens=0)
        samples = {m: [] for m in methods}
        for run in range(1 + repeats):  # run 0 warms up
            order = methods[run % len(methods):] + methods[:run % len(methods)]
            for method in order:
                seconds = ttft(model, engine, ids, method)
                if run:
                    samples[method].append(seconds)
        row = {"num_tokens": num_tokens, "num_cached": num_cached,
               **{m: median(s) for m, s in samples.items()},
               **{f"{m} min": min(s) for m, s in samples.items()}}
        rows.append(row)
        print(f"  {num_tokens} tokens, {num_cached} cached: " + ", ".join(
            f"{m} {row[m] * 1e3:.0f} ms ({row['no cache'] / row[m]:.2f}x; min "
            f"{row[m + ' min'] * 1e3:.0f} ms, {row['no cache min'] / row[m + ' min']:.2f}x)"
            for m in methods), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=DEFAULT_CASES,
                        help=f"prompt:cached token pairs (default {DEFAULT_CASES}); 'none' skips")
    parser.add_argument("--crossover", help="prompt:cached,cached,... of short hits "
                        "(chunks of 16) timed against no cache, e.g. 4096:16,32,64,256")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per method (3)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    print(f"torch {torch.__version__}, {args.threads} threads, Llama {CONFIG}", flush=True)
    if args.cases != "none":
        cases = [tuple(int(x) for x in pair.split(":")) for pair in args.cases.split(",")]
        layout = layout_for_model(model, 256, model_name="bench-hf")
        with running_daemon("256MiB", record_block_size(layout)) as socket, \
                CacheEngine.connect(layout, socket=socket, strict=True) as engine:
            print("no cache / before (sdpa, explicit mask) / after (lmcached_sdpa):")
            rows = run_cases(model, engine, cases, ["no cache", "before", "after"],
                             args.repeats, args.seed)
        print("\n| prompt | cached prefix | no cache | before | after |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['num_tokens']} | {r['num_cached']} | {r['no cache'] * 1e3:.0f} ms | "
                  + " | ".join(f"{r[m] * 1e3:.0f} ms ({r['no cache'] / r[m]:.2f}x)"
                               for m in ("before", "after")) + " |")
    if args.crossover:
        length, cached = args.crossover.split(":")
        cases = [(int(length), int(c)) for c in cached.split(",")]
        layout = layout_for_model(model, 16, model_name="bench-hf-16")
        with running_daemon("256MiB", record_block_size(layout)) as socket, \
                CacheEngine.connect(layout, socket=socket, strict=True) as engine:
            print("crossover, chunks of 16: no cache / after (any hit used):")
            run_cases(model, engine, cases, ["no cache", "after"], args.repeats, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
