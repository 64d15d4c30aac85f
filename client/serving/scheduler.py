"""The scheduler side of the serving core: pinned lookups, step pins, epochs, worker reports.

Why this file exists: a serving engine's scheduler asks how much of a prompt lmcached
holds, says which of its blocks it allocated for it, and ships per-step work to its
workers. `ServingScheduler` answers against the daemon in one session that holds every
tensor parallel rank's namespace. A request costs one synchronous round trip whatever
the TP size (protocol v2): `lookup` ACQUIREs the hit in every rank's namespace at once (a
pinned lookup, after LMCache's lookup(pin=True)), and `allocate` plans the load on those
pins instead of asking again; `plan_step` hands each planned load to one step, whose pins
are RELEASEd without waiting once every rank has reported it loaded (`on_worker_report`).
Pinning at lookup also means a chunk the engine was promised cannot be evicted before it
is loaded. A failed load bumps its request's epoch, so the workers never save KV computed
on top of it. Engine-neutral: an engine's glue (client/vllm/scheduler.py) passes a
`RequestView` and plain block ids. Split after vLLM's NixlConnectorScheduler / LMCache's
scheduler adapter.
"""

import dataclasses
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np

from lmcached.client.chain import Pins, acquire_chain
from lmcached.client.hashing import ChunkHash, hash_request_tokens, root_hash
from lmcached.client.serving.specs import ConnectorSettings, LoadSpec, SaveSpec
from lmcached.wire.logger import init_logger
from lmcached.wire.record_format import ROOT_HASH

logger = init_logger(__name__)


class RequestView(Protocol):
    """What the scheduler side reads of an engine's request (vLLM's `Request` is one).

    Attributes:
        request_id: the engine's request id (unique while the request lives).
        prompt_token_ids: the prompt's token ids.
        cache_salt: the tenant's cache salt (enters the chunk chain's root), or None.
        num_computed_tokens: tokens the engine has computed (or loaded) so far, read when
            a step is planned.
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    cache_salt: str | None
    num_computed_tokens: int


@dataclasses.dataclass
class _PinnedLookup:
    """What `lookup` pinned, waiting for `allocate`."""

    first_chunk: int
    spans: list[list[list[int]]]  # per rank, the block ids of each pinned chunk
    generations: list[int]  # per rank (-1: unreachable)
    pins: list[Pins]


@dataclasses.dataclass
class _RequestState:
    """What the scheduler side keeps per request (dropped in `finish`)."""

    request: RequestView
    tokens: np.ndarray  # int64 [num_full_chunks * chunk_size]: the prompt's full chunks
    hashes: list[ChunkHash]  # one per full chunk, from root_hash(request.cache_salt)
    num_local_tokens: int = 0  # the engine's own hit, as passed to lookup
    num_saved_chunks: int = 0  # chunks [0, n) are loaded, or were sent to be saved
    epoch: int = 0
    load: LoadSpec | None = None  # allocated this step, not yet in the metadata
    pins: list[Pins] = dataclasses.field(default_factory=list)  # pins of `load`
    lookup: _PinnedLookup | None = None  # pinned by the last lookup, not yet allocated


class ServingScheduler:
    """Scheduler-side state of a serving engine's connector: one daemon session for every
    TP rank.

    Args:
        settings: the connector's settings (layouts of every rank, sizes, daemon).
        client_name: the session's name in `lmcached clients`.

    Attributes:
        num_matched_tokens: tokens the engine accepted from lmcached (`allocate`).
        num_stale_pins: pinned lookups or loads whose daemon session ended before the
            workers read them (their chunks were ACQUIREd again).
    """

    def __init__(self, settings: ConnectorSettings,
                 client_name: str = "serving-scheduler") -> None:
        self.settings = settings
        self.num_matched_tokens = 0
        self.num_stale_pins = 0
        self._world_size = len(settings.layouts)
        self._link = settings.open_link(list(range(self._world_size)),
                                        f"{client_name}(tp {self._world_size})")
        self._requests: dict[str, _RequestState] = {}
        self._step = 0
        self._step_pins: dict[int, list[Pins]] = {}
        self._step_reports: dict[int, int] = {}

    # ------------------------------------------------------------------ lookup
    def _request_state(self, request: RequestView) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is not None:
            return state
        chunk_size = self.settings.chunk_size
        num_chunks = len(request.prompt_token_ids) // chunk_size
        tokens = np.asarray(request.prompt_token_ids[: num_chunks * chunk_size], dtype=np.int64)
        # A tenant's cache salt enters the chain's root, as vLLM folds it into its first
        # block hash: no other salt (and no unsalted request) shares a chunk with it.
        state = _RequestState(request, tokens,
                              hash_request_tokens(chunk_size, tokens, request.cache_salt))
        self._requests[request.request_id] = state
        return state

    def lookup(self, request: RequestView, num_computed_tokens: int) -> int:
        """Tokens beyond the engine's own hit that lmcached holds, pinned until it allocates.

        One ACQUIRE covers every TP rank's namespace (the prefix READY in all of them).
        The pins wait for `allocate`; a new call for the same request (the engine could
        not allocate and retries) releases them first, and `finish` releases what is
        left. While a request waits, its hit stays pinned and is not evicted. The engine's
        glue calls it only for requests it can cache (e.g. not for LoRA or multimodal
        requests in vLLM).

        Args:
            request: the engine's request.
            num_computed_tokens: the engine's local prefix-cache hit (block aligned).

        Returns:
            A multiple of the block size (the hit ends on a chunk boundary), leaving at
            least one prompt token to compute; 0 when the daemon is unavailable.
        """
        state = self._request_state(request)
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
    def allocate(self, request: RequestView, block_ids: Sequence[int],
                 num_external_tokens: int) -> None:
        """Plan the load of the chunks the engine now expects, on the lookup's pins.

        Without a matching pinned lookup (the lookup was for another prefix), the chunks
        are ACQUIREd now, in every rank's namespace at once. A chunk that cannot be
        pinned (daemon gone) is still planned: the workers report its blocks as a load
        error and the engine recomputes them.

        Args:
            request: the engine's request (as passed to `lookup`).
            block_ids: the request's engine block ids, from its first token (read only
                when `num_external_tokens` is not 0).
            num_external_tokens: tokens the engine accepted from lmcached (0: none; the
                lookup's pins are released).
        """
        state = self._request_state(request)
        lookup, state.lookup = state.lookup, None
        self._drop_load(state)  # an earlier allocation whose step never came
        if num_external_tokens == 0:
            if lookup is not None:
                self._release(lookup.pins)
            return
        chunk_size, block_size = self.settings.chunk_size, self.settings.block_size
        # [start, end) is what we matched: block aligned, ending on a chunk boundary
        # unless the engine trimmed it; each chunk overlapping it loads its blocks inside it.
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
        bpc = self.settings.blocks_per_chunk
        block_offsets, load_block_ids = [], []
        for chunk in range(first_chunk, end_chunk):
            first_block = max(chunk * bpc, start // block_size)
            end_block = min((chunk + 1) * bpc, end // block_size)
            block_offsets.append(list(range(first_block - chunk * bpc, end_block - chunk * bpc)))
            load_block_ids.append(list(block_ids[first_block:end_block]))
        state.load = LoadSpec(
            request.request_id, state.epoch, first_chunk,
            state.tokens[first_chunk * chunk_size : end_chunk * chunk_size],
            list(hashes), spans, generations, block_offsets, load_block_ids,
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
        longer cached become the workers' load errors (the engine recomputes them)."""
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
    def plan_step(self, num_scheduled_tokens: Mapping[str, int],
                  block_ids_of: Callable[[str], Sequence[int]] | None
                  ) -> tuple[int, list[LoadSpec], list[SaveSpec]]:
        """This step's number, loads (allocated since the last step) and saves (full
        prompt chunks computed by the end of this step and not stored yet), for every
        worker. The loads' pins are held until every rank reports the step
        (`on_worker_report`) or the step is abandoned (`abandon_step`).

        Args:
            num_scheduled_tokens: req_id -> tokens the engine computes this step.
            block_ids_of: req_id -> the request's engine block ids, from its first token
                (called only for requests with chunks to save); None: the engine does not
                say, and nothing is saved this step.
        """
        self._step += 1
        loads, saves = [], []
        chunk, bpc = self.settings.chunk_size, self.settings.blocks_per_chunk
        for req_id, num_new_tokens in num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None:
                continue
            if state.load is not None:
                if not self._pins_hold(state.pins):  # pinned in a session that ended
                    self._repin(state)
                loads.append(state.load)
                self._step_pins.setdefault(self._step, []).extend(state.pins)
                state.load, state.pins = None, []
            if state.num_saved_chunks >= len(state.hashes) or block_ids_of is None:
                continue
            ready = min((state.request.num_computed_tokens + num_new_tokens) // chunk,
                        len(state.hashes))
            first = state.num_saved_chunks
            if ready <= first:
                continue
            block_ids = block_ids_of(req_id)
            saves.append(SaveSpec(
                req_id, state.epoch, state.tokens[first * chunk : ready * chunk],
                list(state.hashes[first:ready]), list(block_ids[first * bpc : ready * bpc]),
                state.hashes[first - 1] if first else ROOT_HASH,
            ))
            state.num_saved_chunks = ready
        return self._step, loads, saves

    def abandon_step(self) -> None:
        """Unpin the loads of the step `plan_step` was building when it failed: its
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

    def finish(self, req_id: str) -> None:
        """Forget the request; unpin a load that never reached a step."""
        state = self._requests.pop(req_id, None)
        if state is not None:
            self._drop_lookup(state)
            self._drop_load(state)

    def shutdown(self) -> None:
        """Close the sessions (the daemon releases every pin they hold)."""
        self._link.close()
        self._requests.clear()
        self._step_pins.clear()
