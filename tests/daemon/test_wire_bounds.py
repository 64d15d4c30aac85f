"""Every integer a client sends is bounded where it is parsed (lmcached/wire/protocol.py).

Hand-built frames (tests/raw_frames.py) put each integer field of every request at the
edges msgpack can carry (2**63, 2**64 - 1, -1, -2**63) on a real daemon: each one is
refused by the decoder as `bad_request` (a HELLO's version as `version`), counted in
INFO (`errors_bad_request`), or, for the requests that have no reply (RELEASE,
INVALIDATE), counted and unanswered; never an internal error, and the daemon serves
on with nothing pinned or being written. (2**64 and beyond have no msgpack encoding:
msgspec refuses to write them, and no byte sequence decodes to one.)
"""

import msgspec
import pytest

from conftest import is_release_frame
from raw_frames import connect, pending_bytes, recv_reply, send_payload
from lmcached.wire.connection import Connection
from lmcached.wire.protocol import PROTOCOL_VERSION, Error, Info, Ok

HUGE = [2**63, 2**64 - 1, -1, -(2**63)]
H = bytes(range(16)) * 2  # two chunk hashes
LAYOUT = {"model_name": "bounds-test", "world_size": 1, "worker_id": 0, "fmt": "vllm",
          "dtype": "bfloat16", "num_layers": 2, "num_kv_heads": 2, "head_size": 4,
          "chunk_size": 16, "record_bytes": 1000}

# Each request as the list msgspec encodes it to, with the positions of its integers
# (an int field, or element 0 of a list of ints).
REQUESTS = [
    (["hello", PROTOCOL_VERSION, 7, "x", [LAYOUT]], [1, 2]),
    (["lookup", [1], H, b"", b""], [(1, 0)]),
    (["acquire", [1], H, b"", False, b""], [(1, 0)]),
    (["release", [1]], [(1, 0)]),
    (["alloc", 1, H, [1000, 1000], 0], [1, (3, 0), 4]),
    (["commit", [1]], [(1, 0)]),
    (["abort", [1]], [(1, 0)]),
    (["put", 1, "k", 10], [1, 3]),
    (["get", 1, "k"], [1]),
    (["delete", 1, "k"], [1]),
    (["scan", 1, "k", 5, 0, 0], [1, 3, 4, 5]),
    (["clients", 0, 0], [1, 2]),
    (["evict", 1, None], [1]),
    (["open_tier", 1], [1]),
    (["invalidate", 1, H, [1, 2]], [1, (3, 0)]),
]
LAYOUT_INTS = [key for key, value in LAYOUT.items() if isinstance(value, int)]


def with_value(message: list, where, value) -> list:
    message = [list(x) if isinstance(x, list) else x for x in message]  # a copy
    if isinstance(where, tuple):
        message[where[0]][where[1]] = value
    else:
        message[where] = value
    return message


def hostile_frames():
    for message, positions in REQUESTS:
        for where in positions:
            for value in HUGE:
                yield f"{message[0]}[{where}]={value}", with_value(message, where, value)
    for i in LAYOUT_INTS:
        for value in HUGE:
            layout = {**LAYOUT, i: value}
            yield f"layout.{i}={value}", ["hello", PROTOCOL_VERSION, 7, "x", [layout]]


def test_two_to_the_64_has_no_msgpack_encoding():
    with pytest.raises(OverflowError):
        msgspec.msgpack.encode(2**64)


def test_every_integer_field_out_of_range_is_a_counted_bad_request(daemon):
    sock = connect(daemon.socket)
    send_payload(sock, msgspec.msgpack.encode(["hello", PROTOCOL_VERSION, 7, "b", [LAYOUT]]))
    assert recv_reply(sock).namespaces == [1]
    num_unanswered, num_refused = 0, 0
    for label, message in hostile_frames():
        payload = msgspec.msgpack.encode(message)
        send_payload(sock, payload)
        if is_release_frame(payload):
            num_unanswered += 1
            send_payload(sock, msgspec.msgpack.encode(["ping"]))
            assert isinstance(recv_reply(sock), Ok), label  # and nothing before it
            continue
        reply = recv_reply(sock)
        expected = "version" if label.startswith("hello[1]") else "bad_request"
        assert isinstance(reply, Error) and reply.code == expected, (label, reply)
        assert "ValidationError" in reply.message or expected == "version", (label, reply)
        num_refused += 1
    assert pending_bytes(sock) == b""
    with Connection(daemon.socket) as conn:
        stats = conn.request(Info("stats")).sections["stats"]
        blocks = conn.request(Info("blocks")).sections["blocks"]
    assert stats.get("errors_internal", 0) == 0
    num_version = len(HUGE)
    assert stats["errors_bad_request"] == num_refused - num_version + num_unanswered
    assert blocks["pinned_blocks"] == 0 and blocks["writing_blocks"] == 0
    assert daemon.proc.poll() is None
    sock.close()
