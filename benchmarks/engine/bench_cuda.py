"""GPU <-> arena throughput on Llama-3-8B-shaped KV, as ratios to torch's own copies.

For each prompt length, median of --repeat runs of:

    d2h pinned      torch copy GPU -> page-locked host buffer (the DMA ceiling)
    d2h pageable    torch copy GPU -> ordinary host buffer
    h2d pinned      torch copy page-locked host buffer -> GPU
    store           engine.store of a GPU blob (after CLEAR), arena pageable / registered
    retrieve        engine.retrieve into a GPU out= buffer, arena pageable / registered

    python -m benchmarks.engine.bench_cuda [--tokens 4096 16384] [--repeat 5]
"""

import argparse

import torch

from benchmarks.common import GB, median, record_block_size, running_daemon, synced, time_it
from lmcached.client import CacheEngine, KVLayout
from lmcached.wire.connection import Connection, hello
from lmcached.wire.protocol import Clear

LAYOUT = KVLayout("llama-3-8b", num_layers=32, num_kv_heads=8, head_size=128,
                  dtype="bfloat16", chunk_size=256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_cuda.py needs a CUDA device")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    longest = max(args.tokens)
    capacity_mib = longest * LAYOUT.token_bytes * 5 // 4 // 2**20 + 256
    with running_daemon(f"{capacity_mib}MiB", record_block_size(LAYOUT)) as socket, \
            Connection(socket) as admin:
        hello(admin, "bench-cuda")
        engines = {
            registered: CacheEngine.connect(LAYOUT, socket=socket, strict=True,
                                            cuda_register=registered)
            for registered in (False, True)
        }
        print(f"{'tokens':>7} {'op':>28} {'median ms':>10} {'GB/s':>7} {'vs d2h/h2d pinned':>18}")
        for num_tokens in args.tokens:
            nbytes = num_tokens * LAYOUT.token_bytes
            shape = LAYOUT.chunk_shape(num_tokens)
            src = torch.randn(shape, device="cuda").to(torch.bfloat16)
            out = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
            pinned = torch.empty(shape, dtype=torch.bfloat16, pin_memory=True)
            pageable = torch.empty(shape, dtype=torch.bfloat16)
            pageable.zero_()
            tokens = torch.arange(num_tokens) + 10_000_000 * num_tokens
            res = {
                "d2h pinned": time_it(synced(lambda: pinned.copy_(src, non_blocking=True)), args.repeat),
                "d2h pageable": time_it(synced(lambda: pageable.copy_(src)), args.repeat),
                "h2d pinned": time_it(synced(lambda: out.copy_(pinned, non_blocking=True)), args.repeat),
            }
            for registered, engine in engines.items():
                kind = "registered" if registered else "pageable"
                res[f"store from GPU ({kind})"] = time_it(
                    lambda: engine.store(tokens, src), args.repeat,
                    setup=lambda: admin.request(Clear()))
                engine.store(tokens, src)
                res[f"retrieve to GPU ({kind})"] = time_it(
                    lambda: engine.retrieve(tokens, return_tuple=False, out=out), args.repeat)
                got, _ = engine.retrieve(tokens, return_tuple=False, out=out)
                assert torch.equal(got, src), "retrieved bytes differ"
            d2h, h2d = median(res["d2h pinned"]), median(res["h2d pinned"])
            for op, samples in res.items():
                med = median(samples)
                base = h2d if op.startswith(("h2d", "retrieve")) else d2h
                print(f"{num_tokens:>7} {op:>28} {med * 1e3:10.2f} {nbytes / med / GB:7.2f} "
                      f"{base / med:17.2f}x")
            admin.request(Clear())
        for engine in engines.values():
            engine.close()


if __name__ == "__main__":
    main()
