"""The scheduler side of the vLLM connector: lookups, pins, and each step's loads and saves.

Why this file exists: vLLM's scheduler (EngineCore) asks the connector how much of a
prompt lmcached holds, tells it which blocks it allocated, and ships per-step metadata
to the workers. This class answers those hooks against the daemon in one session that
holds every tensor parallel rank's namespace. A request costs one synchronous round trip
whatever the TP size (protocol v2): `get_num_new_matched_tokens` ACQUIREs the hit in
every rank's namespace at once (a pinned lookup, after LMCache's lookup(pin=True)), and
`update_state_after_alloc` plans the load on those pins instead of asking again; the
pins are RELEASEd without waiting once every rank has loaded. Pinning at lookup also
means a chunk vLLM was promised cannot be evicted before it is loaded. It is vllm-free: vLLM objects (Request, KVCacheBlocks, SchedulerOutput)
are used through the attributes vLLM 0.32 and 0.33 give them. Split from the connector after
vLLM's NixlConnectorScheduler / LMCache's scheduler adapter.
"""

import dataclasses
from typing import Any

import numpy as np

from lmcached.client.chain import Pins, acquire_chain
from lmcached.client.hashing import ChunkHash, hash_request_tokens, root_hash
from lmcached.client.serving.specs import ConnectorSettings, LoadSpec, SaveSpec
from lmcached.wire.logger import init_logger

logger = init_logger(__name__)


@dataclasses.dataclass
class _PinnedLookup:
    """What get_num_new_matched_tokens pinned, waiting for update_state_after_alloc."""

    first_chunk: int
    spans: list[list[list[int]]]  # per rank, the block ids of each pinned chunk
    generations: list[int]  # per rank (-1: unreachable)
    pins: list[Pins]


@dataclasses.dataclass
class _RequestState:
    """What the scheduler side keeps per request (dropped in request_finished)."""

    request: Any  # vllm.v1.request.Request
    tokens: np.ndarray  # int64 [num_full_chunks * chunk_size]: the prompt's full chunks
    hashes: list[ChunkHash]  # one per full chunk, from root_hash(request.cache_salt)
    num_local_tokens: int = 0  # vLLM's own hit, as passed to get_num_new_matched_tokens
    num_saved_chunks: int = 0  # chunks [0, n) are loaded, or were sent to be saved
    epoch: int = 0
    load: LoadSpec | None = None  # allocated this step, not yet in the metadata
    pins: list[Pins] = dataclasses.field(default_factory=list)  # pins of `load`
    lookup: _PinnedLookup | None = None  # pinned by the last lookup, not yet allocated


class LMCachedConnectorScheduler:
    """Scheduler-side state of LMCachedConnector: one daemon session for every TP rank.

    Args:
        settings: the connector's settings (layouts of every rank, sizes, daemon).

    Attributes:
        num_matched_tokens: tokens vLLM accepted from lmcached (update_state_after_alloc).
        num_stale_pins: pinned lookups or loads whose daemon session ended before the
            workers read them (their chunks were ACQUIREd again).
    """

    def __init__(self, settings: ConnectorSettings) -> None:
        self.settings = settings
        self.num_matched_tokens = 0
        self.num_stale_pins = 0
        self._world_size = len(settings.layouts)
        self._link = settings.open_link(list(range(self._world_size)),
                                        f"vllm-scheduler(tp {self._world_size})")
        self._requests: dict[str, _RequestState] = {}
        self._step = 0
        self._step_pins: dict[int, list[Pins]] = {}
        self._step_reports: dict[int, int] = {}

    # ------------------------------------------------------------------ lookup
    def _request_state(self, request) -> _RequestState | None:
        state = self._requests.get(request.request_id)
        if state is not None:
            return state
        if (request.prompt_token_ids is None or request.lora_request is not None
                or request.mm_features
                or getattr(request, "prompt_embeds", None) is not None):
            return None
        chunk_size = self.settings.chunk_size
        num_chunks = len(request.prompt_token_ids) // chunk_size
        tokens = np.asarray(request.prompt_token_ids[: num_chunks * chunk_size], dtype=np.int64)
        # A tenant's cache salt enters the chain's root, as vLLM folds it into its first
        # block hash: no other salt (and no unsalted request) shares a chunk with it.
        state = _RequestState(request, tokens,
                              hash_request_tokens(chunk_size, tokens, request.cache_salt))
        self._requests[request.request_id] = state
        return state

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        """Tokens beyond vLLM's own hit that lmcached holds, pinned until vLLM allocates.

        One ACQUIRE covers every TP rank's namespace (the prefix READY in all of them).
        The pins wait for `update_state_after_alloc`; a new call for the same request
        (vLLM could not allocate and retries) releases them first, and
        `request_finished` releases what is left. While a request waits, its hit stays
        pinned and is not evicted.

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
        self._drop_lookup(state)
        chunk_size = self.settings.chunk_size
        state.num_local_tokens = num_computed_tokens
        first_chunk = num_computed_tokens // chunk_size
        max_chunks = min((len(request.prompt_token_ids) - 1) // chunk_size, len(state.hashes))
        if max_chunks * chunk_size <= num_computed_tokens:
            return 0
        spans, generations, pins = self._acquire(state, first_chunk, max_chunks)
        state.lookup = _PinnedLookup(first_chunk, spans, generations, pins)
        num_chunks = len(spans[0])
        return max((first_chunk + num_chunks) * chunk_size - num_computed_tokens, 0)

    # -------------------------------------------------------------------- pins
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Plan the load of the chunks vLLM now expects, on the lookup's pins.

        Without a matching pinned lookup (the lookup was for another prefix), the chunks
        are ACQUIREd now, in every rank's namespace at once. A chunk that cannot be
        pinned (daemon gone) is still planned: the workers report its blocks as a load
        error and vLLM recomputes them.
        """
        state = self._request_state(request)
        if state is None:
            return
        lookup, state.lookup = state.lookup, None
        self._drop_load(state)  # an earlier allocation whose step never came
        if num_external_tokens == 0:
            if lookup is not None:
                self._release(lookup.pins)
            return
        chunk_size, block_size = self.settings.chunk_size, self.settings.block_size
        # [start, end) is what we matched: block aligned, ending on a chunk boundary
        # unless vLLM trimmed it; each chunk overlapping it loads its blocks inside it.
        start = state.num_local_tokens
        end = start + num_external_tokens
        first_chunk = start // chunk_size
        end_chunk = min(-(-end // chunk_size), len(state.hashes))
        hashes = state.hashes[first_chunk:end_chunk]
        if lookup is not None and not self._pins_hold(lookup.pins):
            self._release(lookup.pins)  # its session ended: the blocks may hold other KV
            self.num_stale_pins += 1
            lookup = None
        if lookup is not None and lookup.first_chunk == first_chunk:
            spans = [rank_spans[: len(hashes)] for rank_spans in lookup.spans]
            generations, pins = lookup.generations, lookup.pins
        else:
            if lookup is not None:
                self._release(lookup.pins)
            spans, generations, pins = self._acquire(state, first_chunk, end_chunk)
        state.pins.extend(pins)
        num_pinned = len(spans[0])
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

    def _acquire(self, state: _RequestState, first_chunk: int, end_chunk: int):
        """ACQUIRE the request's chunks `[first_chunk, end_chunk)` in every rank's
        namespace at once (one round trip, split only past `chunks_per_request`), with
        the hash before them (the salted or unsalted root, or the chunk before) for an
        L2 fetch's verification.

        The daemon pins the prefix READY in every namespace, so each rank gets the same
        number of chunks.

        Returns:
            (spans per rank, generation per rank (-1: unreachable), the pins to release).
        """
        world_size = self._world_size
        layout = self.settings.layouts[0]
        salt = state.request.cache_salt
        hashes = state.hashes[first_chunk:end_chunk]
        parent = state.hashes[first_chunk - 1] if first_chunk else root_hash(salt)

        def acquire(snapshot):
            rank_spans = acquire_chain(snapshot, hashes, layout, parent, salt)
            pins = [Pins.of(snapshot)] if snapshot.leases else []
            return rank_spans, [snapshot.generation] * world_size, pins

        acquired = self._link.call("ACQUIRE", acquire, None)
        if acquired is None:
            return [[] for _ in range(world_size)], [-1] * world_size, []
        return acquired

    def _pins_hold(self, pins: list[Pins]) -> bool:
        """Whether every lease of `pins` still pins its blocks (`Pins.hold`, no request
        sent). A session that ended (a timeout, --idle-timeout, a restart) took its pins
        with it, and the daemon may have handed their blocks to another writer since."""
        return all(pin.hold() for pin in pins)

    def _release(self, pins: list[Pins]) -> None:
        """RELEASE the leases, one frame per ACQUIRE call (fire-and-forget: no wait on
        the daemon)."""
        for pin in pins:
            pin.release()

    def _repin(self, state: _RequestState) -> None:
        """ACQUIRE a planned load's chunks again after its pins were lost; the chunks no
        longer cached become the workers' load errors (vLLM recomputes them)."""
        self._release(state.pins)
        self.num_stale_pins += 1
        load = state.load
        load.spans, load.generations, state.pins = self._acquire(
            state, load.first_chunk, load.first_chunk + len(load.hashes))

    def _drop_lookup(self, state: _RequestState) -> None:
        """Unpin what the request's last lookup pinned and no allocation used."""
        if state.lookup is not None:
            self._release(state.lookup.pins)
            state.lookup = None

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
                if not self._pins_hold(state.pins):  # pinned in a session that ended
                    self._repin(state)
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

    def abandon_step(self) -> None:
        """Unpin the loads of the step `build_step` was building when it failed: its
        metadata never reaches the workers, so no report will release them."""
        self._release(self._step_pins.pop(self._step, []))
        self._step_reports.pop(self._step, None)

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
            self._drop_lookup(state)
            self._drop_load(state)

    def shutdown(self) -> None:
        """Close the sessions (the daemon releases every pin they hold)."""
        self._link.close()
        self._requests.clear()
        self._step_pins.clear()
