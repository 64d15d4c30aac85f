"""Fuzzing the daemon's frame handling in process: no frame crashes it or breaks the pool.

Every frame goes through `lmcached.connection.answer_frame`, the daemon's one entry point
from bytes to reply, over a real `CacheService` and arena. The frames are well-formed
requests of every type (seeded with chunks that are really stored, pinned and being
written), then mutated: wrong types, huge integers, nested containers, unknown tags,
invalid UTF-8, truncation, byte flips. After every batch the block pool's invariants
hold; after every session ended, nothing is pinned or being written.
"""

import random

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcached.config import ServerConfig
from lmcached.protocol import (
    PROTOCOL_VERSION,
    Alloc,
    AllocReply,
    Commit,
    Error,
    Hello,
    InfoReply,
    Layout,
    Lookup,
    Ok,
    Ping,
    encode_frame,
    reply_decoder,
)
from lmcached.connection import answer_frame
from lmcached.service import CacheService
from lmcached.shm.arena import Arena

LAYOUT = Layout("tiny-llama", 1, 0, "vllm", "bfloat16", 2, 2, 4, 16, 1000)
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
    session = service.open_session(1, 0, 0)
    frame, _ = answer_frame(service, session, _MSGPACK.encode(
        Hello(PROTOCOL_VERSION, 1, name, LAYOUT)))
    reply = reply_decoder.decode(frame[4:])
    assert reply.ns == 1
    return session


def request(service, session, message):
    frame, _ = answer_frame(service, session, _MSGPACK.encode(message))
    return reply_decoder.decode(frame[4:])


def seed_requests(ns: int, rng: random.Random) -> list[list]:
    """Well-formed requests of every type, as the lists msgspec encodes them to."""
    ids = [rng.randrange(40) for _ in range(rng.randrange(1, 6))]
    block_ids = [rng.randrange(-2, 140) for _ in range(rng.randrange(0, 5))]
    return [
        ["hello", PROTOCOL_VERSION, 7, "fuzz", list(msgspec.structs.astuple(LAYOUT))],
        ["hello", PROTOCOL_VERSION, 7, "fuzz", None],
        ["lookup", ns, chunk_hashes(ids)],
        ["acquire", ns, chunk_hashes(ids)],
        ["release", block_ids],
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
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(rng=st.randoms(use_true_random=False))
def _fuzz_batch(service, stats, rng):
    sessions = [greet(service, "writer"), service.open_session(2, 0, 0)]
    # Real state to fuzz against: stored chunks, a pinned prefix, values being written.
    alloc = request(service, sessions[0], Alloc(1, chunk_hashes(range(8)), [1000] * 8))
    assert isinstance(alloc, AllocReply)
    if alloc.block_ids:
        request(service, sessions[0], Commit(alloc.block_ids))
    pinned_before = service.pool.num_pinned_blocks
    try:
        for _ in range(FRAMES_PER_BATCH):
            session = rng.choice(sessions)
            payload = mutate(rng.choice(seed_requests(1, rng)), rng)
            frame, cost = answer_frame(service, session, payload)
            reply = reply_decoder.decode(frame[4:])  # always a well-formed reply frame
            assert cost >= 1
            stats["frames"] += 1
            stats["errors"] += isinstance(reply, Error)
            if isinstance(reply, Error):
                stats["codes"].add(reply.code)
            stats["max_pinned"] = max(stats["max_pinned"], service.pool.num_pinned_blocks)
            stats["max_writing"] = max(stats["max_writing"], service.pool.num_writing_blocks)
        service.pool.check_invariants()
    finally:  # a failing example must not leave its sessions to the next one
        for session in sessions:
            service.close_session(session)
    assert pinned_before == 0
    service.pool.check_invariants()
    assert service.pool.num_pinned_blocks == 0, "a session left pins behind"
    assert service.pool.num_writing_blocks == 0, "a session left WRITING blocks behind"
    service.stop_requested = False  # a fuzzed SHUTDOWN is harmless in process


@pytest.mark.slow
def test_twenty_thousand_mutated_frames_never_crash_or_leak(service):
    stats = {"frames": 0, "errors": 0, "codes": set(), "max_pinned": 0, "max_writing": 0}
    _fuzz_batch(service, stats)
    assert stats["frames"] >= NUM_BATCHES * FRAMES_PER_BATCH
    assert "bad_request" in stats["codes"]
    # The fuzz really exercised pins and writes, so the leak checks above mean something.
    assert stats["max_pinned"] > 0 and stats["max_writing"] > 0
    assert service.sessions == {}
    print(f"fuzzed {stats['frames']} frames: {stats['errors']} error replies "
          f"({sorted(stats['codes'])}), 0 crashes, 0 leaked blocks")


def test_invalid_utf8_str_is_a_bad_request_not_a_crash(service):
    session = service.open_session(1, 0, 0)
    frame, _ = answer_frame(service, session, b"\x91\xa2\xff\xfe")
    reply = reply_decoder.decode(frame[4:])
    assert isinstance(reply, Error) and reply.code == "bad_request"
    assert "UnicodeDecodeError" in reply.message


def test_handler_bug_answers_internal_and_service_serves_on(service, monkeypatch, caplog):
    session = greet(service, "w")

    def broken(session, req):
        raise ZeroDivisionError("a bug")

    monkeypatch.setitem(service._handlers, Lookup, broken)
    reply = request(service, session, Lookup(1, chunk_hashes([1])))
    assert isinstance(reply, Error) and reply.code == "internal"
    assert "ZeroDivisionError" in caplog.text  # logged with its traceback
    assert isinstance(request(service, session, Ping()), Ok)


def test_unencodable_reply_answers_internal(service, monkeypatch, caplog):
    session = service.open_session(1, 0, 0)
    monkeypatch.setitem(service._handlers, Ping,
                        lambda s, r: InfoReply({"x": {"y": object()}}))
    frame, _ = answer_frame(service, session, _MSGPACK.encode(["ping"]))
    reply = reply_decoder.decode(frame[4:])
    assert isinstance(reply, Error) and reply.code == "internal"
    assert encode_frame(reply)  # and it is itself a valid frame
