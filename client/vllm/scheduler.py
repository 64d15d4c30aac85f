"""The scheduler side of the vLLM connector: lookups, pins, and each step's loads and saves.

Why this file exists: vLLM's scheduler (EngineCore) asks the connector how much of a
prompt lmcached holds, tells it which blocks it allocated, and ships per-step metadata
to the workers. This class answers those hooks against the daemon, one session per TP
rank's namespace. It is vllm-free: vLLM objects (Request, KVCacheBlocks, SchedulerOutput)
are used through the attributes vLLM 0.32.0 gives them. Split from the connector after
vLLM's NixlConnectorScheduler / LMCache's scheduler adapter.
"""

import dataclasses
from typing import Any

import numpy as np

from lmcached.client.daemon_link import CacheUnavailable, DaemonLink
from lmcached.client.hashing import ChunkHash, hash_request_tokens
from lmcached.client.vllm.specs import ConnectorSettings, LoadSpec, SaveSpec
from lmcached.logger import init_logger
from lmcached.protocol import Acquire, DaemonError, Lookup, Release

logger = init_logger(__name__)


@dataclasses.dataclass
class _Pins:
    rank: int
    generation: int
    block_ids: list[int]


@dataclasses.dataclass
class _RequestState:
    """What the scheduler side keeps per request (dropped in request_finished)."""

    request: Any  # vllm.v1.request.Request
    tokens: np.ndarray  # int64 [num_full_chunks * chunk_size]: the prompt's full chunks
    hashes: list[ChunkHash]  # one per full chunk
    num_local_tokens: int = 0  # vLLM's own hit, as passed to get_num_new_matched_tokens
    num_saved_chunks: int = 0  # chunks [0, n) are loaded, or were sent to be saved
    epoch: int = 0
    load: LoadSpec | None = None  # allocated this step, not yet in the metadata
    pins: list[_Pins] = dataclasses.field(default_factory=list)  # pins of `load`


class LMCachedConnectorScheduler:
    """Scheduler-side state of LMCachedConnector: one daemon session per TP rank.

    Args:
        settings: the connector's settings (layouts of every rank, sizes, daemon).

    Attributes:
        num_matched_tokens: tokens vLLM accepted from lmcached (update_state_after_alloc).
    """

    def __init__(self, settings: ConnectorSettings) -> None:
        self.settings = settings
        self.num_matched_tokens = 0
        self._links: list[DaemonLink] = [
            settings.open_link(rank, f"vllm-scheduler(rank {rank})")
            for rank in range(len(settings.layouts))
        ]
        self._requests: dict[str, _RequestState] = {}
        self._step = 0
        self._step_pins: dict[int, list[_Pins]] = {}
        self._step_reports: dict[int, int] = {}

    # ------------------------------------------------------------------ lookup
    def _request_state(self, request) -> _RequestState | None:
        state = self._requests.get(request.request_id)
        if state is not None:
            return state
        if (request.prompt_token_ids is None or request.lora_request is not None
                or request.mm_features or request.cache_salt is not None
                or getattr(request, "prompt_embeds", None) is not None):
            return None
        chunk_size = self.settings.chunk_size
        num_chunks = len(request.prompt_token_ids) // chunk_size
        tokens = np.asarray(request.prompt_token_ids[: num_chunks * chunk_size], dtype=np.int64)
        state = _RequestState(request, tokens, hash_request_tokens(chunk_size, tokens))
        self._requests[request.request_id] = state
        return state

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        """Tokens beyond vLLM's own hit that lmcached holds (LOOKUP: no pins, no LRU change).

        Args:
            request: the vLLM Request.
            num_computed_tokens: vLLM's local prefix-cache hit (block aligned).

        Returns:
            A multiple of the block size (the hit ends on a chunk boundary), leaving at
            least one prompt token to compute; 0 when the daemon is unavailable.
        """
        state = self._request_state(request)
        if state is None:
            return 0
        chunk_size = self.settings.chunk_size
        state.num_local_tokens = num_computed_tokens
        first_chunk = num_computed_tokens // chunk_size
        max_chunks = min((len(request.prompt_token_ids) - 1) // chunk_size, len(state.hashes))
        if max_chunks * chunk_size <= num_computed_tokens:
            return 0
        num_chunks = self._lookup(state.hashes[first_chunk:max_chunks])
        return max((first_chunk + num_chunks) * chunk_size - num_computed_tokens, 0)

    def _lookup(self, hashes: list[ChunkHash]) -> int:
        """Leading chunks of `hashes` READY in every rank's namespace (0 if unreachable)."""
        payload = b"".join(hashes)
        num_chunks = len(hashes)
        for link in self._links:
            try:
                ns = link.ensure_connected().ns
                num_chunks = min(num_chunks, link.request(Lookup(ns, payload)).num_chunks)
            except CacheUnavailable:
                return 0
            except DaemonError as exc:
                logger.warning("LOOKUP refused: %s", exc)
                return 0
            if num_chunks == 0:
                break
        return num_chunks

    # -------------------------------------------------------------------- pins
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Pin the chunks vLLM now expects us to load (ACQUIRE per rank) and plan the load.

        A chunk that cannot be pinned any more (evicted since LOOKUP, daemon gone) is
        still planned: the workers report its blocks as a load error and vLLM
        recomputes them.
        """
        state = self._request_state(request)
        if state is None:
            return
        self._drop_load(state)  # an earlier allocation whose step never came
        if num_external_tokens == 0:
            return
        chunk_size, block_size = self.settings.chunk_size, self.settings.block_size
        # [start, end) is what we matched: block aligned, ending on a chunk boundary
        # unless vLLM trimmed it; each chunk overlapping it loads its blocks inside it.
        start = state.num_local_tokens
        end = start + num_external_tokens
        first_chunk = start // chunk_size
        end_chunk = min(-(-end // chunk_size), len(state.hashes))
        hashes = state.hashes[first_chunk:end_chunk]
        spans, generations, num_pinned = self._acquire(state, hashes)
        (vllm_block_ids,) = blocks.get_block_ids()[:1]
        bpc = self.settings.blocks_per_chunk
        block_offsets, block_ids = [], []
        for chunk in range(first_chunk, end_chunk):
            first_block = max(chunk * bpc, start // block_size)
            end_block = min((chunk + 1) * bpc, end // block_size)
            block_offsets.append(list(range(first_block - chunk * bpc, end_block - chunk * bpc)))
            block_ids.append(list(vllm_block_ids[first_block:end_block]))
        state.load = LoadSpec(
            request.request_id, state.epoch, first_chunk,
            state.tokens[first_chunk * chunk_size : end_chunk * chunk_size],
            list(hashes), spans, generations, block_offsets, block_ids,
        )
        state.num_saved_chunks = max(state.num_saved_chunks, first_chunk + num_pinned)
        self.num_matched_tokens += num_external_tokens

    def _acquire(self, state: _RequestState, hashes: list[ChunkHash]):
        """ACQUIRE `hashes` on every rank's session; pins go to `state.pins`.

        Returns:
            (spans per rank, generation per rank, chunks pinned on every rank).
        """
        payload = b"".join(hashes)
        spans, generations = [], []
        for rank, link in enumerate(self._links):
            rank_spans, generation = [], -1
            try:
                with link.lock:
                    hello = link.ensure_connected()
                    reply = link.request(Acquire(hello.ns, payload))
                    generation = hello.generation
            except CacheUnavailable:
                reply = None
            except DaemonError as exc:
                logger.warning("ACQUIRE refused: %s", exc)
                reply = None
            if reply is not None:
                if reply.block_ids:
                    state.pins.append(_Pins(rank, generation, list(reply.block_ids)))
                cursor = 0
                for num_blocks in reply.num_blocks:
                    rank_spans.append(reply.block_ids[cursor : cursor + num_blocks])
                    cursor += num_blocks
            spans.append(rank_spans)
            generations.append(generation)
        return spans, generations, min(len(s) for s in spans)

    def _release(self, pins: list[_Pins]) -> None:
        for pin in pins:
            try:
                self._links[pin.rank].request(Release(pin.block_ids), pin.generation)
            except CacheUnavailable:
                pass  # the daemon is gone or restarted: its pins went with it
            except DaemonError as exc:
                logger.warning("RELEASE refused: %s", exc)

    def _drop_load(self, state: _RequestState) -> None:
        """Forget a planned load that was never sent to the workers; unpin it."""
        if state.load is not None:
            state.num_saved_chunks = min(state.num_saved_chunks, state.load.first_chunk)
            state.load = None
        self._release(state.pins)
        state.pins = []

    # -------------------------------------------------------------------- meta
    def build_step(self, scheduler_output) -> tuple[int, list[LoadSpec], list[SaveSpec]]:
        """This step's number, loads (allocated this step) and saves (full prompt chunks
        computed by the end of this step and not stored yet), for every worker."""
        self._step += 1
        loads, saves = [], []
        block_state = scheduler_output.kv_connector_block_state
        chunk, bpc = self.settings.chunk_size, self.settings.blocks_per_chunk
        for req_id, num_new_tokens in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None:
                continue
            if state.load is not None:
                loads.append(state.load)
                self._step_pins.setdefault(self._step, []).extend(state.pins)
                state.load, state.pins = None, []
            if state.num_saved_chunks >= len(state.hashes) or block_state is None:
                continue
            ready = min((state.request.num_computed_tokens + num_new_tokens) // chunk,
                        len(state.hashes))
            first = state.num_saved_chunks
            if ready <= first:
                continue
            (block_ids,) = block_state.get_block_ids(req_id)[:1]
            saves.append(SaveSpec(
                req_id, state.epoch, state.tokens[first * chunk : ready * chunk],
                list(state.hashes[first:ready]), list(block_ids[first * bpc : ready * bpc]),
            ))
            state.num_saved_chunks = ready
        return self._step, loads, saves

    def on_worker_report(self, loaded_steps: dict[int, int],
                         failed_chunks: dict[str, int]) -> None:
        """Release the pins of steps every rank has loaded; replan saves after failures.

        Args:
            loaded_steps: step -> number of ranks that finished (or failed) its loads.
            failed_chunks: req_id -> index of the first chunk whose load failed.
        """
        for req_id, failed_chunk in failed_chunks.items():
            state = self._requests.get(req_id)
            if state is not None:
                state.epoch += 1
                state.num_saved_chunks = min(state.num_saved_chunks, failed_chunk)
        for step, count in loaded_steps.items():
            count += self._step_reports.pop(step, 0)
            if count >= self.settings.world_size:
                self._release(self._step_pins.pop(step, []))
            else:
                self._step_reports[step] = count

    def request_finished(self, request) -> None:
        """Forget the request; unpin a load that never reached a step."""
        state = self._requests.pop(request.request_id, None)
        if state is not None:
            self._drop_load(state)

    def shutdown(self) -> None:
        """Close the sessions (the daemon releases every pin they hold)."""
        for link in self._links:
            link.close()
        self._requests.clear()
        self._step_pins.clear()
