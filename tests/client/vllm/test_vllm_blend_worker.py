"""CacheBlend's worker side (client/vllm/blend_worker.py) against a real daemon, without
vLLM: documents stored by a first request, blended into paged slots by a later one,
pins released on every path, and a failed blend reported as load errors (vLLM then
recomputes those blocks exactly). The model is the vLLM-shaped stand-in of
test_vllm_blend_layers.py, its attention given a paged cache written through
`impl.do_kv_cache_update` as vLLM's backends are.
"""

import dataclasses
import threading
import types

import numpy as np
import pytest
import torch

from lmcached.client import KVLayout
from lmcached.client.layout import RECORD_HEADER_BYTES
from lmcached.client.vllm.blend_params import BlendParams, BlendSpec
from lmcached.client.vllm.blend_worker import BlendWorker, TensorParallelGroup
from lmcached.client.vllm.specs import ConnectorSettings

from test_vllm_blend_layers import HEAD, HEADS, HIDDEN, KV_HEADS, LAYERS, FakeVllmLlama, reference_kv

SEP, BLOCK, NUM_BLOCKS = 49, 4, 32
LAYOUT = KVLayout("blend-worker-test", num_layers=LAYERS, num_kv_heads=KV_HEADS, head_size=HEAD,
                  dtype="float32", chunk_size=8, fmt="vllm")
HF_CONFIG = types.SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                  head_dim=HEAD, hidden_size=HIDDEN, num_attention_heads=HEADS)


class PagedAttention(torch.nn.Module):
    """vLLM's Attention as the worker uses it: `kv_cache` and `impl.do_kv_cache_update`."""

    def __init__(self):
        super().__init__()
        # [num_slots, 2, kv_heads, head]: slot = block_id * BLOCK + pos % BLOCK
        self.kv_cache = torch.full((NUM_BLOCKS * BLOCK, 2, KV_HEADS, HEAD), float("nan"))
        self.impl = types.SimpleNamespace(do_kv_cache_update=self._update)

    @staticmethod
    def _update(layer, key, value, kv_cache, slot_mapping):
        kv_cache[slot_mapping, 0] = key
        kv_cache[slot_mapping, 1] = value


def paged_model() -> FakeVllmLlama:
    model = FakeVllmLlama()
    for layer in model.model.layers:
        layer.self_attn.attn = PagedAttention()
    return model


def make_worker(socket: str, layout: KVLayout = LAYOUT, tp_group=None,
                store_tokens_per_step: int = 2048) -> BlendWorker:
    settings = ConnectorSettings(layouts=[layout], chunk_size=8, block_size=BLOCK,
                                 world_size=layout.world_size, socket=socket,
                                 daemon_name="unused", timeout_s=5.0)
    return BlendWorker(settings, layout, HF_CONFIG, tp_group, store_tokens_per_step)


def spec_of(tokens, num_local=0, store_only=False, ratio=1.0, salt="s") -> BlendSpec:
    block_ids = list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - -(-len(tokens) // BLOCK), -1))
    return BlendSpec("r", BlendParams(SEP, recompute_ratio=ratio),
                     np.asarray(tokens, dtype=np.int64), num_local, block_ids, store_only,
                     cache_salt=salt)


def slots(spec: BlendSpec, positions) -> torch.Tensor:
    return torch.tensor([spec.block_ids[p // BLOCK] * BLOCK + p % BLOCK for p in positions])


def test_documents_stored_first_are_blended_into_the_paged_slots(daemon):
    rng = np.random.default_rng(0)
    system, doc = (rng.integers(0, SEP, n).tolist() + [SEP] for n in (5, 10))
    model, worker = paged_model(), make_worker(daemon.socket)
    worker.run([spec_of(system + doc, store_only=True)], model)
    assert worker.num_stored_segments == 2 and worker.take_load_errors() == set()
    assert all(torch.isnan(layer.self_attn.attn.kv_cache).all() for layer in model.model.layers)

    tokens = doc + system  # another order; ratio 1.0: every row recomputed in context
    spec = spec_of(tokens, num_local=4)
    worker.run([spec], model)
    assert worker.num_blended_requests == 1 and worker.num_reused_tokens == len(tokens)
    expected = reference_kv(model, torch.tensor(tokens))
    for layer, (k, v) in zip(model.model.layers, expected):
        cache = layer.self_attn.attn.kv_cache
        written = slots(spec, range(4, len(tokens)))
        torch.testing.assert_close(cache[written, 0], k[4:], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(cache[written, 1], v[4:], rtol=1e-4, atol=1e-5)
        assert torch.isnan(cache[slots(spec, range(4))]).all()  # vLLM's own hit: untouched
    assert daemon.pins_held() == 0
    worker.shutdown()


def test_a_first_meeting_is_stored_over_steps_within_the_step_budget(daemon):
    # Storing computes each document alone before the step's forward, outside vLLM's
    # token budget: a long first meeting must not stall one step's decodes with all of it.
    rng = np.random.default_rng(4)
    system, doc1, doc2 = (rng.integers(0, SEP, n).tolist() + [SEP] for n in (5, 10, 12))
    model = paged_model()
    worker = make_worker(daemon.socket, store_tokens_per_step=len(system + doc1))
    worker.run([spec_of(system + doc1 + doc2, store_only=True)], model)
    assert (worker.num_stored_segments, worker.num_pending_stores) == (2, 1)
    assert worker.engine.lookup(torch.tensor(doc2), cache_salt="s") == 0
    worker.run([], model)  # the next step (a step with no blend stores what is queued)
    assert (worker.num_stored_segments, worker.num_pending_stores) == (3, 0)
    assert worker.engine.lookup(torch.tensor(doc2), cache_salt="s") == len(doc2)
    big = make_worker(daemon.socket, store_tokens_per_step=1)  # one segment per step at least
    big.run([spec_of(doc2 + doc1, store_only=True, salt="t")], model)
    assert (big.num_stored_segments, big.num_pending_stores) == (1, 1)
    assert daemon.pins_held() == 0
    big.shutdown()
    worker.shutdown()


def test_documents_stored_under_one_salt_are_never_blended_under_another(daemon):
    rng = np.random.default_rng(6)
    system, doc = (rng.integers(0, SEP, n).tolist() + [SEP] for n in (5, 10))
    model, worker = paged_model(), make_worker(daemon.socket)
    worker.run([spec_of(system + doc, store_only=True, salt="tenant-a")], model)
    assert worker.num_stored_segments == 2
    assert worker.engine.lookup(doc, cache_salt="tenant-a") == len(doc)
    assert worker.engine.lookup(doc, cache_salt="tenant-b") == 0
    assert worker.engine.lookup(doc) == 0  # nor unsalted

    tokens = doc + system
    worker.run([spec_of(tokens, ratio=0.0, salt="tenant-b")], model)  # another tenant
    assert worker.num_blended_requests == 1 and worker.num_reused_tokens == 0
    assert worker.num_stored_segments == 4  # its own copies, under its own salt
    assert worker.engine.lookup(doc, cache_salt="tenant-b") == len(doc)
    worker.run([spec_of(tokens, ratio=0.0, salt="tenant-a")], model)
    assert worker.num_blended_requests == 2 and worker.num_reused_tokens == len(tokens)
    assert daemon.pins_held() == 0
    worker.shutdown()


def test_a_segment_that_fails_its_check_is_a_miss_recomputed_in_context(daemon):
    rng = np.random.default_rng(3)
    system, doc = (rng.integers(0, SEP, n).tolist() + [SEP] for n in (5, 16))
    model, worker = paged_model(), make_worker(daemon.socket)
    worker.run([spec_of(system + doc, store_only=True)], model)
    assert worker.num_stored_segments == 2
    with worker.engine.retrieve_views(doc, cache_salt="s") as views:
        first_block = views.block_ids[0]
    # A stray writer changes one token id in the record of the document's first chunk.
    token_ids = worker.engine.link.arena.view(first_block, torch.int64, (LAYOUT.chunk_size,),
                                              offset_bytes=RECORD_HEADER_BYTES)
    token_ids[2] += 1

    tokens = system + doc  # ratio 0: only rows without reused K/V go through every layer
    spec = spec_of(tokens, ratio=0.0)
    worker.run([spec], model)
    assert worker.engine.num_verify_failures == 1 and worker.take_load_errors() == set()
    assert worker.num_blended_requests == 1 and worker.num_reused_tokens == len(system)
    # The system prompt is reused at its own positions and the document, a miss, is
    # computed in context: the blend is exactly a full prefill.
    for layer, (k, v) in zip(model.model.layers, reference_kv(model, torch.tensor(tokens))):
        cache = layer.self_attn.attn.kv_cache
        written = slots(spec, range(len(tokens)))
        torch.testing.assert_close(cache[written, 0], k, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(cache[written, 1], v, rtol=1e-4, atol=1e-5)
    assert daemon.pins_held() == 0
    worker.shutdown()


class ThreadRanks:
    """TP collectives between threads (one per rank), as vLLM's TP group between processes."""

    def __init__(self, world_size: int):
        self._barrier = threading.Barrier(world_size, timeout=20)
        self._slots = [None] * world_size
        self.calls = [[] for _ in range(world_size)]  # per rank: the collectives it entered

    def group(self, rank: int) -> TensorParallelGroup:
        def collective(name, x, reduce):
            self.calls[rank].append(name)
            self._slots[rank] = x.clone()
            self._barrier.wait()
            out = reduce(torch.stack(self._slots))
            self._barrier.wait()
            return out

        return TensorParallelGroup(
            sum_scores=lambda x: collective("sum", x, lambda s: s.sum(0)),
            min_flags=lambda x: collective("min", x, lambda s: s.min(0).values))


def run_ranks(work, world_size=2):
    """work(rank) on one thread per rank; re-raises the first error."""
    errors = []

    def target(rank):
        try:
            work(rank)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors


def two_ranks_that_stored(daemon, tokens: list[int]):
    """(ranks, models, workers) of two TP ranks in threads, each in its own namespace, after
    both stored the segments of `tokens` (store-only, salt "s")."""
    ranks = ThreadRanks(2)
    models = [paged_model() for _ in range(2)]
    workers = [make_worker(daemon.socket, dataclasses.replace(LAYOUT, world_size=2, worker_id=r),
                           ranks.group(r)) for r in range(2)]
    run_ranks(lambda r: workers[r].run([spec_of(tokens, store_only=True)], models[r]))
    return ranks, models, workers


def test_tensor_parallel_ranks_reuse_only_what_every_rank_found(daemon):
    rng = np.random.default_rng(4)
    system, doc = (rng.integers(0, SEP, n).tolist() + [SEP] for n in (5, 16))
    ranks, models, workers = two_ranks_that_stored(daemon, system + doc)
    assert [w.num_stored_segments for w in workers] == [2, 2]  # each rank its namespace
    with workers[1].engine.retrieve_views(doc, cache_salt="s") as views:  # rank 1 loses it
        first_block = views.block_ids[0]
    workers[1].engine.link.arena.view(first_block, torch.int64, (LAYOUT.chunk_size,),
                                      offset_bytes=RECORD_HEADER_BYTES)[2] += 1

    tokens = system + doc
    spec = spec_of(tokens, ratio=0.0)
    run_ranks(lambda r: workers[r].run([spec], models[r]))
    # Both ranks reuse only the system prompt (rank 0 still has the document, rank 1
    # not): the same rows on every rank, and the blend is exactly a full prefill.
    assert [w.num_reused_tokens for w in workers] == [len(system)] * 2
    assert [w.num_failed_blends for w in workers] == [0, 0]
    for model in models:
        for layer, (k, v) in zip(model.model.layers, reference_kv(model, torch.tensor(tokens))):
            cache = layer.self_attn.attn.kv_cache
            torch.testing.assert_close(cache[slots(spec, range(len(tokens))), 0], k,
                                       rtol=1e-4, atol=1e-5)
    assert daemon.pins_held() == 0
    for worker in workers:
        worker.shutdown()


def test_a_tensor_parallel_rank_that_cannot_read_a_layer_fails_the_blend_on_every_rank(
        daemon, monkeypatch):
    rng = np.random.default_rng(5)
    system, doc = (rng.integers(0, SEP, n).tolist() + [SEP] for n in (5, 16))
    ranks, models, workers = two_ranks_that_stored(daemon, system + doc)

    from lmcached.client.blend.retriever import SPTBlendRetrieverTask
    from lmcached.client.views import PinsLost

    real_result = SPTBlendRetrieverTask.result

    def result(task, layer_id):  # rank 1's session ends before it reads layer 1
        if layer_id == 1 and task._engine is workers[1].engine:
            raise PinsLost("the daemon session ended")
        return real_result(task, layer_id)

    monkeypatch.setattr(SPTBlendRetrieverTask, "result", result)
    spec = spec_of(doc + system, num_local=4, ratio=0.15)
    run_ranks(lambda r: workers[r].run([spec], models[r]))
    assert ranks.calls[0] == ranks.calls[1]  # no rank waits in a collective the other skips
    first, last = 4 // BLOCK, -(-len(spec.tokens) // BLOCK)
    for worker in workers:
        assert worker.num_failed_blends == 1 and worker.num_blended_requests == 0
        assert worker.take_load_errors() == set(spec.block_ids[first:last])
    assert daemon.pins_held() == 0
    for worker in workers:
        worker.shutdown()


def test_a_failed_blend_is_reported_as_load_errors_and_releases_its_pins(daemon, monkeypatch):
    rng = np.random.default_rng(1)
    system, doc = (rng.integers(0, SEP, n).tolist() + [SEP] for n in (5, 10))
    model, worker = paged_model(), make_worker(daemon.socket)
    worker.run([spec_of(system + doc, store_only=True)], model)

    def broken(*args, **kwargs):
        raise RuntimeError("layer 1 exploded")

    monkeypatch.setattr(model.model.layers[1].post_attention_layernorm, "forward", broken)
    spec = spec_of(doc + system, num_local=4)
    worker.run([spec], model)  # never raises
    first, last = 4 // BLOCK, -(-len(spec.tokens) // BLOCK)
    assert worker.take_load_errors() == set(spec.block_ids[first:last])
    assert worker.take_load_errors() == set()
    assert worker.num_failed_blends == 1 and worker.num_blended_requests == 0
    assert daemon.pins_held() == 0  # the segments it had pinned were released

    worker.run([spec_of(doc + system)], None)  # no blend-aware model in this process
    assert worker.num_failed_blends == 2 and worker.take_load_errors()
    worker.shutdown()


def test_a_document_that_cannot_be_stored_leaves_the_blend_standing(daemon, monkeypatch):
    rng = np.random.default_rng(2)
    system, doc = (rng.integers(0, SEP, n).tolist() + [SEP] for n in (5, 10))
    model, worker = paged_model(), make_worker(daemon.socket)
    worker.run([spec_of(system, store_only=True)], model)

    def store(*args, **kwargs):
        raise OSError("arena gone")

    monkeypatch.setattr(worker.engine, "store", store)
    worker.run([spec_of(system + doc)], model)  # doc is new: blended in place, then stored
    assert (worker.num_blended_requests, worker.num_failed_blends) == (1, 0)
    assert worker.take_load_errors() == set()
    worker.shutdown()


def test_rope_that_a_delta_rotation_cannot_move_is_refused():
    from lmcached.client.vllm.blend_worker import rotary_of

    assert rotary_of(HF_CONFIG).head_dim == HEAD
    yarn = types.SimpleNamespace(**{**vars(HF_CONFIG), "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}})
    with pytest.raises(ValueError, match="yarn"):
        rotary_of(yarn)


def test_queued_documents_are_stored_once_and_not_again_once_stored_meanwhile(daemon,
                                                                             monkeypatch):
    # A burst of requests meeting the same new documents queues each once; a document
    # another process stored before its turn is skipped, not computed again; the queue
    # is bounded (what does not fit is counted, not stored).
    rng = np.random.default_rng(9)
    system, doc1, doc2, doc3 = (rng.integers(0, SEP, n).tolist() + [SEP] for n in (5, 10, 12, 9))
    model = paged_model()
    worker = make_worker(daemon.socket, store_tokens_per_step=1)  # one segment per step
    computed = []
    store = BlendWorker._store_segment
    monkeypatch.setattr(BlendWorker, "_store_segment",
                        lambda self, m, tokens, salt: computed.append(tokens.tolist())
                        or store(self, m, tokens, salt))
    worker.run([spec_of(system + doc1 + doc2, store_only=True),
                spec_of(system + doc1 + doc2 + doc3, store_only=True)], model)
    assert worker.num_pending_stores == 3  # system, doc1, doc2, doc3 queued once; system stored
    other = make_worker(daemon.socket)  # another process stores doc1 and doc3 meanwhile
    other.run([spec_of(doc1 + doc3, store_only=True)], model)
    for _ in range(3):
        worker.run([], model)
    assert worker.num_pending_stores == 0
    # the other process stored doc1 and doc3 (store-only: every segment) before their turn
    assert computed.count(doc1) == 1 and computed.count(doc3) == 1, "computed again"
    assert worker.num_skipped_stores == 2
    assert worker.num_stored_segments == 2  # system, doc2
    assert worker.engine.lookup(torch.tensor(doc2), cache_salt="s") == len(doc2)

    monkeypatch.setattr("lmcached.client.vllm.blend_worker.MAX_PENDING_STORES", 1)
    worker.run([spec_of(system + doc1[:4] + [SEP] + doc2[:5] + [SEP] + doc3, store_only=True,
                        salt="t")], model)
    assert worker.num_dropped_stores >= 1
    for _ in range(3):
        worker.run([], model)
    assert worker.num_pending_stores == 0 and daemon.pins_held() == 0
    other.shutdown()
    worker.shutdown()
