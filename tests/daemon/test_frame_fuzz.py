"""Fuzzing the daemon's frame handling in process: no frame crashes it or breaks the pool.

Every frame goes through `lmcached.daemon.connection.answer_frame`, the daemon's one entry point
from bytes to reply, over a real `CacheService` and arena. The frames are well-formed
requests of every type (seeded with chunks that are really stored, pinned and being
written, and with leases really held), then mutated: wrong types, huge integers, nested
containers, unknown tags, invalid UTF-8, truncation, byte flips. Every frame gets exactly
one reply, except one that decodes to a RELEASE, which gets none (protocol v2). After
every batch the block pool's invariants hold; after every session ended, nothing is
pinned or being written. A last test pipelines RELEASEs of random leases through a real
daemon: no reply to any of them, and the replies of the other requests stay in step.
"""

import dataclasses
import random
import socket

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import is_release_frame
from raw_frames import connect, pending_bytes, read_replies
from lmcached.daemon.server_config import ServerConfig
from lmcached.wire.connection import Connection, hello
from lmcached.wire.frames import encode_frame, reply_decoder
from lmcached.wire.protocol import (
    MAX_WIRE_INT,
    PROTOCOL_VERSION,
    Acquire,
    Alloc,
    AllocReply,
    BlocksReply,
    Clients,
    Commit,
    Error,
    Hello,
    Info,
    InfoReply,
    Layout,
    Lookup,
    Ok,
    Ping,
    Release,
)
from lmcached.daemon.commands import COMMANDS
from lmcached.daemon.connection import answer_frame
from lmcached.daemon.service import CacheService
from lmcached.daemon.stats import MAX_TENANTS_PER_SESSION
from lmcached.shm.arena import Arena

LAYOUT = Layout("tiny-llama", 1, 0, "vllm", "bfloat16", 2, 2, 4, 16, 1000)
RANK0 = Layout("tiny-llama", 2, 0, "vllm", "bfloat16", 2, 1, 4, 16, 1000)
RANK1 = Layout("tiny-llama", 2, 1, "vllm", "bfloat16", 2, 1, 4, 16, 1000)
NUM_BATCHES = 200
FRAMES_PER_BATCH = 100  # 20,000 frames in all
_MSGPACK = msgspec.msgpack.Encoder()

# Byte strings that are not valid msgpack str contents: a fixstr of invalid UTF-8, a
# lone continuation byte, an overlong encoding, a surrogate.
BAD_UTF8 = [b"\xa2\xff\xfe", b"\xa1\x80", b"\xa2\xc0\xaf", b"\xa3\xed\xa0\x80"]
HOSTILE_VALUES = [
    None, True, -1, 0, 2**31, 2**32, 2**63 - 1, -(2**63), 2**64 - 1, 1.5, float("inf"),
    "", "x" * 300, "\u00e9\u4e2d", b"", b"\x00" * 17, [], [[[[[[[[[[[]]]]]]]]]]], {"a": 1},
    {1: [2, {3: None}]}, list(range(1000)),
]


def chunk_hashes(ids) -> bytes:
    return b"".join(i.to_bytes(16, "little") for i in ids)


@pytest.fixture
def service(unique_name):
    arena = Arena.create(unique_name, 8 << 20, 64 << 10, prefault=False)
    svc = CacheService(ServerConfig(name=unique_name, socket="/nonexistent"), arena)
    yield svc
    arena.close()


def greet(service: CacheService, name: str):
    """A session of `service` that said HELLO with RANK0 and RANK1 (namespaces 1, 2)."""
    session = service.open_session(1, 0, 0)
    frame, _ = answer_frame(service, session, _MSGPACK.encode(
        Hello(PROTOCOL_VERSION, 1, name, [RANK0, RANK1])))
    reply = reply_decoder.decode(frame[4:])
    assert reply.namespaces == [1, 2]
    return session


def request(service, session, message):
    """Answer `message` in process; None for a request that has no reply (RELEASE)."""
    frame, _ = answer_frame(service, session, _MSGPACK.encode(message))
    return None if frame is None else reply_decoder.decode(frame[4:])


LEASE_WINDOW = 8  # fuzzed leases: from 2 below a held lease to 6 above it


def seed_requests(ns: int, rng: random.Random, first_lease: int = 1) -> list[list]:
    """Well-formed requests of every type, as the lists msgspec encodes them to.

    `ns` and `ns + 1` are the namespaces of the fuzzed session (RANK0, RANK1); leases
    are drawn around `first_lease` (a lease really held, or the next one the daemon
    hands out), so RELEASEs free real pins too. The number of draws from `rng` does not
    depend on the arguments (hypothesis replays it).
    """
    ids = [rng.randrange(40) for _ in range(rng.randrange(1, 6))]
    block_ids = [rng.randrange(-2, 140) for _ in range(rng.randrange(0, 5))]
    leases = [first_lease - 2 + rng.randrange(LEASE_WINDOW)
              for _ in range(rng.randrange(0, 4))]
    namespaces = rng.choice([[ns], [ns + 1], [ns, ns + 1], [ns + 1, ns], [ns, ns], [],
                             [ns, ns + 9]])
    layouts = [msgspec.to_builtins(layout) for layout in rng.choice(
        [[LAYOUT], [RANK0, RANK1], [RANK1], []])]
    return [
        ["hello", PROTOCOL_VERSION, 7, "fuzz", layouts],
        ["hello", 1, 7, "v1", list(msgspec.structs.astuple(LAYOUT))],  # a v1 client
        ["lookup", namespaces, chunk_hashes(ids)],
        ["acquire", namespaces, chunk_hashes(ids)],
        ["release", leases],
        ["release", [first_lease + rng.randrange(4)]],  # most often a lease really held
        ["alloc", ns, chunk_hashes(ids), [1000] * len(ids)],
        ["commit", block_ids],
        ["abort", block_ids],
        ["put", ns, f"key{rng.randrange(5)}", rng.randrange(1, 200_000)],
        ["get", ns, f"key{rng.randrange(5)}"],
        ["delete", ns, f"key{rng.randrange(5)}"],
        ["scan", ns, "k", rng.randrange(-1, 20)],
        ["info", rng.choice([None, "stats", "blocks", "nope"])],
        ["clients"],
        ["evict", rng.randrange(0, 3), rng.choice([None, "key1", "00" * 16])],
        ["clear"],
        ["ping"],
        ["config_get"],
    ]


def mutate(obj: list, rng: random.Random) -> bytes:
    """One well-formed request, mutated at the object level and then at the byte level."""
    obj = list(obj)
    kind = rng.randrange(10)
    if kind == 0 and len(obj) > 1:  # a field of the wrong type or out of range
        obj[rng.randrange(1, len(obj))] = rng.choice(HOSTILE_VALUES)
    elif kind == 1:  # an unknown or mistyped tag
        obj[0] = rng.choice(["nope", "", "HELLO", 0, None, b"ping", "ping\x00"])
    elif kind == 2:  # missing or extra fields
        obj = obj[: rng.randrange(len(obj))] if rng.random() < 0.5 else obj + [1, "x"]
    elif kind == 3:  # a deep nest instead of the request
        for _ in range(rng.randrange(1, 200)):
            obj = [obj]
    payload = _MSGPACK.encode(obj)
    kind = rng.randrange(6)
    if kind == 0:  # invalid UTF-8 spliced in where a str may be expected
        pos = rng.randrange(len(payload) + 1)
        payload = payload[:pos] + rng.choice(BAD_UTF8) + payload[pos:]
    elif kind == 1:  # truncated
        payload = payload[: rng.randrange(len(payload))]
    elif kind == 2:  # a few flipped bytes
        raw = bytearray(payload)
        for _ in range(rng.randrange(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        payload = bytes(raw)
    return payload


@settings(max_examples=NUM_BATCHES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.large_base_example])
@given(rng=st.randoms(use_true_random=False))
def _fuzz_batch(base, stats, rng):
    # A fresh service (over the same arena) per example: lease ids, which the fuzzed
    # frames carry, then do not depend on earlier examples, so hypothesis can replay one.
    service = CacheService(base.config, base.arena)
    sessions = [greet(service, "writer"), service.open_session(2, 0, 0)]
    # Real state to fuzz against: stored chunks in both namespaces, values being written,
    # and a lease held (pinned prefix) whose id the fuzzed RELEASEs may draw.
    for ns in (1, 2):
        alloc = request(service, sessions[0], Alloc(ns, chunk_hashes(range(8)), [1000] * 8))
        assert isinstance(alloc, AllocReply)
        if alloc.block_ids:
            request(service, sessions[0], Commit(alloc.block_ids))
    pinned_before = service.pool.num_pinned_blocks
    held = request(service, sessions[0], Acquire([1, 2], chunk_hashes(range(3))))
    assert isinstance(held, BlocksReply)
    try:
        for _ in range(FRAMES_PER_BATCH):
            session = rng.choice(sessions)
            payload = mutate(rng.choice(seed_requests(1, rng, held.lease)), rng)
            pins_before = sum(s.num_pinned_blocks for s in sessions)
            frame, cost = answer_frame(service, session, payload)
            assert cost >= 1
            stats["frames"] += 1
            if frame is None:  # no reply: only ever to a frame tagged "release"
                assert is_release_frame(payload), payload
                stats["releases"] += 1
                if sum(s.num_pinned_blocks for s in sessions) < pins_before:
                    stats["leases_released"] += 1
                continue
            reply = reply_decoder.decode(frame[4:])  # always a well-formed reply frame
            stats["errors"] += isinstance(reply, Error)
            if isinstance(reply, Error):
                stats["codes"].add(reply.code)
            stats["max_pinned"] = max(stats["max_pinned"], service.pool.num_pinned_blocks)
            stats["max_writing"] = max(stats["max_writing"], service.pool.num_writing_blocks)
        service.pool.check_invariants()
        for session in sessions:  # each session still in step: a PING gets its Ok
            assert isinstance(request(service, session, Ping()), Ok)
    finally:  # a failing example must not leave its sessions to the next one
        for session in sessions:
            service.close_session(session)
    assert pinned_before == 0
    service.pool.check_invariants()
    assert service.pool.num_pinned_blocks == 0, "a session left pins behind"
    assert service.pool.num_writing_blocks == 0, "a session left WRITING blocks behind"
    assert service.sessions == {}


@pytest.mark.slow
def test_twenty_thousand_mutated_frames_never_crash_or_leak(service):
    stats = {"frames": 0, "errors": 0, "codes": set(), "max_pinned": 0, "max_writing": 0,
             "releases": 0, "leases_released": 0}
    _fuzz_batch(service, stats)
    assert stats["frames"] >= NUM_BATCHES * FRAMES_PER_BATCH
    assert {"bad_request", "version", "bad_namespace"} <= stats["codes"]
    # The fuzz really exercised pins, writes and real releases, so the leak checks above
    # mean something.
    assert stats["max_pinned"] > 0 and stats["max_writing"] > 0
    assert stats["releases"] > 0 and stats["leases_released"] > 0
    print(f"fuzzed {stats['frames']} frames: {stats['errors']} error replies "
          f"({sorted(stats['codes'])}), {stats['releases']} unanswered RELEASEs "
          f"({stats['leases_released']} freed pins), 0 crashes, 0 leaked blocks")


def test_invalid_utf8_str_is_a_bad_request_not_a_crash(service):
    session = service.open_session(1, 0, 0)
    frame, _ = answer_frame(service, session, b"\x91\xa2\xff\xfe")
    reply = reply_decoder.decode(frame[4:])
    assert isinstance(reply, Error) and reply.code == "bad_request"
    assert "UnicodeDecodeError" in reply.message


def test_handler_bug_answers_internal_and_service_serves_on(service, monkeypatch, caplog):
    session = greet(service, "w")

    def broken(service, session, req):
        raise ZeroDivisionError("a bug")

    monkeypatch.setitem(COMMANDS, Lookup, dataclasses.replace(COMMANDS[Lookup], handler=broken))
    reply = request(service, session, Lookup([1], chunk_hashes([1])))
    assert isinstance(reply, Error) and reply.code == "internal"
    assert "ZeroDivisionError" in caplog.text  # logged with its traceback
    assert isinstance(request(service, session, Ping()), Ok)


def test_unencodable_reply_answers_internal(service, monkeypatch, caplog):
    session = service.open_session(1, 0, 0)
    monkeypatch.setitem(COMMANDS, Ping, dataclasses.replace(
        COMMANDS[Ping], handler=lambda service, s, r: InfoReply({"x": {"y": object()}})))
    frame, _ = answer_frame(service, session, _MSGPACK.encode(["ping"]))
    reply = reply_decoder.decode(frame[4:])
    assert isinstance(reply, Error) and reply.code == "internal"
    assert encode_frame(reply)  # and it is itself a valid frame


# ------------------------------------------- RELEASE of random leases, on a real daemon
# A lease in a pipelined RELEASE: one of the last leases handed out (held, or already
# released), one not handed out yet when the RELEASE is sent, another session's, or any
# 64-bit integer.
LEASE_REFS = st.one_of(
    st.integers(min_value=0, max_value=3).map(lambda k: ("recent", k)),
    st.integers(min_value=0, max_value=2).map(lambda k: ("future", k)),
    st.just(("foreign", 0)),
    st.integers(min_value=-(2**63), max_value=2**64 - 1).map(lambda n: ("raw", n)),
)
PIPELINE_OPS = st.lists(st.one_of(
    st.integers(min_value=1, max_value=3).map(lambda n: ("acquire", n)),
    st.lists(LEASE_REFS, max_size=4).map(lambda refs: ("release", refs)),
    st.just(("ping", None)),
), min_size=1, max_size=20)


def read_frames(sock: socket.socket, count: int) -> list:
    """Read and decode `count` reply frames."""
    replies = read_replies(sock, count)
    assert pending_bytes(sock) == b"", "more reply bytes than requests that have a reply"
    return replies


@pytest.mark.slow
def test_pipelined_releases_of_random_leases_keep_the_replies_in_step(daemon):
    """ACQUIREs, RELEASEs of random leases (real, future, unknown, repeated, another
    session's) and PINGs, pipelined in one write: no RELEASE gets a reply, every other
    request gets its own, in order, ending with the last PING's Ok; the session's pins
    and the `not_owner` count match a model of leases (a RELEASE is refused whole when
    a lease in it is not held or listed twice, and not decoded, counted as `bad_request`,
    when a lease is out of the wire's range)."""
    owner = Connection(daemon.socket)
    ns_a, ns_b = hello(owner, "owner", [RANK0, RANK1]).namespaces
    for ns in (ns_a, ns_b):
        owner.request(Commit(owner.request(Alloc(ns, chunk_hashes(range(3)), [1000] * 3))
                             .block_ids))
    foreign = owner.request(Acquire([ns_a], chunk_hashes([0]))).lease  # never releasable
    sock = connect(daemon.socket, timeout_s=30)
    sock.sendall(encode_frame(Hello(PROTOCOL_VERSION, 1, "pipe", [RANK0, RANK1])))
    assert read_frames(sock, 1)[0].namespaces == [ns_a, ns_b]
    totals = {"refused": 0, "freed": 0, "undecodable": 0}

    def session_pins() -> int:
        rows = owner.request(Clients()).clients
        return next(row["pinned_blocks"] for row in rows if row["name"] == "pipe")

    @settings(max_examples=60, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(ops=PIPELINE_OPS)
    def pipeline(ops):
        sock.sendall(encode_frame(Acquire([ns_a], chunk_hashes([0]))))
        (first,) = read_frames(sock, 1)
        held = {first.lease: 1}  # the model: lease -> pins it holds
        next_lease = first.lease + 1  # no other session acquires meanwhile
        frames, expected = [], []
        for kind, arg in ops:
            if kind == "acquire":
                frames.append(Acquire([ns_a, ns_b], chunk_hashes(range(arg))))
                expected.append((next_lease, 2 * arg))
                held[next_lease] = 2 * arg
                next_lease += 1
            elif kind == "release":
                resolve = {"recent": lambda k: next_lease - 1 - k,
                           "future": lambda k: next_lease + k,
                           "foreign": lambda _: foreign, "raw": lambda n: n}
                leases = [resolve[how](n) for how, n in arg]
                frames.append(Release(leases))
                if any(not 0 <= x <= MAX_WIRE_INT for x in leases):  # the decoder refuses
                    totals["undecodable"] += 1
                elif len(set(leases)) != len(leases) or any(x not in held for x in leases):
                    totals["refused"] += 1
                else:
                    totals["freed"] += len(leases)
                    for lease in leases:
                        del held[lease]
            else:
                frames.append(Ping())
                expected.append("ok")
        frames.append(Ping())
        expected.append("ok")
        sock.sendall(b"".join(encode_frame(f) for f in frames))
        for reply, want in zip(read_frames(sock, len(expected)), expected, strict=True):
            if want == "ok":
                assert isinstance(reply, Ok), reply
            else:
                assert isinstance(reply, BlocksReply) and reply.lease == want[0], reply
                assert len(reply.block_ids) == want[1]
        assert session_pins() == sum(held.values())
        sock.sendall(encode_frame(Release(list(held))) + encode_frame(Ping()))
        assert isinstance(read_frames(sock, 1)[0], Ok)
        assert session_pins() == 0

    pipeline()
    blocks = owner.request(Info("blocks")).sections["blocks"]
    assert blocks["pinned_blocks"] == 1  # the owner's own lease only
    stats = owner.request(Info("stats")).sections["stats"]
    assert stats.get("errors_not_owner", 0) == totals["refused"]
    assert stats.get("errors_bad_request", 0) == totals["undecodable"]
    assert totals["refused"] > 0 and totals["freed"] > 0 and totals["undecodable"] > 0
    sock.settimeout(0.3)
    with pytest.raises(TimeoutError):
        sock.recv(1)  # and nothing more came
    sock.close()
    owner.close()
    assert daemon.proc.poll() is None


# ------------------------------------------------ the new request fields, on a real daemon
def test_fuzzed_parents_tenants_bounds_and_blend_parameters_leave_the_daemon_clean():
    """tests/fuzz_frames.py at test size: 1,500 hostile frames (chain parents, tenant
    fingerprints, every integer at its edges, leases and blocks really held) from three
    sessions of a real daemon over a disk tier, and 150 vLLM requests with random
    `lmcached_blend` parameters through the blend scheduler: no internal error, no
    exception, and once the sessions close nothing pinned or being written (INFO)."""
    import fuzz_frames

    result = fuzz_frames.run(num_frames=1_500, num_blend=150, seed=3)
    assert fuzz_frames.ok(result), result
    assert result["frames"]["frames"] == 1_500 and result["exit_status"] == 0
    assert {"bad_request", "bad_namespace"} <= set(result["frames"]["codes"])
    assert result["blend"]["refusals"]["bad_params"] > 0 and result["blend"]["claimed"] > 0
    assert result["tenants_tracked"] <= 4 * MAX_TENANTS_PER_SESSION  # 3 raw, 1 blend session
