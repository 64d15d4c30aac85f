"""The vLLM connector's worker side: saving and loading vLLM's paged KV through the arena.

No vLLM needed: LMCachedConnectorWorker is driven the way the connector drives it.
Llama-3-8B-shaped KV (32 layers, 8 KV heads, head_size 128, bf16), chunks of 256 tokens,
a paged cache per layer in vLLM 0.32's layouts: on a GPU the LBNHC view (blocks of 16
tokens, allocated [num_blocks, block_size, heads, 2*head_size] and seen as [num_blocks,
heads, block_size, 2*head_size]); on CPU the CPU backend's dense [num_blocks, heads,
block_size (128), 2*head_size]. Blocks of a request are scattered over the cache.

For each prompt length, median of --repeat runs of:

    one copy      one copy of the same bytes, device -> page-locked host buffer (GPU)
                  or np.copyto (CPU): the ceiling for any save or load
    per-block     the (layer, block) pages copied one by one into a host buffer: what a
                  worker without batching does (GPU only)
    save          worker.save: ALLOC, gather every chunk into the arena, COMMIT (after CLEAR)
    load          worker.load of the same chunks (record checks, scatter into other blocks)

    python -m benchmarks.vllm.bench_vllm_worker [--tokens 4096 16384] [--repeat 5] [--device cuda]
"""

import argparse

import numpy as np
import torch

from benchmarks.common import GB, median, record_block_size, running_daemon, synced, time_it
from lmcached.client.daemon_link import DaemonLink
from lmcached.client.hashing import hash_request_tokens
from lmcached.client.layout import KVLayout
from lmcached.client.serving.specs import ConnectorSettings, LoadSpec, SaveSpec
from lmcached.client.vllm.worker import LMCachedConnectorWorker
from lmcached.wire.connection import Connection, hello
from lmcached.wire.protocol import Clear, Ping

NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE, CHUNK = 32, 8, 128, 256


def paged_cache(device: str, num_blocks: int, block_size: int) -> torch.Tensor:
    """One layer's paged KV cache, bf16, in the layout vLLM 0.32 registers on `device`."""
    if device == "cpu":
        return torch.randn(num_blocks, NUM_KV_HEADS, block_size, 2 * HEAD_SIZE).to(torch.bfloat16)
    base = torch.randn(num_blocks, block_size, NUM_KV_HEADS, 2 * HEAD_SIZE, device=device)
    return base.to(torch.bfloat16).permute(0, 2, 1, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", choices=["cuda", "cpu"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = args.device
    block_size = 16 if device == "cuda" else 128
    longest = max(args.tokens)
    blocks_needed = longest // block_size
    num_blocks = 2 * blocks_needed + 8  # room to load into blocks the save did not use
    caches = {f"layer.{i}": paged_cache(device, num_blocks, block_size) for i in range(NUM_LAYERS)}
    layers = list(caches)
    page_bytes = caches[layers[0]][0].numel() * 2
    token_bytes = NUM_LAYERS * page_bytes // block_size
    layout = KVLayout("bench-vllm-worker", num_layers=NUM_LAYERS, num_kv_heads=1,
                      head_size=page_bytes // (2 * block_size), dtype="uint8",
                      chunk_size=CHUNK, fmt="vllm")
    capacity_mib = longest * token_bytes * 5 // 4 // 2**20 + 256
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"device: {name}, torch {torch.__version__}; {NUM_LAYERS} layers, {page_bytes // 1024} "
          f"KiB pages of {block_size} tokens, chunks of {CHUNK} tokens")
    rng = np.random.default_rng(0)
    with running_daemon(f"{capacity_mib}MiB", record_block_size(layout)) as socket, \
            Connection(socket) as admin:
        hello(admin, "bench-vllm-worker")
        settings = ConnectorSettings([layout], CHUNK, block_size, 1, socket, "unused", 30.0)
        worker = LMCachedConnectorWorker(settings, rank=0)
        worker.register(caches, layers, {}, page_bytes)
        reader = DaemonLink(socket, layouts=[layout.to_wire()], client_name="bench-reader")
        print(f"{'tokens':>7} {'op':>10} {'median ms':>10} {'GB/s':>7} {'x one copy':>11}")
        for num_tokens in args.tokens:
            nbytes = num_tokens * token_bytes
            n = num_tokens // block_size
            shuffled = rng.permutation(num_blocks)
            src_blocks = [int(b) for b in shuffled[:n]]
            dst_blocks = [int(b) for b in shuffled[n : 2 * n]]
            tokens = np.arange(num_tokens, dtype=np.int64) + 10_000_000 * num_tokens
            hashes = hash_request_tokens(CHUNK, tokens)
            res = {}
            host = torch.empty(NUM_LAYERS, n, page_bytes, dtype=torch.uint8,
                               pin_memory=device == "cuda")
            pages = [torch.as_strided(caches[lyr], (num_blocks, page_bytes // 2),
                                      (caches[lyr].stride(0), 1)).view(torch.uint8)
                     for lyr in layers]
            if device == "cuda":
                contiguous = torch.empty_like(host, device=device)
                res["one copy"] = time_it(synced(lambda: host.copy_(
                    contiguous, non_blocking=True), device), args.repeat)

                def per_block():
                    for layer, page in zip(host, pages):
                        for j, block_id in enumerate(src_blocks):
                            layer[j].copy_(page[block_id], non_blocking=True)

                res["per-block"] = time_it(synced(per_block, device), args.repeat)
            else:
                other = torch.empty_like(host)
                other.zero_()
                host.zero_()
                res["one copy"] = time_it(lambda: np.copyto(host.numpy(), other.numpy()),
                                          args.repeat)
            bpc = CHUNK // block_size
            save = SaveSpec("bench", 0, tokens, hashes, src_blocks)
            res["save"] = time_it(lambda: worker.save([save]), args.repeat,
                                  setup=lambda: admin.request(Clear()))
            worker.save([save])
            snapshot = reader.snapshot()
            assert snapshot is not None, "no session with the daemon"
            acquired = snapshot.acquire(b"".join(hashes))  # pins them, as the scheduler does
            assert len(acquired.span_lengths) == len(hashes), "not every chunk was stored"
            load = LoadSpec("bench", 0, 0, tokens, hashes, [acquired.spans()],
                            [snapshot.generation],
                            [list(range(bpc))] * len(hashes),
                            [dst_blocks[i * bpc : (i + 1) * bpc] for i in range(len(hashes))])
            res["load"] = time_it(synced(lambda: worker.load([load]), device), args.repeat)
            assert not worker.take_load_errors(), "a load failed"
            for page in pages:  # the loaded blocks hold the saved ones, bit for bit
                assert torch.equal(page[dst_blocks], page[src_blocks]), "loaded bytes differ"
            snapshot.release()  # RELEASE of the lease: no reply
            reader.request(Ping())  # same connection: the RELEASE is done before the CLEAR
            admin.request(Clear())
            base = median(res["one copy"])
            for op, samples in res.items():
                med = median(samples)
                print(f"{num_tokens:>7} {op:>10} {med * 1e3:10.2f} {nbytes / med / GB:7.2f} "
                      f"{base / med:10.2f}x")
        reader.close()
        worker.shutdown()


if __name__ == "__main__":
    main()
