"""Chunk records over several tiers: one reader per tier, chosen by each block reference.

Why this file exists: a session that maps device tiers (docs/architecture.md, "Tiers")
holds records in the host arena and in each tier's memory, and the engine's read and
store paths take block references (`block_ref(tier, block)`, lmcached/wire/protocol.py)
without asking which tier they name. `TieredRecords` has the methods of `RecordIO`
(client/records.py) and hands each record to the reader of its tier.
"""

import numpy as np
import torch

from lmcached.client.records import RecordIO
from lmcached.wire.protocol import local_block, tier_of


class TieredRecords:
    """`RecordIO` over the host arena and the device tiers a session mapped: the same
    methods, taking block references (`block_ref(tier, block)`, lmcached/wire/protocol.py) and
    dispatching each record to the reader of its tier (a value's blocks are always in
    one tier). Used only when a session maps device tiers; without, the engine keeps
    its plain host `RecordIO` (no dispatch on the hot path).

    Args:
        by_tier: tier id -> RecordIO over that tier's mapped memory; tier 0 (the host
            arena) must be there.
    """

    def __init__(self, by_tier: dict[int, RecordIO]) -> None:
        self.by_tier = by_tier
        host = by_tier[0]
        self.arena = host.arena  # the generation's host arena (`RecordIO.for_arena`)
        self.layout = host.layout
        self.fingerprint = host.fingerprint

    def _split(self, span: list[int]) -> tuple[RecordIO, list[int]]:
        """The reader of `span`'s tier and its local block ids.

        Raises:
            KeyError: a tier this session has not mapped (the daemon never hands one).
        """
        tier = tier_of(span[0])
        if not tier:
            return self.by_tier[0], span
        return self.by_tier[tier], [local_block(ref) for ref in span]

    def maps(self, block_ids: list[int]) -> bool:
        """True when every reference in `block_ids` is of a tier mapped here."""
        return {tier_of(ref) for ref in block_ids} <= self.by_tier.keys()

    def write(self, span: list[int], *args) -> None:
        """`RecordIO.write` into the tier of `span`."""
        records, local = self._split(span)
        records.write(local, *args)

    def write_with(self, span: list[int], *args) -> None:
        """`RecordIO.write_with` into the tier of `span`."""
        records, local = self._split(span)
        records.write_with(local, *args)

    def seal(self, span: list[int], num_tokens: int) -> None:
        """`RecordIO.seal` in the tier of `span`."""
        records, local = self._split(span)
        records.seal(local, num_tokens)

    def checksum_ok(self, span: list[int], num_tokens: int) -> bool:
        """`RecordIO.checksum_ok` in the tier of `span`."""
        records, local = self._split(span)
        return records.checksum_ok(local, num_tokens)

    def pieces(self, span: list[int], start: int, end: int) -> list[np.ndarray]:
        """`RecordIO.pieces` of the record in `span`, in its tier."""
        records, local = self._split(span)
        return records.pieces(local, start, end)

    def verify(self, span: list[int], *args) -> bool:
        """`RecordIO.verify` in the tier of `span`; False for a tier not mapped here."""
        try:
            records, local = self._split(span)
        except KeyError:
            return False
        return records.verify(local, *args)

    def verify_prefix(self, spans: list[list[int]], chunk_hashes: list[bytes],
                      token_array: np.ndarray, chunks: list[tuple[int, int]],
                      fingerprint: int) -> int:
        """`RecordIO.verify_prefix` over records of several tiers: each run of records
        in one tier is checked by that tier's reader (its vectorized fast path); a tier
        not mapped here ends the prefix."""
        start = 0
        while start < len(spans):
            tier = tier_of(spans[start][0])
            end = start + 1
            while end < len(spans) and tier_of(spans[end][0]) == tier:
                end += 1
            records = self.by_tier.get(tier)
            if records is None:
                return start
            local = spans[start:end] if not tier else \
                [[local_block(ref) for ref in span] for span in spans[start:end]]
            num_ok = records.verify_prefix(local, chunk_hashes[start:end], token_array,
                                           chunks[start:end], fingerprint)
            if num_ok < end - start:
                return start + num_ok
            start = end
        return len(spans)

    def synchronize(self) -> None:
        """Wait for the copies queued on every device tier (before a release)."""
        for records in self.by_tier.values():
            records.synchronize()

    def kv_view(self, ref: int, num_tokens: int) -> torch.Tensor:
        """`RecordIO.kv_view` of a one-block record in its tier (zero copy)."""
        records, local = self._split([ref])
        return records.kv_view(local[0], num_tokens)

    def read_kv(self, span: list[int], num_tokens: int) -> torch.Tensor:
        """`RecordIO.read_kv` of the record in `span`, in its tier."""
        records, local = self._split(span)
        return records.read_kv(local, num_tokens)

    def layer_view(self, span: list[int], num_tokens: int, layer: int) -> torch.Tensor:
        """`RecordIO.layer_view` of the record in `span`, in its tier (a record spanning
        several blocks is always in the host arena: device tiers hold one-block records)."""
        records, local = self._split(span)
        return records.layer_view(local, num_tokens, layer)
