"""The worker side of the serving core: load planned chunks into an engine's KV blocks
(check, copy, re-check, TP agreement) and save new full chunks from them.

Why this file exists: each worker of a serving engine (one per TP rank) loads the chunks
the scheduler side planned into its KV cache before the forward pass, and stores new full
chunks after it. How blocks are copied is the engine's (`KVMover`, client/serving/mover.py:
vLLM's paged blocks are client/vllm/worker.py's `PagedBlocks`); the mover's physical
format is folded into each record's fingerprint, so a reader with another format counts a
mismatch instead of loading it. What to check, when, and what the ranks report is here.
Engine-neutral. Split after vLLM's NixlConnectorWorker / LMCache's worker adapter.
"""

import functools
from typing import Callable

import torch
import xxhash

from lmcached.client.cuda import register_arena, unregister_arena
from lmcached.client.chain import Chain, chunk_ranges
from lmcached.client.daemon_link import DaemonLink
from lmcached.client.records import RecordIO
from lmcached.client.serving.mover import KVMover
from lmcached.client.serving.specs import ConnectorSettings, LoadSpec, SaveSpec
from lmcached.wire.logger import init_logger
from lmcached.wire.record_format import ROOT_HASH

logger = init_logger(__name__)


class ServingWorker:
    """Worker-side state of a serving engine's connector for one TP rank.

    Args:
        settings: the connector's settings.
        rank: this worker's TP rank (its namespace is settings.layouts[rank]).
        client_name: the session's name in `lmcached clients` (the rank is appended).

    Attributes:
        num_loaded_tokens / num_saved_chunks / num_load_errors: counters of loads
            (tokens copied into the engine's blocks), stores (chunks committed) and failed
            loads (chunks reported to the engine for recompute).
        num_recheck_failures: loads whose records changed while they were copied (their
            pins were lost: the changed chunks became load errors).
        chain: this rank's chunk chains (`Chain`: saves, record checks and their
            counters), None until `register_mover`.
    """

    def __init__(self, settings: ConnectorSettings, rank: int,
                 client_name: str = "serving-worker") -> None:
        self.settings = settings
        self.rank = rank
        self.client_name = client_name
        self.num_loaded_tokens = 0
        self.num_saved_chunks = 0
        self.num_load_errors = 0
        self.num_recheck_failures = 0
        self._link: DaemonLink | None = None
        self._mover: KVMover | None = None
        self.chain: Chain | None = None
        self._load_errors: set[int] = set()
        self._failed_chunks: dict[str, int] = {}  # this step's failed loads
        self._failed_epochs: dict[str, int] = {}  # req_id -> epoch whose load failed

    def register_mover(self, mover: KVMover) -> None:
        """Copy through `mover` from now on, and attach (the daemon session is opened once:
        a mover registered after `unregister`, e.g. vLLM's wake-up from sleep mode, only
        replaces the KV tensors copied)."""
        layout = self.settings.layouts[self.rank]
        self._mover = mover
        if self._link is not None:
            return
        fingerprint = xxhash.xxh3_64_intdigest(f"{layout.fingerprint}|{mover.description}".encode())
        # GPU blocks: page-lock the arena so copies run at pinned-memory speed (the
        # engine's cuda_register path); CPU blocks need nothing.
        hooks = ((functools.partial(register_arena, device=mover.device), unregister_arena)
                 if mover.device.type == "cuda" else ())
        self._link = self.settings.open_link([self.rank],
                                             f"{self.client_name}(rank {self.rank})", *hooks)
        self.chain = Chain(self._link, layout, self.settings.verify, fingerprint=fingerprint)
        logger.info("lmcached connector: rank %d/%d, %d layers, chunk %d tokens, blocks %s",
                    self.rank, self.settings.world_size, layout.num_layers,
                    self.settings.chunk_size, mover.description)

    @property
    def registered(self) -> bool:
        """Whether the worker holds the engine's KV tensors now (False before
        `register_mover` and between `unregister` and the next `register_mover`)."""
        return self._mover is not None

    def unregister(self) -> None:
        """Drop every reference to the engine's KV tensors (e.g. vLLM 0.33's sleep mode
        frees or unmaps them: vLLM's `unregister_kv_caches`). Idempotent.

        Copies queued on the device are waited for first, so none lands in freed memory.
        Until the next `register_mover`, loads fail as load errors (the engine recomputes
        them) and saves are skipped (a future miss): nothing reads or writes the freed
        memory. The daemon session and the arena's page-locking stay (they are lmcached's
        memory, not the engine's).
        """
        if self._mover is not None:
            self._mover.wait()
            self._mover = None
            logger.info("lmcached connector: rank %d let go of the engine's KV cache",
                        self.rank)

    # ------------------------------------------------------------------ loads
    def load(self, loads: list[LoadSpec],
             agree: Callable[[list[int]], list[int]] | None = None) -> None:
        """Copy this step's planned chunks into their engine blocks (before the forward).

        Every chunk's record header (hash, token ids, fingerprint) and, with
        verify="checksum", its payload checksum are checked before it is copied
        (`Chain.check`), and the headers again once every copy is done: the scheduler's pins hold only
        while its daemon session does, and a writer given a block after they were lost
        writes the record's header first, so a record read while it was being replaced
        fails the second check. A chunk that fails, and every later chunk of its
        request, become load errors (the engine recomputes them).

        Args:
            loads: the step's loads.
            agree: maps this rank's first failed chunk per load (-1: none) to the first
                failed on any rank (a TP collective); None with a single rank.
        """
        loaded = [self._load(load) for load in loads]
        if self._mover is not None:
            self._mover.wait()  # every scatter done before the scheduler releases the pins
        failed = [self._recheck(load, first_failed, records)
                  for load, (first_failed, records) in zip(loads, loaded)]
        if agree is not None:
            failed = agree(failed)
        for load, first_failed in zip(loads, failed):
            if first_failed < 0:
                continue
            for block_ids in load.block_ids[first_failed:]:
                self._load_errors.update(block_ids)
            self.num_load_errors += len(load.hashes) - first_failed
            self._failed_chunks[load.req_id] = load.first_chunk + first_failed
            self._failed_epochs[load.req_id] = load.epoch

    def _load(self, load: LoadSpec) -> tuple[int, RecordIO | None]:
        """Load one request's chunks: (index of the first that failed, or -1; the reader
        of the records copied, None when nothing was)."""
        snapshot = self._link.snapshot() if self._mover is not None else None
        if snapshot is None:
            return 0, None
        records = self.chain.records(snapshot)
        if load.generations[self.rank] != snapshot.generation:
            return 0, None  # pinned in another arena generation: those ids mean nothing now
        chunk = self.settings.chunk_size
        spans = load.spans[self.rank][: len(load.hashes)]
        num_ok = self.chain.check(records, spans, load.hashes[: len(spans)], load.tokens,
                                  chunk_ranges(len(load.tokens), chunk, 0, len(spans)), None)
        for i in range(num_ok):
            self._mover.scatter(records.read_kv(spans[i], chunk), load.block_offsets[i],
                                load.block_ids[i])
            self.num_loaded_tokens += len(load.block_ids[i]) * self.settings.block_size
        return (-1 if num_ok == len(load.hashes) else num_ok), records

    def _recheck(self, load: LoadSpec, first_failed: int, records: RecordIO | None) -> int:
        """The first failed chunk of `load` once the records it copied are checked again
        after the copies (see `load`), or -1."""
        num_copied = len(load.hashes) if first_failed < 0 else first_failed
        if records is None or not num_copied:
            return first_failed
        chunk = self.settings.chunk_size
        num_ok = records.verify_prefix(load.spans[self.rank][:num_copied],
                                       load.hashes[:num_copied], load.tokens,
                                       chunk_ranges(len(load.tokens), chunk, 0, num_copied),
                                       records.fingerprint)
        if num_ok == num_copied:
            return first_failed
        self.num_recheck_failures += 1
        return num_ok

    def take_load_errors(self) -> set[int]:
        """Engine blocks whose load failed since the last call (the engine recomputes them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_failed_chunks(self) -> dict[str, int]:
        """req_id -> first failed chunk of this step's loads (reported to the scheduler)."""
        failed, self._failed_chunks = self._failed_chunks, {}
        return failed

    # ------------------------------------------------------------------ saves
    def save(self, saves: list[SaveSpec]) -> None:
        """Store this step's new full chunks as one chain store (`Chain.store`): one ALLOC
        and one COMMIT for the step, more only where one frame cannot carry them all, and
        then earlier requests stay WRITING until every chunk is filled, so a split save
        never evicts its own beginning. With verify="checksum" every record is sealed.

        Chunks the daemon already holds are skipped (EXISTS), as are chunks of a
        request whose load failed in this epoch (their KV attended to bad blocks).
        Each chunk's ALLOC names its parent in its own request's chain (`SaveSpec.parent`
        for a save's first), so that the daemon's KV events chain across steps.
        """
        if self._mover is None:
            return
        chunk, bpc = self.settings.chunk_size, self.settings.blocks_per_chunk
        entries, parents, seen = [], [], set()
        for save in saves:
            if self._failed_epochs.get(save.req_id, -1) >= save.epoch:
                continue
            for i, chunk_hash in enumerate(save.hashes):
                if chunk_hash not in seen:
                    seen.add(chunk_hash)
                    parent = save.hashes[i - 1] if i else save.parent
                    if parent is None:  # not known: the chunk before it in this store
                        parent = entries[-1][0] if entries else ROOT_HASH
                    parents.append(parent)
                    entries.append((chunk_hash, save.tokens[i * chunk : (i + 1) * chunk],
                                    save.block_ids[i * bpc : (i + 1) * bpc]))
        if not entries:
            return
        paged = self._mover

        def gather_into(dst: torch.Tensor, ids: list[int], span: list[int]) -> None:
            paged.gather(ids, dst)
            if len(span) > 1:  # dst is a temporary buffer, copied into the blocks next
                paged.wait()

        def write(records: RecordIO, span: list[int], i: int) -> None:
            chunk_hash, tokens, block_ids = entries[i]
            records.write_with(span, chunk_hash, tokens,
                               lambda dst: gather_into(dst, block_ids, span))

        # paged.wait: every record's bytes are in the arena before the seals and COMMIT
        self.num_saved_chunks += self.chain.store([h for h, _, _ in entries],
                                                  [chunk] * len(entries), write, paged.wait,
                                                  parents)

    def request_finished(self, req_ids: set[str]) -> None:
        """Forget finished requests' failure epochs."""
        for req_id in req_ids:
            self._failed_epochs.pop(req_id, None)

    def shutdown(self) -> None:
        """Close the session (the daemon aborts anything it still had allocated)."""
        if self._link is not None:
            self._link.close()
        if self.chain is not None:
            self.chain.forget()
