"""Fuzz a real daemon over the request fields a client chooses; report what INFO says after.

Why this file exists: the daemon must answer every frame a client can send with a reply
or a counted refusal, never an internal error, and leave nothing pinned or being written
once the clients are gone, whatever the client puts in the fields it chooses: chain
`parent` hashes and ALLOC's `parents` (right, wrong, of the wrong length), tenant
fingerprints (real, made up, of the wrong length, far more than the table holds), event
feed subscriptions and polls (any namespaces, cursors, page sizes, snapshots), every integer at the edges
msgpack can carry (2**63, 2**64 - 1, -1, -2**63, one past each bound), leases and block
ids really held or not. CacheBlend's request parameters (`lmcached_blend`) go through
the vLLM scheduler side's own parse path (`BlendScheduler.get_num_new_matched_tokens`,
client/vllm/blend_scheduler.py) against the same daemon: none may raise.

It starts its own daemon (a small arena over a disk tier, so that short lookups fetch
from disk and verify against the fuzzed `parent`), sends the frames from several
sessions on raw sockets (tests/raw_frames.py), closes them, and checks through INFO:
daemon alive, pinned_blocks 0, writing_blocks 0, errors_internal 0. Exit status 0 when
all hold. Run from the repository root::

    .venv/bin/python tests/fuzz_frames.py --frames 20000 --blend-requests 2000

tests/daemon/test_frame_fuzz.py runs a small version of it as a test.
"""

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
import types

import msgspec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from raw_frames import connect, recv_reply, send_payload  # noqa: E402
from lmcached import launcher  # noqa: E402
from lmcached.wire.connection import Connection  # noqa: E402
from lmcached.wire.protocol import (  # noqa: E402
    MAX_TIERS,
    MAX_WIRE_INT,
    PROTOCOL_VERSION,
    TIER_SHIFT,
    AllocReply,
    BlocksReply,
    Error,
    Hello,
    Info,
    Layout,
    Request,
)

RANKS = [{"model_name": "fuzz-frames", "world_size": 2, "worker_id": rank, "fmt": "vllm",
          "dtype": "bfloat16", "num_layers": 2, "num_kv_heads": 1, "head_size": 4,
          "chunk_size": 16, "record_bytes": 1000} for rank in (0, 1)]
EDGE_INTS = [2**63, 2**64 - 1, -1, -(2**63), MAX_WIRE_INT, 2**32, 2**31, 0, 1,
             MAX_TIERS << TIER_SHIFT, (MAX_TIERS << TIER_SHIFT) - 1]
NO_REPLY_TAGS = ("release", "invalidate")
_ENCODE = msgspec.msgpack.Encoder().encode


def chunk_hashes(ids) -> bytes:
    return b"".join(i.to_bytes(16, "little") for i in ids)


class Fuzzer:
    """Builds one hostile frame at a time from what the daemon really handed out."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.leases: list[int] = []
        self.block_ids: list[int] = []
        self.tenants = [rng.randbytes(8) for _ in range(4)]  # "real" tenants, reused

    def integer(self, usual: int) -> int:
        return self.rng.choice(EDGE_INTS) if self.rng.random() < 0.3 else usual

    def tenant(self) -> bytes:
        rng = self.rng
        return rng.choice([b"", rng.choice(self.tenants), rng.randbytes(8), rng.randbytes(8),
                           rng.randbytes(rng.choice([1, 7, 9, 16]))])

    def parent(self, first: int) -> bytes:
        rng = self.rng
        return rng.choice([b"", chunk_hashes([first - 1]) if first else b"",
                           chunk_hashes([rng.randrange(64)]), rng.randbytes(16),
                           rng.randbytes(rng.choice([1, 15, 17]))])

    def parents(self, first: int, n: int) -> bytes:
        """ALLOC's `parents`: the chain's (ROOT_HASH for chunk 0), made up, empty, or of
        a wrong length."""
        rng = self.rng
        chain = b"".join(chunk_hashes([i - 1]) if i else b"\0" * 16
                         for i in range(first, first + n))
        return rng.choice([b"", chain, chain, rng.randbytes(16 * n),
                           rng.randbytes(max(0, 16 * n + rng.choice([-16, -1, 1, 16])))])

    def namespaces(self) -> list[int]:
        rng = self.rng
        return rng.choice([[1], [2], [1, 2], [2, 1], [1, 1], [], [self.integer(3)]])

    def hashes(self) -> tuple[int, bytes]:
        first = self.rng.randrange(48)
        ids = range(first, first + self.rng.randrange(1, 6))
        raw = chunk_hashes(ids)
        if self.rng.random() < 0.05:
            raw = raw[:-self.rng.randrange(1, 16)]
        return first, raw

    def message(self) -> list:
        rng = self.rng
        first, hashes = self.hashes()
        held = rng.choice(self.leases) if self.leases else 1
        block = rng.choice(self.block_ids) if self.block_ids else 1
        kind = rng.randrange(14)
        if kind < 3:
            return ["lookup", self.namespaces(), hashes, self.parent(first), self.tenant()]
        if kind < 6:
            return ["acquire", self.namespaces(), hashes, self.parent(first),
                    rng.random() < 0.5, self.tenant()]
        if kind == 6:
            return ["release", [self.integer(held) for _ in range(rng.randrange(0, 3))]]
        if kind == 7:
            n = len(hashes) // 16
            alloc = ["alloc", self.integer(rng.choice([1, 2])), hashes,
                     [self.integer(1000) for _ in range(n)], self.integer(0)]
            return alloc if rng.random() < 0.3 else alloc + [self.parents(first, n)]
        if kind == 8:
            return [rng.choice(["commit", "abort"]),
                    [self.integer(block) for _ in range(rng.randrange(0, 3))]]
        if kind == 9:
            return ["invalidate", self.integer(1), hashes,
                    [self.integer(block) for _ in range(len(hashes) // 16)]]
        if kind == 10:
            return rng.choice([["scan", self.integer(3), "k", self.integer(5),
                                self.integer(0), self.integer(0)],
                               ["clients", self.integer(0), self.integer(0)],
                               ["put", self.integer(3), "k", self.integer(100)],
                               ["get", self.integer(3), "k"]])
        if kind == 12:
            return ["subscribe", self.namespaces(), self.integer(rng.choice([0, 1, 10**6])),
                    rng.random() < 0.5]
        if kind == 13:
            return ["events", self.integer(rng.choice([0, 1, 10**6])),
                    self.integer(rng.choice([0, 1, 4096, 5000])), rng.random() < 0.5]
        return ["hello", self.integer(PROTOCOL_VERSION), self.integer(1), "again", RANKS]

    def note(self, reply) -> None:
        """Remember leases and blocks handed out, for later frames to use."""
        if isinstance(reply, BlocksReply) and reply.lease:
            self.leases = (self.leases + [reply.lease])[-16:]
        if isinstance(reply, (BlocksReply, AllocReply)) and reply.block_ids:
            self.block_ids = (self.block_ids + list(reply.block_ids))[-32:]


def hello_socket(path: str, name: str):
    sock = connect(path, timeout_s=30)
    send_payload(sock, _ENCODE(["hello", PROTOCOL_VERSION, os.getpid(), name, RANKS]))
    reply = recv_reply(sock)
    assert getattr(reply, "namespaces", None) == [1, 2], reply
    return sock


def _hello() -> Hello:
    return Hello(PROTOCOL_VERSION, os.getpid(), "seed", [Layout(**rank) for rank in RANKS])


def _decode(message: list):
    """A request Struct from its msgpack list form."""
    return msgspec.msgpack.decode(_ENCODE(message), type=Request)


def fuzz_frames(path: str, num_frames: int, rng: random.Random, num_sessions: int = 3) -> dict:
    """Send `num_frames` hostile frames over `num_sessions` sessions; the counts seen."""
    fuzzer = Fuzzer(rng)
    sockets = [hello_socket(path, f"fuzz-{i}") for i in range(num_sessions)]
    counts = {"frames": 0, "error_replies": 0, "unanswered": 0, "codes": {}}
    for _ in range(num_frames):
        sock = rng.choice(sockets)
        message = fuzzer.message()
        send_payload(sock, _ENCODE(message))
        counts["frames"] += 1
        if message[0] in NO_REPLY_TAGS:
            counts["unanswered"] += 1
            continue
        reply = recv_reply(sock)
        fuzzer.note(reply)
        if isinstance(reply, Error):
            counts["error_replies"] += 1
            counts["codes"][reply.code] = counts["codes"].get(reply.code, 0) + 1
            if reply.code == "internal":
                raise AssertionError(f"internal error for {message!r}")
    for sock in sockets:
        sock.close()
    return counts


BLEND_HOSTILE = [2**31, 2**63, 2**64, 10**30, -1, -(2**63), 1.5, float("nan"), float("inf"),
                 "99", None, True, [99], {"a": 1}, "epic"]
BLEND_VALID = {"separator": [99, 7, 2**31 - 1], "strategy": ["cacheblend", "legolink"],
               "recompute_ratio": [0, 0.15, 1, 1.0], "legolink_k": [0, 16, 1 << 20]}


def fuzz_blend_params(path: str, num_requests: int, rng: random.Random) -> dict:
    """`num_requests` vLLM requests with random `lmcached_blend` parameters through the
    blend scheduler's parse and claim path (LOOKUPs with the request's tenant) against
    the daemon; none may raise. Returns the scheduler's counters."""
    from lmcached.client.layout import KVLayout
    from lmcached.client.vllm.blend_scheduler import BlendScheduler
    from lmcached.client.serving.specs import ConnectorSettings

    layout = KVLayout("fuzz-blend", num_layers=2, num_kv_heads=1, head_size=8,
                      dtype="float32", chunk_size=8, fmt="vllm")
    settings = ConnectorSettings(layouts=[layout], chunk_size=8, block_size=4, world_size=1,
                                 socket=path, daemon_name="unused", timeout_s=5.0)
    import torch

    from lmcached.client import CacheEngine

    documents = [[5, 6, 7, 99], [11, 12, 13, 14, 15, 99], [21, 22, 99]]
    with CacheEngine.connect(layout, path, strict=True) as engine:  # cached documents
        for salt in ("alice", "bob"):
            for doc in documents[:2]:
                engine.store(doc, torch.randn(2, 2, len(doc), 1, 8), cache_salt=salt)
    scheduler = BlendScheduler(settings, layout, tokens_per_step=64)
    keys = ["separator", "strategy", "recompute_ratio", "legolink_k"]
    for i in range(num_requests):
        params = {"separator": 99}
        for key in rng.sample(keys, rng.randrange(0, 4)):
            hostile = rng.random() < 0.3
            params[key] = rng.choice(BLEND_HOSTILE if hostile else BLEND_VALID[key])
        if rng.random() < 0.05:
            params["typo"] = 1
        if rng.random() < 0.5:  # documents, some cached, then a question
            tokens = [t for doc in rng.sample(documents, rng.randrange(1, 4)) for t in doc]
            tokens += [rng.randrange(100, 200) for _ in range(rng.randrange(1, 6))]
        else:
            tokens = [rng.randrange(1, 200) for _ in range(rng.randrange(1, 40))]
            tokens[rng.randrange(len(tokens))] = 99
        request = types.SimpleNamespace(
            request_id=f"b{i}", prompt_token_ids=tokens, lora_request=None,
            mm_features=None, cache_salt=rng.choice([None, "alice", "bob", f"s{i}"]),
            kv_transfer_params={"lmcached_blend": params}, num_computed_tokens=0)
        handled, claim = scheduler.get_num_new_matched_tokens(request, rng.choice([0, 4]))
        if handled:
            blocks = types.SimpleNamespace(get_block_ids=lambda n=len(tokens): (
                list(range(-(-n // 4))),))
            scheduler.update_state_after_alloc(request, blocks, claim or 0)
            scheduler.build_step(types.SimpleNamespace(
                num_scheduled_tokens={request.request_id: len(tokens)}))
        scheduler.request_finished(request)
    counters = {"requests": num_requests, "refusals": dict(scheduler.refusals),
                "claimed": scheduler.num_claimed_requests,
                "store_only": scheduler.num_store_only_requests}
    scheduler.shutdown()
    return counters


def final_state(path: str) -> dict:
    """INFO fields the run is judged by, once every fuzzing session has closed (a
    session's close is handled on the daemon's next loop passes: wait for it)."""
    deadline = time.monotonic() + 10
    while True:
        with Connection(path) as conn:
            sections = conn.request(Info()).sections
        fields = {k: v for section in sections.values() for k, v in section.items()}
        if fields["connected_clients"] <= 1 or time.monotonic() > deadline:
            return fields
        time.sleep(0.05)


def run(num_frames: int, num_blend: int, seed: int, disk: bool = True) -> dict:
    """Start a daemon, fuzz it, stop it; the figures of the run."""
    workdir = tempfile.mkdtemp(prefix="lmc-fuzz-", dir="/tmp")
    path = os.path.join(workdir, "d.sock")
    args = ["--capacity", "2MiB", "--block-size", "64KiB"]
    if disk:
        os.mkdir(os.path.join(workdir, "disk"), 0o700)
        args += ["--disk-path", os.path.join(workdir, "disk"), "--disk-capacity", "8MiB"]
    proc = launcher.start_daemon(f"fuzz{os.getpid()}", path, *args,
                                 log_path=os.path.join(workdir, "d.log"), timeout_s=60)
    try:
        rng = random.Random(seed)
        with Connection(path) as conn:
            conn.request(_hello())
            for ns in (1, 2):
                alloc = conn.request(_decode(["alloc", ns, chunk_hashes(range(48)),
                                              [1000] * 48, 0]))
                conn.request(_decode(["commit", alloc.block_ids]))
        started = time.perf_counter()
        frames = fuzz_frames(path, num_frames, rng)
        blend = fuzz_blend_params(path, num_blend, rng) if num_blend else {}
        elapsed_s = time.perf_counter() - started
        fields = final_state(path)
        alive = proc.poll() is None
    finally:
        status = launcher.stop_daemon(proc)
        log_tail = open(os.path.join(workdir, "d.log"), errors="replace").read()[-2000:]
        shutil.rmtree(workdir, ignore_errors=True)
    return {"frames": frames, "blend": blend, "elapsed_s": round(elapsed_s, 2),
            "alive": alive, "exit_status": status,
            "pinned_blocks": fields["pinned_blocks"], "writing_blocks": fields["writing_blocks"],
            "errors_internal": fields.get("errors_internal", 0),
            "errors": {k: v for k, v in fields.items() if k.startswith("errors_")},
            "tenants_tracked": fields["tenants_tracked"], "requests": fields.get("requests"),
            "disk": {k: v for k, v in fields.items() if k.startswith("disk_")
                     and isinstance(v, int) and v and k != "disk_enabled"},
            "log_tail": log_tail if "Traceback" in log_tail else ""}


def ok(result: dict) -> bool:
    """The run's verdict: alive, nothing pinned or being written, no internal error."""
    return (result["alive"] and result["pinned_blocks"] == 0 and result["writing_blocks"] == 0
            and result["errors_internal"] == 0 and not result["log_tail"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=20_000)
    parser.add_argument("--blend-requests", type=int, default=2_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-disk", action="store_true", help="no disk tier under the arena")
    args = parser.parse_args()
    result = run(args.frames, args.blend_requests, args.seed, disk=not args.no_disk)
    for key, value in result.items():
        print(f"{key}: {value}")
    print("verdict:", "PASS" if ok(result) else "FAIL")
    return 0 if ok(result) else 1


if __name__ == "__main__":
    sys.exit(main())
