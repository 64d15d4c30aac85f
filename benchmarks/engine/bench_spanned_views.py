"""Views and retrieves of chunk records that span several blocks, as ratios to one block
per chunk in the same run.

KV: Llama-3-8B (32 layers, 8 KV heads, head_size 128, bfloat16: a 32 MiB + 2,112-byte
record per 256-token chunk). Two daemons of the same capacity, every op run on each in
turn in each round: one started with `--block-size` = the record (one block per chunk), one without,
whose derived block cuts each record into two equal blocks (a 512 MiB arena holds fewer
than 16 whole records). Median of --repeat rounds of:

    retrieve out=    engine.retrieve into a touched destination
    views            engine.retrieve_views, open and close
    views layers     open, `views.layer(i)` for every layer, close (a view of each
                     layer, a copy of each layer that crosses a block boundary)
    views+copy       views copied into a touched destination (RetrievedViews.copy_to)

    python -m benchmarks.engine.bench_spanned_views [--tokens 2048] [--repeat 7]
"""

import argparse
import contextlib
import os
import time

import torch

from benchmarks.common import LLAMA_8B, median, record_block_size, running_daemon
from lmcached.client import CacheEngine

CAPACITY = "512MiB"


def ops(engine: CacheEngine, tokens: torch.Tensor, dst: torch.Tensor) -> dict:
    """The timed operations on `engine`, whose daemon holds the prompt `tokens`."""

    def layers() -> None:
        with engine.retrieve_views(tokens) as views:
            for layer in range(LLAMA_8B.num_layers):
                views.layer(layer)

    def views_copy() -> None:
        with engine.retrieve_views(tokens) as views:
            views.copy_to(dst)

    return {
        "retrieve out=": lambda: engine.retrieve(tokens, return_tuple=False, out=dst),
        "views": lambda: engine.retrieve_views(tokens).release(),
        "views layers": layers,
        "views+copy": views_copy,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(2)
    tokens = torch.arange(args.tokens)
    kv = torch.ones(LLAMA_8B.chunk_shape(args.tokens), dtype=LLAMA_8B.torch_dtype)
    dst = torch.zeros_like(kv)
    labels = {"one block": record_block_size(LLAMA_8B), "spanned": None}
    with contextlib.ExitStack() as stack:
        timed, num_blocks = {}, {}
        for label, block_size in labels.items():
            socket = stack.enter_context(running_daemon(CAPACITY, block_size,
                                                        name=f"bench-{label[:3]}-{os.getpid()}"))
            engine = stack.enter_context(CacheEngine.connect(LLAMA_8B, socket=socket,
                                                             strict=True))
            assert engine.store(tokens, kv) == args.tokens // LLAMA_8B.chunk_size
            got, _ = engine.retrieve(tokens, return_tuple=False, out=dst)
            assert torch.equal(got, kv), "retrieved bytes differ"
            with engine.retrieve_views(tokens) as views:
                num_blocks[label] = len(views.block_ids)
            timed[label] = ops(engine, tokens, dst)
        samples = {(label, op): [] for label in labels for op in timed[label]}
        for round_ in range(args.repeat + 1):  # the first round warms up
            for (label, op) in samples:
                start = time.perf_counter()
                timed[label][op]()
                if round_:
                    samples[label, op].append(time.perf_counter() - start)
    print(f"{args.tokens} Llama-3-8B tokens, {CAPACITY} arenas: {num_blocks['one block']} "
          f"blocks (one per chunk) against {num_blocks['spanned']}; median of {args.repeat}")
    print(f"{'op':>14} {'one block ms':>13} {'spanned ms':>11} {'spanned / one':>14}")
    for op in timed["one block"]:
        one, spanned = median(samples["one block", op]), median(samples["spanned", op])
        print(f"{op:>14} {one * 1e3:13.3f} {spanned * 1e3:11.3f} {spanned / one:13.2f}x")


if __name__ == "__main__":
    main()
