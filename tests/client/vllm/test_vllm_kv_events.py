"""KV events through vLLM's `take_events()` hook (docs/kv-events.md): an instance announces,
in its own block hashes, the chunks another instance stored in the daemon, and their
removal after a CLEAR, never `AllBlocksCleared`."""

import json
import os
import subprocess
import sys
import time

import msgspec
import numpy as np
import pytest
import torch

from conftest import start_daemon
from test_vllm_connector import (
    BLOCK,
    CHUNK,
    E2E_SCRIPT,
    E2E_TIMEOUT_S,
    Engine,
    create_kv_cache_config,
    create_vllm_config,
    engine_factory,  # noqa: F401 (a fixture)
    model_dir,  # noqa: F401 (a fixture)
    prompt_of,
    run_instance,
    store_from_another_instance,
)

pytestmark = pytest.mark.vllm

from vllm.config import KVEventsConfig  # noqa: E402
from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.request import Request  # noqa: E402
from vllm import SamplingParams  # noqa: E402

from lmcached.client import CacheEngine, KVLayout  # noqa: E402
from lmcached.client.vllm.connector import LMCachedConnector  # noqa: E402
from lmcached.wire.connection import Connection  # noqa: E402
from lmcached.client.hashing import hash_request_tokens  # noqa: E402
from lmcached.wire.protocol import Clear, Events, Subscribe  # noqa: E402


def events_instance(model_dir: str, socket: str, empty: bool = True) -> LMCachedConnector:
    """A scheduler-side connector of an instance started with --kv-events-config
    (`empty`: the daemon holds nothing yet, so its first step announces nothing)."""
    init_none_hash(sha256)
    vllm_config = create_vllm_config(model_dir, socket, kv_events_interval_s=0)
    vllm_config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True,
                                                  publisher="null")
    connector = LMCachedConnector(vllm_config, KVConnectorRole.SCHEDULER,
                                  create_kv_cache_config())
    assert connector.event_relay is not None
    if empty:
        assert connector.take_events() == []  # subscribes
    return connector


def take_until(connector, predicate, timeout_s: float = 10.0) -> list:
    events = []
    deadline = time.monotonic() + timeout_s
    while not predicate(events):
        assert time.monotonic() < deadline, events
        events.extend(connector.take_events())
        time.sleep(0.01)
    return events


def own_block_hashes(prompt: list[int], cache_salt: str | None = None) -> list:
    """The block hashes vLLM's own prefix cache computes for `prompt` (published form)."""
    params = SamplingParams(max_tokens=1)
    request = Request(request_id="mine", prompt_token_ids=list(prompt), sampling_params=params,
                      pooling_params=None, mm_features=None, cache_salt=cache_salt,
                      block_hasher=get_request_block_hasher(BLOCK, sha256))
    return [maybe_convert_block_hash(h) for h in request.block_hashes]


def test_an_instance_announces_what_another_stored_in_its_own_block_hashes(
        model_dir, engine_factory, daemon):
    listener = events_instance(model_dir, daemon.socket)
    try:
        prompt = prompt_of(100, seed=11)
        store_from_another_instance(engine_factory, prompt)  # 3 full chunks of 32
        stored = take_until(listener, lambda e: len(e) >= 3)
        assert all(isinstance(e, BlockStored) for e in stored)
        assert [e.medium for e in stored] == ["CPU"] * 3
        assert all(e.block_size == BLOCK for e in stored)
        expected = own_block_hashes(prompt)[:3 * CHUNK // BLOCK]
        assert [h for e in stored for h in e.block_hashes] == expected
        assert [t for e in stored for t in e.token_ids] == prompt[:3 * CHUNK]
        assert stored[0].parent_block_hash is None
        assert stored[1].parent_block_hash == stored[0].block_hashes[-1]
        with Connection(daemon.socket) as admin:
            admin.request(Clear())
        removed = take_until(listener, lambda e: len(e) >= 3)
        assert not any(isinstance(e, AllBlocksCleared) for e in removed)
        assert all(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in removed)
        assert sorted(h for e in removed for h in e.block_hashes) == sorted(expected)
        assert listener.event_relay.num_announced_chunks == 0
    finally:
        listener.shutdown()


def test_an_instance_started_after_the_store_announces_what_the_daemon_holds(
        model_dir, engine_factory, daemon):
    """Instance A stored a prompt before instance B started: B's first steps announce
    it (the daemon's snapshot), in B's block hashes, each block once."""
    prompt = prompt_of(100, seed=13)
    store_from_another_instance(engine_factory, prompt)  # 3 full chunks of 32
    listener = events_instance(model_dir, daemon.socket, empty=False)
    try:
        stored = take_until(listener, lambda e: len(e) >= 3)
        expected = own_block_hashes(prompt)[:3 * CHUNK // BLOCK]
        assert [h for e in stored for h in e.block_hashes] == expected
        assert [e.medium for e in stored] == ["CPU"] * 3
        assert stored[0].parent_block_hash is None
        assert listener.take_events() == []  # announced once
        assert listener.event_relay.stats["snapshot"] == 3
    finally:
        listener.shutdown()


def salted_request(prompt: list[int], salt: str, request_id: str) -> Request:
    init_none_hash(sha256)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    params.update_from_generation_config({}, 2)
    return Request(request_id=request_id, prompt_token_ids=list(prompt), sampling_params=params,
                   pooling_params=None, mm_features=None, cache_salt=salt,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def test_a_salted_prompt_is_announced_with_the_salt_as_vllm_folds_it(
        model_dir, engine_factory, daemon):
    """The listener served tenant-a (its lookup noted the salt): tenant-a's chunks are
    announced with the salt in the first block's extra keys and vLLM's salted hashes;
    tenant-b's, whose salt it never saw, are not announced, and counted."""
    listener = events_instance(model_dir, daemon.socket)
    try:
        prompt = prompt_of(64, seed=12)
        listener.get_num_new_matched_tokens(salted_request(prompt, "tenant-a", "seen"), 0)
        first = engine_factory()
        first.scheduler.add_request(salted_request(prompt, "tenant-a", "a"))
        first.run()
        stored = take_until(listener, lambda e: len(e) >= 2)
        assert [h for e in stored for h in e.block_hashes] == own_block_hashes(prompt, "tenant-a")
        assert [h for e in stored for h in e.block_hashes] != own_block_hashes(prompt)
        assert stored[0].extra_keys == [("tenant-a",), None]
        assert stored[1].extra_keys is None
        first.scheduler.add_request(salted_request(prompt, "tenant-b", "b"))
        first.run()
        deadline = time.monotonic() + 10
        while listener.event_relay.stats["unresolved_salt"] < 1:
            assert listener.take_events() == []
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        listener.shutdown()


def test_prompts_stored_in_one_step_are_each_announced(model_dir, engine_factory, daemon):
    """Another instance saves two prompts' chunks in one step (one ALLOC, which names
    each chunk's parent in its own prompt's chain: none for each prompt's first, not the
    other prompt's last): each prompt is announced, in its own block hashes."""
    listener = events_instance(model_dir, daemon.socket)
    try:
        first, second = prompt_of(70, seed=15), prompt_of(70, seed=16)
        engine = engine_factory()
        engine.add(first)
        engine.add(second)
        metas = engine.run()
        assert [len(save.hashes) for meta in metas for save in meta.saves] == [2, 2]
        stored = take_until(listener, lambda e: len(e) >= 4)
        announced = {h for e in stored for h in e.block_hashes}
        assert announced == set(own_block_hashes(first)[:4] + own_block_hashes(second)[:4])
        assert listener.event_relay.stats["unresolved_parent"] == 0
        with Connection(daemon.socket) as watcher:  # the parents the daemon keeps
            cursor = watcher.request(Subscribe([], 0, True)).cursor
            parents = {e.chunk_hash: e.parent for e in watcher.request(Events(cursor)).events}
        a, b = (hash_request_tokens(CHUNK, prompt)[:2] for prompt in (first, second))
        assert parents == {a[0]: b"", a[1]: a[0], b[0]: b"", b[1]: b[0]}
    finally:
        listener.shutdown()


def test_a_chain_saved_over_several_steps_is_announced_whole(model_dir, engine_factory, daemon):
    """Chunked prefill saves a prompt's chunks over two steps: the second step's ALLOC
    names the first step's last chunk as its first chunk's parent, so the relay hashes
    every block of the prompt in the engine's terms."""
    listener = events_instance(model_dir, daemon.socket)
    try:
        prompt = prompt_of(130, seed=21)
        engine = engine_factory(max_num_batched_tokens=64)
        engine.add(prompt)
        metas = engine.run()
        assert [len(save.hashes) for meta in metas for save in meta.saves] == [2, 2]
        stored = take_until(listener, lambda e: len(e) >= 4, timeout_s=3)
        assert [h for e in stored for h in e.block_hashes] == own_block_hashes(prompt)[:8]
    finally:
        listener.shutdown()


# ------------------------------------------------------------------ daemon restart
def test_a_daemon_restart_removes_what_was_announced_and_the_connector_resubscribes(
        model_dir, unique_name, short_tmp):
    """The daemon restarts on the same socket while an instance follows it: the
    connector's next steps remove every block it announced (the new arena holds none of
    them), it subscribes to the new daemon, and a prompt stored there again is
    announced once."""
    socket = os.path.join(short_tmp, "d.sock")
    args = ("--capacity", "64MiB", "--block-size", "1MiB")
    daemon = start_daemon(unique_name, socket, os.path.join(short_tmp, "1.log"), *args)
    listener = events_instance(model_dir, socket)
    engines = []
    try:
        prompt = prompt_of(100, seed=14)
        expected = own_block_hashes(prompt)[:3 * CHUNK // BLOCK]
        engines.append(Engine(model_dir, socket))
        engines[-1].add(prompt)
        engines[-1].run()
        stored = take_until(listener, lambda e: len(e) >= 3)
        assert [h for e in stored for h in e.block_hashes] == expected
        engines.pop().close()
        daemon.stop()
        daemon = start_daemon(unique_name, socket, os.path.join(short_tmp, "2.log"), *args)
        removed = take_until(listener, lambda e: len(e) >= 3, timeout_s=20)
        assert all(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in removed)
        assert sorted(h for e in removed for h in e.block_hashes) == sorted(expected)
        assert listener.event_relay.stats["restarts"] == 1
        assert listener.event_relay.num_announced_chunks == 0
        engines.append(Engine(model_dir, socket))
        engines[-1].add(prompt)
        engines[-1].run()
        again = take_until(listener, lambda e: len(e) >= 3)
        assert all(isinstance(e, BlockStored) for e in again)
        assert [h for e in again for h in e.block_hashes] == expected
        time.sleep(0.1)
        assert listener.take_events() == []  # once, not once per subscription
        assert listener.event_relay.num_announced_chunks == 3
    finally:
        for engine in engines:
            engine.close()
        listener.shutdown()
        daemon.stop()


# ------------------------------------------------------------------ end to end
INSTANCE_SCRIPT = os.path.join(os.path.dirname(__file__), "kv_events_instance.py")
E2E_CHUNK = 256  # the connector's chunk size in both instances (run_instance's default)
E2E_BLOCK = 128  # vLLM's block size on CPU (the namespace's: A's and B's alike)


class EventsInstance:
    """kv_events_instance.py in its own process group: vLLM with the connector and its
    ZMQ publisher connected to `endpoint`."""

    def __init__(self, tmp: str, model: str, socket: str, endpoint: str) -> None:
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   LMCACHED_DATA_TIMEOUT_MS="5000")
        self.log_path = os.path.join(tmp, "b.log")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, INSTANCE_SCRIPT, "--model", model, "--socket", socket,
                 "--endpoint", endpoint, "--chunk-size", str(E2E_CHUNK)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                env=env, start_new_session=True)
        self.stdout_path = os.path.join(tmp, "b.out")
        assert self.read() == {"ready": True}

    def read(self) -> dict:
        """The instance's next answer; its other stdout lines (vLLM's log) go to b.out."""
        with open(self.stdout_path, "a") as out:
            for line in self.proc.stdout:
                if line.startswith("RESULT "):
                    return json.loads(line[len("RESULT "):])
                out.write(line)
        raise AssertionError(f"instance B exited with {self.proc.wait()}:\n{self.tail()}")

    def tail(self) -> str:
        with open(self.stdout_path, errors="replace") as out, open(self.log_path) as log:
            return out.read()[-3000:] + log.read()[-3000:]

    def generate(self, prompts: list[dict], max_tokens: int = 1) -> list[int]:
        """Run `prompts`; their num_cached_tokens."""
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self.read()["num_cached_tokens"]

    def relay_stats(self) -> dict:
        """The counters of the instance's connector's event relay (EventRelay.stats)."""
        self.proc.stdin.write(json.dumps({"relay_stats": True}) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def quit(self) -> int:
        self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
        self.proc.stdin.flush()
        assert self.read() == {"quit": True}
        return self.proc.wait(timeout=60)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()


class Subscriber:
    """A router's view: a SUB socket bound on loopback, decoding vLLM's `KVEventBatch`."""

    def __init__(self) -> None:
        import zmq

        self.zmq = zmq
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        self.sub.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list = []  # every event received, in order

    def receive(self, timeout_s: float = 0.05) -> list:
        """The events of the batches that arrive within `timeout_s`, appended to `events`."""
        new = []
        while self.sub.poll(int(timeout_s * 1000)):
            topic, _seq, payload = self.sub.recv_multipart()
            assert topic == b"kv-events"
            new.extend(self.decoder.decode(payload).events)
        self.events.extend(new)
        return new

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


def summary(events) -> list[tuple]:
    """(type, medium, number of blocks, first token) of each event, for failure messages."""
    return [(type(e).__name__, getattr(e, "medium", None), len(getattr(e, "block_hashes", ())),
             (getattr(e, "token_ids", None) or [None])[0]) for e in events]


def block_tokens(event) -> list[tuple]:
    """A BlockStored event's (block hash, its block's token ids) pairs."""
    bs = event.block_size
    return [(h, tuple(event.token_ids[i * bs:(i + 1) * bs]))
            for i, h in enumerate(event.block_hashes)]


def blocks_of(events, prompt: list[int], medium: str) -> list:
    """The block hashes of `medium`'s BlockStored events that cover `prompt`'s full
    blocks, in the prompt's block order (each block once)."""
    wanted = {tuple(prompt[i:i + E2E_BLOCK]): i // E2E_BLOCK
              for i in range(0, len(prompt) - E2E_BLOCK + 1, E2E_BLOCK)}
    found = {}
    for event in events:
        if isinstance(event, BlockStored) and event.medium == medium:
            for h, tokens in block_tokens(event):
                if tokens in wanted:
                    found.setdefault(wanted[tokens], h)
    return [found.get(i) for i in range(len(wanted))]


def step_until(instance: EventsInstance, subscriber: Subscriber, done, timeout_s: float = 60,
               num_tokens: int = 8, **request) -> None:
    """Drive the instance with small unrelated requests (by default under one block: no
    GPU events of their own) until `done(subscriber.events)`: vLLM collects a connector's
    events at the end of each engine step, so an idle instance publishes nothing."""
    rng = np.random.default_rng(num_tokens)
    deadline = time.monotonic() + timeout_s
    while not done(subscriber.events):
        assert time.monotonic() < deadline, (
            f"events {summary(subscriber.events)}\nrelay stats {instance.relay_stats()}\n"
            f"{instance.tail()}")
        prompt = rng.integers(3, 1000, num_tokens).tolist()
        instance.generate([{"prompt_token_ids": prompt, **request}])
        subscriber.receive()


@pytest.mark.slow
@pytest.mark.timeout(2 * E2E_TIMEOUT_S + 60)
def test_an_instance_publishes_over_zmq_what_another_stored_in_its_own_block_hashes(
        daemon_factory, tmp_path):
    """Instance A stores an unsalted and a salted prompt; instance B (started with
    --kv-events-config, ZMQ) publishes them as BlockStored on "CPU", decoded by vLLM's
    KVEventBatch, with the prompts' token ids and the block hashes B's own prefix cache
    emits ("GPU") when B runs them; another namespace's chunks are not published;
    `lmcached clear` makes B publish the matching BlockRemoved."""
    tmp = str(tmp_path)
    model = os.path.join(tmp, "model")
    subprocess.run([sys.executable, E2E_SCRIPT, "build-model", model], check=True,
                   timeout=E2E_TIMEOUT_S, capture_output=True)
    rng = np.random.default_rng(7)
    plain = rng.integers(3, 1000, 2 * E2E_CHUNK + 8).tolist()  # 2 full chunks
    salted = rng.integers(3, 1000, 2 * E2E_CHUNK + 8).tolist()
    other = rng.integers(3, 1000, 64).tolist()
    num_blocks = 2 * E2E_CHUNK // E2E_BLOCK
    daemon = daemon_factory("--capacity", "256MiB")
    subscriber = Subscriber()
    b = None
    try:
        b = EventsInstance(tmp, model, daemon.socket, subscriber.endpoint)
        # A PUB socket drops what it sends before it has read the subscription (ZMQ's
        # slow joiner): B serves requests of one block until one of its events arrives.
        # They are tenant-a's: the daemon never learns salts, B's lookups do.
        step_until(b, subscriber, lambda events: events, num_tokens=E2E_BLOCK,
                   cache_salt="tenant-a")
        a = run_instance(tmp, "a", model, [plain, {"prompt_token_ids": salted,
                                                   "cache_salt": "tenant-a"}], daemon.socket)
        assert a["num_cached_tokens"] == [0, 0]
        store_in_another_namespace(daemon.socket, other)
        assert daemon.info()["stores"] == 2 * 2 + 2

        def announced(events):
            return None not in blocks_of(events, plain[:2 * E2E_CHUNK], "CPU") + blocks_of(
                events, salted[:2 * E2E_CHUNK], "CPU")
        step_until(b, subscriber, announced)
        cpu = [e for e in subscriber.events if getattr(e, "medium", None) == "CPU"]
        assert all(isinstance(e, BlockStored) for e in cpu)
        assert all(e.block_size == E2E_BLOCK and e.locality == "LOCAL" for e in cpu)
        # Every CPU block is one of A's prompts' (none of the other namespace's), once.
        tokens = [t for e in cpu for t in e.token_ids]
        assert sorted(tokens) == sorted(plain[:2 * E2E_CHUNK] + salted[:2 * E2E_CHUNK])
        plain_cpu = blocks_of(cpu, plain, "CPU")[:num_blocks]
        salted_cpu = blocks_of(cpu, salted, "CPU")[:num_blocks]
        salted_first = next(e for e in cpu if e.block_hashes[0] == salted_cpu[0])
        assert salted_first.extra_keys[0] == ("tenant-a",)
        assert salted_first.parent_block_hash is None

        # B runs the same prompts: its prefix cache emits GPU events for the same blocks.
        assert b.generate([{"prompt_token_ids": plain}]) == [2 * E2E_CHUNK]
        assert b.generate([{"prompt_token_ids": salted, "cache_salt": "tenant-a"}]) == [
            2 * E2E_CHUNK]

        def emitted(events):
            return None not in blocks_of(events, plain, "GPU") + blocks_of(
                events, salted, "GPU")
        step_until(b, subscriber, emitted)
        assert blocks_of(subscriber.events, plain, "GPU")[:num_blocks] == plain_cpu
        assert blocks_of(subscriber.events, salted, "GPU")[:num_blocks] == salted_cpu
        gpu_salted_first = next(e for e in subscriber.events if isinstance(e, BlockStored)
                                and e.medium == "GPU" and e.block_hashes[0] == salted_cpu[0])
        assert gpu_salted_first.extra_keys[0] == salted_first.extra_keys[0]

        proc = subprocess.run([sys.executable, "-m", "lmcached.cli", "clear", "--yes",
                               "--socket", daemon.socket], capture_output=True, text=True,
                              timeout=30)
        assert proc.returncode == 0, proc.stderr

        def removed(events):
            return sum(len(e.block_hashes) for e in events
                       if isinstance(e, BlockRemoved) and e.medium == "CPU") >= 2 * num_blocks
        step_until(b, subscriber, removed)
        gone = [h for e in subscriber.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert sorted(gone) == sorted(plain_cpu + salted_cpu)
        assert all(e.medium == "CPU" for e in subscriber.events if isinstance(e, BlockRemoved))
        assert not any(isinstance(e, AllBlocksCleared) for e in subscriber.events)
        # B's relay read A's 4 chunks stored and removed, nothing of the other namespace.
        stats = b.relay_stats()
        assert (stats["chunk_events"], stats["stored"], stats["removed"]) == (8, 4, 4), stats
        assert b.quit() == 0
        assert daemon.info()["pinned_blocks"] == 0
    finally:
        if b is not None:
            b.kill()
        subscriber.close()


def store_in_another_namespace(socket: str, tokens: list[int]) -> None:
    """Another instance (another model: its own namespace) stores `tokens` in the daemon."""
    layout = KVLayout("another-model", num_layers=2, num_kv_heads=2, head_size=8,
                      dtype="bfloat16", chunk_size=32, fmt="vllm")
    engine = CacheEngine.connect(layout, socket=socket, strict=True)
    try:
        kv = torch.zeros(layout.chunk_shape(len(tokens)), dtype=torch.bfloat16)
        engine.store(torch.tensor(tokens), kv)
    finally:
        engine.close()
