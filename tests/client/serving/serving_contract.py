"""The serving core's contract, written once for every engine (`ServingContract`).

What an engine's connector promises against the daemon, whatever the engine: a lookup pins
its hit until the load is planned, and the pins go back once every tensor parallel rank
has loaded the step (never before, always after); a daemon restart between the lookup
and the load is a miss, never another arena's bytes, and the KV computed on top of it is
never saved; tensor parallel ranks report the same failures; full chunks are saved once
they are computed, and another process loads them bit-exact.

An engine runs the contract by subclassing `ServingContract` with a harness that drives
its glue (`EngineHarness`: the fake engine here drives the core directly, tests/client/serving/
test_serving_core.py; vLLM's glue: tests/client/vllm/test_vllm_serving_contract.py).
Every harness works on the same engine memory: per layer, a uint8 tensor `[NUM_BLOCKS,
PAGE_BYTES]` of blocks, so that tests compare bytes the same way. No vllm needed.
"""

import dataclasses
import os
import threading
import time

import numpy as np
import pytest
import torch

from conftest import start_daemon
from lmcached.client.layout import KVLayout
from lmcached.client.serving.scheduler import ServingScheduler
from lmcached.client.serving.specs import ConnectorSettings
from lmcached.client.serving.worker import ServingWorker
from lmcached.wire.record_format import RECORD_HEADER_BYTES

BLOCK_SIZE = 4  # tokens per engine block
CHUNK = 2 * BLOCK_SIZE  # tokens per chunk: 2 engine blocks
NUM_LAYERS = 2
PAGE_BYTES = 256  # bytes of one block of one layer
NUM_BLOCKS = 32
DAEMON_ARGS = ("--capacity", "64MiB", "--block-size", "1MiB")


def make_settings(socket: str, world_size: int) -> ConnectorSettings:
    layouts = [KVLayout("serving-contract", num_layers=NUM_LAYERS, num_kv_heads=1,
                        head_size=PAGE_BYTES // (2 * BLOCK_SIZE), dtype="uint8",
                        chunk_size=CHUNK, world_size=world_size, worker_id=rank)
               for rank in range(world_size)]
    return ConnectorSettings(layouts=layouts, chunk_size=CHUNK, block_size=BLOCK_SIZE,
                             world_size=world_size, socket=socket, daemon_name="unused",
                             timeout_s=5.0)


def random_caches(seed: int) -> list[torch.Tensor]:
    """One engine rank's KV memory: per layer, uint8 `[NUM_BLOCKS, PAGE_BYTES]`."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (NUM_BLOCKS, PAGE_BYTES), dtype=torch.uint8,
                          generator=generator) for _ in range(NUM_LAYERS)]


def zero_caches() -> list[torch.Tensor]:
    return [torch.zeros(NUM_BLOCKS, PAGE_BYTES, dtype=torch.uint8) for _ in range(NUM_LAYERS)]


def block_bytes(caches: list[torch.Tensor], block_id: int) -> list[bytes]:
    """A block's bytes in every layer."""
    return [cache[block_id].numpy().tobytes() for cache in caches]


@dataclasses.dataclass
class FakeRequest:
    """An engine's request as the core reads it (`RequestView`)."""

    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    num_computed_tokens: int = 0


class FakeMover:
    """The core's `KVMover` over per-layer block tensors: a record's KV bytes are
    `[num_layers][blocks of the chunk][PAGE_BYTES]`, as vLLM's paged blocks lay them."""

    def __init__(self, caches: list[torch.Tensor]) -> None:
        self.caches = caches
        self.device = caches[0].device
        self.description = f"fake-blocks:{len(caches)}x{tuple(caches[0].shape)}"

    def gather(self, block_ids: list[int], dst: torch.Tensor) -> None:
        record = dst.view(torch.uint8).view(len(self.caches), len(block_ids), PAGE_BYTES)
        for layer, cache in zip(record, self.caches):
            layer.copy_(cache[block_ids])

    def scatter(self, src: torch.Tensor, offsets: list[int], block_ids: list[int]) -> None:
        record = src.view(torch.uint8).view(len(self.caches), -1, PAGE_BYTES)
        for layer, cache in zip(record, self.caches):
            cache[block_ids] = layer[offsets]

    def wait(self) -> None:
        """Copies are done when gather/scatter return."""


class EngineHarness:
    """Drives an engine's connector through the contract; this one is the fake engine,
    calling the core directly. An engine's harness overrides every method with its glue.
    """

    def request(self, req_id: str, tokens, cache_salt: str | None = None):
        return FakeRequest(req_id, [int(t) for t in tokens], cache_salt)

    def scheduler(self, settings: ConnectorSettings):
        return ServingScheduler(settings, "contract-scheduler")

    def lookup(self, scheduler, request, num_computed_tokens: int) -> int:
        return scheduler.lookup(request, num_computed_tokens)

    def allocate(self, scheduler, request, block_ids: list[int],
                 num_external_tokens: int) -> None:
        scheduler.allocate(request, block_ids, num_external_tokens)

    def plan_step(self, scheduler, num_scheduled_tokens: dict[str, int],
                  block_ids: dict[str, list[int]] | None):
        """(step, loads, saves); `block_ids` None: the engine gives no block ids."""
        return scheduler.plan_step(num_scheduled_tokens,
                                   None if block_ids is None else block_ids.__getitem__)

    def report(self, scheduler, loaded_steps: dict[int, int],
               failed_chunks: dict[str, int]) -> None:
        scheduler.on_worker_report(loaded_steps, failed_chunks)

    def finish(self, scheduler, request) -> None:
        scheduler.finish(request.request_id)

    def worker(self, settings: ConnectorSettings, rank: int, caches: list[torch.Tensor]):
        worker = ServingWorker(settings, rank, "contract-worker")
        worker.register_mover(FakeMover(caches))
        return worker


class TensorParallelAgreement:
    """The TP collective the core's `load(agree=...)` takes, for ranks in threads: a MIN
    all-reduce of each load's first failed chunk (-1: none)."""

    def __init__(self, world_size: int) -> None:
        self._barrier = threading.Barrier(world_size, timeout=30)
        self._failed: dict[int, list[int]] = {}

    def for_rank(self, rank: int):
        def agree(failed: list[int]) -> list[int]:
            self._failed[rank] = failed
            self._barrier.wait()
            big = np.iinfo(np.int64).max
            agreed = [min(big if f < 0 else f for f in column)
                      for column in zip(*self._failed.values())]
            self._barrier.wait()  # every rank has read the others' failures
            return [-1 if f == big else f for f in agreed]

        return agree


def load_on_ranks(workers, loads, agreement: TensorParallelAgreement | None) -> None:
    """Every rank loads the step at once (threads), agreeing on failures."""
    errors = []

    def run(rank, worker):
        try:
            worker.load(loads, agreement.for_rank(rank) if agreement else None)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(rank, worker))
               for rank, worker in enumerate(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors


def wait_for_session(side, deadline_s: float = 10.0) -> None:
    """Wait until `side` (a scheduler or worker) has a daemon session again."""
    deadline = time.monotonic() + deadline_s
    while side._link.snapshot() is None:
        assert time.monotonic() < deadline, "no session with the restarted daemon"
        time.sleep(0.05)


def wait_for_pins(daemon, expected: int, deadline_s: float = 10.0) -> int:
    deadline = time.monotonic() + deadline_s
    while (held := daemon.pins_held()) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return held


class ServingContract:
    """The contract tests; a subclass sets `harness` (an `EngineHarness`)."""

    harness: EngineHarness = EngineHarness()

    # ------------------------------------------------------------------ helpers
    def compute_and_save(self, socket: str, tokens, rank_caches: list[list[torch.Tensor]],
                         block_ids: list[int]) -> int:
        """A writer engine computes the whole prompt in one step and its ranks save it.
        Returns the chunks saved per rank."""
        h = self.harness
        settings = make_settings(socket, len(rank_caches))
        scheduler = h.scheduler(settings)
        workers = [h.worker(settings, rank, caches) for rank, caches in enumerate(rank_caches)]
        try:
            request = h.request("writer", tokens)
            assert h.lookup(scheduler, request, 0) == 0
            h.allocate(scheduler, request, block_ids, 0)
            _, loads, saves = h.plan_step(scheduler, {"writer": len(tokens)},
                                          {"writer": block_ids})
            assert loads == []
            for worker in workers:
                worker.save(saves)
            return workers[0].num_saved_chunks
        finally:
            for side in (scheduler, *workers):
                side.shutdown()

    # -------------------------------------------------------------------- tests
    def test_a_pinned_lookup_is_loaded_bit_exact_then_released(self, daemon):
        tp, num_chunks = 2, 3
        tokens = np.arange(1000, 1000 + num_chunks * CHUNK + 1)
        sources = [random_caches(rank) for rank in range(tp)]
        assert self.compute_and_save(daemon.socket, tokens, sources,
                                     list(range(2 * num_chunks + 1))) == num_chunks
        h = self.harness
        settings = make_settings(daemon.socket, tp)
        scheduler = h.scheduler(settings)
        targets = [zero_caches() for _ in range(tp)]
        workers = [h.worker(settings, rank, targets[rank]) for rank in range(tp)]
        try:
            request = h.request("r", tokens)
            for _ in range(2):  # a retried lookup releases the first one's pins
                assert h.lookup(scheduler, request, 0) == num_chunks * CHUNK
                assert daemon.pins_held() == num_chunks * tp  # pinned until loaded
            dst_blocks = list(range(10, 10 + 2 * num_chunks + 1))
            h.allocate(scheduler, request, dst_blocks, num_chunks * CHUNK)
            step, (load,), _ = h.plan_step(scheduler, {"r": 1}, None)
            assert [len(spans) for spans in load.spans] == [num_chunks] * tp
            load_on_ranks(workers, [load], TensorParallelAgreement(tp))
            for rank, worker in enumerate(workers):
                assert worker.take_load_errors() == set()
                assert worker.take_failed_chunks() == {}
                assert worker.num_loaded_tokens == num_chunks * CHUNK
                for i in range(2 * num_chunks):
                    assert (block_bytes(targets[rank], dst_blocks[i])
                            == block_bytes(sources[rank], i))
                assert block_bytes(targets[rank], dst_blocks[-1]) == block_bytes(zero_caches(), 0)
            assert daemon.pins_held() == num_chunks * tp  # no rank has reported yet
            h.report(scheduler, {step: 1}, {})
            assert daemon.pins_held() == num_chunks * tp  # one rank of two
            h.report(scheduler, {step: 1}, {})
            assert wait_for_pins(daemon, 0) == 0
        finally:
            for side in (scheduler, *workers):
                side.shutdown()

    def test_step_pins_are_released_at_step_end_and_never_leak(self, daemon):
        tokens = np.arange(2 * CHUNK + 1)
        self.compute_and_save(daemon.socket, tokens, [random_caches(0)], list(range(5)))
        h = self.harness
        scheduler = h.scheduler(make_settings(daemon.socket, 1))
        try:
            requests = [h.request(f"r{i}", tokens) for i in range(3)]
            for request in requests:
                assert h.lookup(scheduler, request, 0) == 2 * CHUNK
                h.allocate(scheduler, request, list(range(5)), 2 * CHUNK)
            assert daemon.pins_held() == 3 * 2
            # r0 and r1 are in this step; r2 finishes (aborted) before any step
            step, loads, _ = h.plan_step(scheduler, {"r0": 1, "r1": 1}, None)
            assert [load.req_id for load in loads] == ["r0", "r1"]
            h.finish(scheduler, requests[2])
            assert daemon.pins_held() == 2 * 2  # the step's pins stay until the report
            h.report(scheduler, {step: 1}, {})
            assert wait_for_pins(daemon, 0) == 0
            # a step whose metadata never reached the workers gives its pins back too
            request = h.request("r3", tokens)
            assert h.lookup(scheduler, request, 0) == 2 * CHUNK
            h.allocate(scheduler, request, list(range(5)), 2 * CHUNK)
            h.plan_step(scheduler, {"r3": 1}, None)
            scheduler.abandon_step()
            assert wait_for_pins(daemon, 0) == 0
        finally:
            scheduler.shutdown()

    @pytest.mark.parametrize("restart", ["after_lookup", "after_plan"])
    def test_a_daemon_restart_between_lookup_and_load_is_a_miss_never_stale_kv(
            self, daemon, restart):
        # The cache holds the prompt's first 2 chunks; the step loads them and computes
        # chunk 2 on top. The daemon restarts before the load: the load fails (the old
        # arena's block ids mean nothing now), and chunk 2, computed on top of it, is not
        # saved in that epoch; once recomputed, the next epoch saves every chunk.
        tokens = np.arange(500, 500 + 3 * CHUNK + 1)
        self.compute_and_save(daemon.socket, tokens[: 2 * CHUNK + 1], [random_caches(7)],
                              list(range(5)))
        h = self.harness
        settings = make_settings(daemon.socket, 1)
        scheduler = h.scheduler(settings)
        target = zero_caches()
        worker = h.worker(settings, 0, target)
        restarted = None

        def restart_daemon():
            nonlocal restarted
            daemon.stop()
            restarted = start_daemon(daemon.name, daemon.socket,
                                     os.path.join(os.path.dirname(daemon.log_path),
                                                  "restarted.log"), *DAEMON_ARGS)

        try:
            request = h.request("r", tokens)
            assert h.lookup(scheduler, request, 0) == 2 * CHUNK
            if restart == "after_lookup":
                restart_daemon()
            dst_blocks = list(range(20, 27))
            h.allocate(scheduler, request, dst_blocks, 2 * CHUNK)
            request.num_computed_tokens = 2 * CHUNK  # the engine counts the hit computed
            step, (load,), saves = h.plan_step(scheduler, {"r": CHUNK + 1}, {"r": dst_blocks})
            assert saves and saves[0].epoch == 0
            if restart == "after_plan":
                restart_daemon()
            worker.load([load])
            wait_for_session(worker)  # attached to the restarted daemon: saves would land
            # every promised block is recomputed, and none holds the old arena's bytes
            assert worker.take_load_errors() == set(dst_blocks[:4])
            failed = worker.take_failed_chunks()
            assert failed == {"r": 0}
            for block_id in dst_blocks:
                assert block_bytes(target, block_id) == block_bytes(zero_caches(), 0)
            # KV computed on top of the failed load is never saved (its epoch failed) ...
            worker.save(saves)
            assert worker.num_saved_chunks == 0
            h.report(scheduler, {step: 1}, failed)
            assert wait_for_pins(restarted, 0) == 0
            # ... and every chunk is saved in the next epoch, once recomputed
            request.num_computed_tokens = len(tokens)
            _, loads, saves = h.plan_step(scheduler, {"r": 1}, {"r": dst_blocks})
            assert loads == [] and [save.epoch for save in saves] == [1]
            worker.save(saves)
            assert worker.num_saved_chunks == 3
        finally:
            for side in (scheduler, worker):
                side.shutdown()
            if restarted is not None:
                restarted.stop()

    def test_tensor_parallel_ranks_agree_on_a_failure_of_one_rank(self, daemon):
        tp = 2
        tokens = np.arange(300, 300 + 3 * CHUNK + 1)
        sources = [random_caches(10 + rank) for rank in range(tp)]
        self.compute_and_save(daemon.socket, tokens, sources, list(range(7)))
        h = self.harness
        settings = make_settings(daemon.socket, tp)
        scheduler = h.scheduler(settings)
        workers = [h.worker(settings, rank, zero_caches()) for rank in range(tp)]
        try:
            request = h.request("r", tokens)
            assert h.lookup(scheduler, request, 0) == 3 * CHUNK
            dst_blocks = list(range(10, 17))
            h.allocate(scheduler, request, dst_blocks, 3 * CHUNK)
            step, (load,), _ = h.plan_step(scheduler, {"r": 1}, None)
            # rank 1's record of chunk 1 now holds other token ids (e.g. torn or replaced)
            records = workers[1].chain.records(workers[1]._link.snapshot())
            offset = records.arena.block_offset(load.spans[1][1][0]) + RECORD_HEADER_BYTES
            records._u8[offset : offset + 8] = 0xFF
            load_on_ranks(workers, [load], TensorParallelAgreement(tp))
            for worker in workers:  # both ranks report chunk 1 on: the same load errors
                assert worker.take_failed_chunks() == {"r": 1}
                assert worker.take_load_errors() == set(dst_blocks[2:6])
                assert worker.num_load_errors == 2
            h.report(scheduler, {step: tp}, {"r": 1})
            assert wait_for_pins(daemon, 0) == 0
        finally:
            for side in (scheduler, *workers):
                side.shutdown()

    def test_full_chunks_are_saved_after_they_are_computed_and_load_elsewhere(self, daemon):
        tokens = np.arange(700, 700 + 3 * CHUNK + 2)
        source = random_caches(3)
        h = self.harness
        settings = make_settings(daemon.socket, 1)
        scheduler = h.scheduler(settings)
        writer = h.worker(settings, 0, source)
        block_ids = list(range(8))
        try:
            request = h.request("w", tokens)
            assert h.lookup(scheduler, request, 0) == 0
            h.allocate(scheduler, request, block_ids, 0)
            # chunked prefill: 1.5 chunks this step (chunk 0 is saved), the rest next step
            _, _, saves = h.plan_step(scheduler, {"w": CHUNK + CHUNK // 2}, {"w": block_ids})
            assert [len(save.hashes) for save in saves] == [1]
            assert saves[0].block_ids == [0, 1]
            writer.save(saves)
            assert writer.num_saved_chunks == 1
            # a step whose block ids the engine does not give saves nothing
            request.num_computed_tokens = CHUNK + CHUNK // 2
            _, _, saves = h.plan_step(scheduler, {"w": 1}, None)
            assert saves == []
            _, _, saves = h.plan_step(scheduler, {"w": len(tokens) - request.num_computed_tokens},
                                      {"w": block_ids})
            assert [save.block_ids for save in saves] == [[2, 3, 4, 5]]
            writer.save(saves)
            assert writer.num_saved_chunks == 3 and daemon.info()["stores"] == 3
            request.num_computed_tokens = len(tokens)
            _, _, saves = h.plan_step(scheduler, {"w": 1}, {"w": block_ids})
            assert saves == []  # nothing is saved twice
        finally:
            for side in (scheduler, writer):
                side.shutdown()
        # another engine process loads them, bit-exact
        reader_scheduler = h.scheduler(settings)
        target = zero_caches()
        reader = h.worker(settings, 0, target)
        try:
            request = h.request("r", tokens)
            assert h.lookup(reader_scheduler, request, 0) == 3 * CHUNK
            dst_blocks = list(range(24, 32))
            h.allocate(reader_scheduler, request, dst_blocks, 3 * CHUNK)
            step, (load,), _ = h.plan_step(reader_scheduler, {"r": 2}, None)
            reader.load([load])
            assert reader.take_load_errors() == set()
            for i in range(6):
                assert block_bytes(target, dst_blocks[i]) == block_bytes(source, i)
            h.report(reader_scheduler, {step: 1}, {})
            assert wait_for_pins(daemon, 0) == 0
        finally:
            for side in (reader_scheduler, reader):
                side.shutdown()

    def test_without_a_daemon_a_lookup_is_a_miss_and_a_load_fails(self, short_tmp):
        h = self.harness
        settings = make_settings(f"{short_tmp}/nobody.sock", 1)
        scheduler = h.scheduler(settings)
        worker = h.worker(settings, 0, random_caches(1))
        try:
            request = h.request("r", np.arange(3 * CHUNK + 1))
            assert h.lookup(scheduler, request, 0) == 0
            h.allocate(scheduler, request, list(range(7)), 0)
            _, loads, saves = h.plan_step(scheduler, {"r": 3 * CHUNK + 1}, {"r": list(range(7))})
            assert loads == [] and len(saves) == 1
            worker.save(saves)
            assert worker.num_saved_chunks == 0
            h.finish(scheduler, request)
        finally:
            for side in (scheduler, worker):
                side.shutdown()
