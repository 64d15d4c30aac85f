"""A model-based test of `CacheService`: random ACQUIRE / RELEASE / ALLOC / COMMIT / ABORT
of two TP=2 sessions against an independent model of what each holds (hypothesis's rule
based state machine). Its helpers live in test_service.py.
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from lmcached.daemon import keys
from lmcached.daemon.free_queue import BlockState
from lmcached.daemon.server_config import ServerConfig
from lmcached.daemon.service import CacheService
from lmcached.shm.arena import HEADER_BYTES, Arena
from lmcached.wire.protocol import (
    ALLOCATED,
    NOSPACE,
    Abort,
    Acquire,
    Alloc,
    AllocReply,
    Commit,
    Ok,
    Release,
)
from test_service import (
    assert_everything_returned,
    chunk_hashes,
    error_code,
    greeted,
    layout,
    lookup,
)

# ----------------------------------------------------------- stateful property test
# Chunk ids of a request: mostly a prompt's chain 0, 1, 2, ..., else any ids (repeats too).
HASH_IDS = st.one_of(st.integers(1, 4).map(lambda n: list(range(n))),
                     st.lists(st.integers(0, 5), min_size=1, max_size=4))
NAMESPACES = st.sampled_from([[1], [2], [1, 2], [2, 1]])
SPAN_LENGTHS = st.lists(st.sampled_from([1, 1, 1, 2, 3]), min_size=4, max_size=4)
MACHINE_BLOCKS = 24
# Values of up to 4 blocks: each layout's full chunk record is that large.
MACHINE_TP2 = [layout(0, 2, record_bytes=4 * 4096), layout(1, 2, record_bytes=4 * 4096)]
MACHINE_SHARE_BLOCKS = MACHINE_BLOCKS // 2  # --max-session-share 50


class TwoSessionsMachine(RuleBasedStateMachine):
    """Random ACQUIRE / RELEASE / ALLOC / COMMIT / ABORT of two TP=2 sessions.

    An independent model records what each session holds from the replies it got:
    its leases' block ids and its pending values. After every step, each block's
    ref_cnt equals the pins of the model's leases on it plus one if it is being
    written, so no pin is lost, doubled or negative; the pool's own invariants hold;
    every lease id ever handed out is new; no session holds more than its share of the
    arena (pins and WRITING blocks), and an ACQUIRE pins the longest READY prefix that
    fits in what is left of it. At the end, closing both sessions returns every pin and
    every WRITING block.
    """

    def __init__(self, arena_name: str):
        super().__init__()
        arena = Arena.create(arena_name, HEADER_BYTES + MACHINE_BLOCKS * 4096, 4096,
                             prefault=False)
        self.service = CacheService(ServerConfig(name=arena.name, socket="/nonexistent",
                                                 max_session_share=50.0), arena)
        self.sessions = [greeted(self.service, *MACHINE_TP2) for _ in range(2)]
        self.leases = [{}, {}]  # per session: lease -> block ids (one per pin)
        self.pending = [[], []]  # per session: block-id lists of uncommitted values
        self.seen_leases: set[int] = set()
        self.stored: list[list[int]] = []  # chunk ids of each store, to ACQUIRE again
        self.num_not_owner = 0

    def teardown(self):
        try:
            assert_everything_returned(self.service)
        finally:
            self.service.arena.close()

    @rule(who=st.sampled_from([0, 1]), namespaces=NAMESPACES, data=st.data())
    def acquire(self, who, namespaces, data):
        ids = data.draw(st.one_of(st.sampled_from(self.stored), HASH_IDS) if self.stored
                        else HASH_IDS)
        room = MACHINE_SHARE_BLOCKS - self.held(who)
        pinned = {b for block_ids in self.leases[who].values() for b in block_ids}
        fits, taken = 0, set()
        for chunk in ids[: lookup(self.service, self.sessions[who], namespaces, ids)]:
            for ns in namespaces:
                span = self.service.pool.cached[keys.chunk_prefix(ns) + chunk_hashes([chunk])]
                taken.update(b.block_id for b in span if b.block_id not in pinned)
            if len(taken) > room:
                break
            fits += 1
        reply = self.service.handle(self.sessions[who], Acquire(namespaces, chunk_hashes(ids)))
        num_chunks = len(reply.span_lengths) // len(namespaces)
        assert num_chunks == fits
        for i, span in enumerate(reply.spans()):  # namespace-major, the request's order
            ns, chunk = namespaces[i // num_chunks], ids[i % num_chunks]
            key = keys.chunk_prefix(ns) + chunk_hashes([chunk])
            assert [b.block_id for b in self.service.pool.cached[key]] == span
        if not reply.block_ids:
            assert reply.lease == 0
            return
        assert reply.lease not in self.seen_leases
        self.seen_leases.add(reply.lease)
        self.leases[who][reply.lease] = reply.block_ids

    @rule(who=st.sampled_from([0, 1]), data=st.data())
    def release(self, who, data):
        held = list(self.leases[who])
        others = list(self.leases[1 - who])
        choices = [st.just([]), st.lists(st.integers(0, max(self.seen_leases, default=0) + 2),
                                         max_size=2)]
        if held:
            choices.append(st.lists(st.sampled_from(held), min_size=1, max_size=2))
        if others:
            choices.append(st.lists(st.sampled_from(others), min_size=1, max_size=1))
        leases = data.draw(st.one_of(choices))
        valid = len(set(leases)) == len(leases) and all(lease in held for lease in leases)
        assert self.service.handle(self.sessions[who], Release(leases)) is None
        if valid:
            for lease in leases:
                del self.leases[who][lease]
        else:
            self.num_not_owner += 1
        assert self.service.stats.errors.get("not_owner", 0) == self.num_not_owner

    def held(self, who) -> int:
        """Blocks session `who` holds in the model: the blocks it pins (each once),
        plus the blocks it writes."""
        return (len({b for block_ids in self.leases[who].values() for b in block_ids})
                + sum(map(len, self.pending[who])))

    def _alloc(self, who, ns, ids, num_blocks) -> tuple[list[int], list[list[int]]]:
        """ALLOC; returns (status per chunk, block ids of each ALLOCATED value)."""
        sizes = [n * 4096 - 100 for n in num_blocks[: len(ids)]]
        reply = self.service.handle(self.sessions[who], Alloc(ns, chunk_hashes(ids), sizes))
        assert isinstance(reply, AllocReply), reply
        allocated = []
        for status, span, size in zip(reply.status, reply.spans(), sizes):
            if status == ALLOCATED:
                assert len(span) == -(-size // 4096)
                allocated.append(span)
            else:
                assert span is None
        return reply.status, allocated

    @rule(who=st.sampled_from([0, 1]), ns=st.sampled_from([1, 2]), ids=HASH_IDS,
          num_blocks=SPAN_LENGTHS)
    def alloc(self, who, ns, ids, num_blocks):
        self.pending[who].extend(self._alloc(who, ns, ids, num_blocks)[1])

    @rule(who=st.sampled_from([0, 1]), namespaces=NAMESPACES, ids=HASH_IDS,
          num_blocks=SPAN_LENGTHS)
    def store(self, who, namespaces, ids, num_blocks):
        """ALLOC then COMMIT in each namespace, as a client's store does (one per rank)."""
        for ns in namespaces:
            status, allocated = self._alloc(who, ns, ids, num_blocks)
            block_ids = [block_id for span in allocated for block_id in span]
            assert self.service.handle(self.sessions[who], Commit(block_ids)) == Ok()
            # Every chunk answered EXISTS or ALLOCATED is READY now (committed by this
            # session, or by another first); one answered only NOSPACE is not.
            ready = {chunk for chunk, answer in zip(ids, status) if answer != NOSPACE}
            expected = next((i for i, chunk in enumerate(ids) if chunk not in ready), len(ids))
            assert lookup(self.service, self.sessions[who], [ns], ids) == expected
        self.stored.append(ids)

    @precondition(lambda self: self.pending[0] or self.pending[1])
    @rule(data=st.data(), commit=st.booleans())
    def commit_or_abort(self, data, commit):
        who = data.draw(st.sampled_from([i for i in (0, 1) if self.pending[i]]))
        chosen = data.draw(st.lists(st.sampled_from(self.pending[who]), min_size=1,
                                    max_size=3, unique_by=tuple))
        block_ids = [span[0] for span in chosen]
        foreign = data.draw(st.booleans())
        if foreign:  # the other session may neither commit nor abort them
            reply = self.service.handle(self.sessions[1 - who], Commit(block_ids))
            assert error_code(reply) == "not_owner"
            self.num_not_owner += 1
            return
        request = Commit(block_ids) if commit else Abort(block_ids)
        assert self.service.handle(self.sessions[who], request) == Ok()
        for span in chosen:
            self.pending[who].remove(span)

    @rule(who=st.sampled_from([0, 1]))
    def reconnect(self, who):
        self.service.close_session(self.sessions[who])
        self.leases[who].clear()
        self.pending[who].clear()
        self.sessions[who] = greeted(self.service, *MACHINE_TP2)

    @invariant()
    def every_pin_is_accounted_for(self):
        pool = self.service.pool
        pool.check_invariants()
        expected = [0] * pool.num_blocks
        for held in self.leases:
            for block_ids in held.values():
                for block_id in block_ids:
                    expected[block_id] += 1
        for pending in self.pending:
            for span in pending:
                for block_id in span:
                    assert pool.blocks[block_id].state == BlockState.WRITING
                    expected[block_id] += 1
        assert [b.ref_cnt for b in pool.blocks] == expected
        for who, (session, held) in enumerate(zip(self.sessions, self.leases)):
            assert session.num_pinned_blocks == sum(map(len, held.values()))
            assert session.num_host_blocks_held == self.held(who) <= MACHINE_SHARE_BLOCKS


def test_random_requests_of_two_sessions_keep_every_pin_accounted_for(unique_name):
    names = iter(range(1_000_000))
    run_state_machine_as_test(
        lambda: TwoSessionsMachine(f"{unique_name}-{next(names)}"),
        settings=settings(max_examples=60, stateful_step_count=25, deadline=None),
    )
