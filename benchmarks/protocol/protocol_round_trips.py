"""The engine and scheduler sections of bench_protocol.py: round trips of the client APIs.

Why this file exists: it measures what the public client APIs cost in daemon round
trips, on a 4,096-token prompt of 8 MiB chunk records: the round trips per operation,
counted by the daemon (INFO's `requests` counter, stats section: its delta over N
operations / N, less the INFO request itself, so requests that get no reply are counted
too), and their p50 / p99.
  engine:    `CacheEngine.retrieve_views` of the prompt (Llama-3.2-1B KV); `lookup`;
             `lookup` then `retrieve_views`; and, where `lookup` takes `pin`,
             `lookup(pin=True)` then `retrieve_views`.
  scheduler: one vLLM request through `LMCachedConnectorScheduler` at TP=4 (Llama-3-8B
             KV, 4 namespaces, every chunk stored in each): get_num_new_matched_tokens
             + update_state_after_alloc + request_finished (which releases the pins).
             No vLLM needed: Request and KVCacheBlocks are stand-ins with the
             attributes the scheduler side reads.
Only public APIs are used and newer features are detected, so the same code measures
protocol v1 and v2 ("before" and "after"). torch and the client engine are imported
inside `RoundTripBench.setup` and `run_round_trips`, not at the top: the wire section's
spawned clients import this module too.
"""

import inspect
import itertools
import os
import platform
import time
from typing import Callable

import numpy as np

from lmcached.wire.connection import Connection, hello
from lmcached.wire.protocol import Info
from benchmarks.protocol.protocol_echo import FRAME_LENGTH, EchoClient
from benchmarks.protocol.protocol_harness import HASH_BYTES, place, placements, private_servers, summarize

PROMPT_TOKENS = 4096
CHUNK_TOKENS = 256
NUM_PROMPT_CHUNKS = PROMPT_TOKENS // CHUNK_TOKENS
TP_SIZE = 4
VLLM_BLOCK_TOKENS = 16
# (model, num_layers, num_kv_heads, head_size): both give 8 MiB bfloat16 chunk records.
ENGINE_MODEL = ("llama-3.2-1b", 16, 8, 64)
TP_MODEL = ("llama-3-8b", 32, 8 // TP_SIZE, 128)  # one TP rank's share of the KV heads
SPARE_BLOCKS = 16
SETTLE_S = 0.05  # lets the daemon read requests that get no reply before INFO counts
ECHO_LABEL = "raw echo (baseline)"
PIN_LABEL = "lookup(pin=True) + retrieve_views 4k"
PIN_MISSING = "n/a (not in this version)"


class StandInRequest:
    """What the connector's scheduler side reads of vLLM's `Request` (vllm.v1.request).

    A plain, unsalted text request without LoRA, multi-modal inputs or prompt embeddings,
    nothing computed by vLLM yet.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.all_token_ids = prompt_token_ids
        self.num_tokens = self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.lora_request = None
        self.mm_features = []
        self.cache_salt = None
        self.prompt_embeds = None
        self.kv_transfer_params = None


class StandInBlocks:
    """vLLM's `KVCacheBlocks` as the scheduler side reads it: one KV cache group's ids."""

    def __init__(self, block_ids: list[int]) -> None:
        self._block_ids = (list(block_ids),)

    def get_block_ids(self) -> tuple[list[int], ...]:
        """The vLLM block ids of each KV cache group (one group here)."""
        return self._block_ids


class RequestCounter:
    """The daemon's request counter (INFO, stats section, `requests`) on an admin session.

    The daemon counts every request it reads, one that gets no reply (a v2 RELEASE) too;
    the INFO that reads the counter counts itself.
    """

    def __init__(self, socket: str) -> None:
        self.conn = Connection(socket, timeout_s=30.0)
        hello(self.conn, "bench-request-counter")

    def read(self) -> int:
        """The counter now (one INFO request, included in the value)."""
        return int(self.conn.request(Info("stats")).sections["stats"]["requests"])

    def pinned_blocks(self) -> int:
        """INFO's `pinned_blocks` (blocks section), after the daemon read what was sent."""
        time.sleep(SETTLE_S)
        return int(self.conn.request(Info("blocks")).sections["blocks"]["pinned_blocks"])

    def per_op(self, run, n: int) -> float:
        """Requests the daemon counted per call of `run(n)`'s op, less the INFO reading it.

        Args:
            run: runs its op n times.
            n: calls to count over, >= 1.
        """
        before = self.read()
        run(n)
        time.sleep(SETTLE_S)
        return (self.read() - before - 1) / n

    def close(self) -> None:
        self.conn.close()


def accepts(fn, name: str) -> bool:
    """Whether callable `fn` takes a parameter `name` (features of a newer client)."""
    return name in inspect.signature(fn).parameters


def time_op(op, n: int, label: str) -> list[int]:
    """Latencies (ns) of n back-to-back calls of `op`.

    Raises:
        RuntimeError: `op` returned a token count other than the whole prompt (None:
            nothing to check).
    """
    clock, out = time.perf_counter_ns, []
    for _ in range(n):
        t0 = clock()
        found = op()
        out.append(clock() - t0)
        if found is not None and found != PROMPT_TOKENS:
            raise RuntimeError(f"{label}: found {found} of {PROMPT_TOKENS} tokens")
    return out


class RoundTripBench:
    """The public client APIs against one daemon, as ops for `time_op`.

    `setup` stores the prompt in each namespace used (untimed): once for the engine
    (Llama-3.2-1B layout), once per TP rank for the scheduler (Llama-3-8B at TP=4).

    Attributes:
        ops: (label, op) of every op set up, the echo baseline first. An op does one
            operation and returns the prompt tokens it found (None for the echo).
        has_pin: whether `CacheEngine.lookup` takes `pin` (the pinned op is in `ops`).
    """

    def __init__(self) -> None:
        self.ops: list[tuple[str, Callable[[], int | None]]] = []
        self.has_pin = False
        self.echo = self.engine = self.scheduler = None

    @staticmethod
    def layouts():
        """(engine layout, scheduler layouts per TP rank): KVLayouts, 8 MiB records."""
        from lmcached.client.layout import KVLayout

        name, layers, heads, head_size = ENGINE_MODEL
        engine = KVLayout(name, layers, heads, head_size, "bfloat16", CHUNK_TOKENS)
        name, layers, heads, head_size = TP_MODEL
        ranks = [KVLayout(name, layers, heads, head_size, "bfloat16", CHUNK_TOKENS, "vllm",
                          world_size=TP_SIZE, worker_id=rank) for rank in range(TP_SIZE)]
        return engine, ranks

    def setup(self, daemon_sock: str, echo_sock: str, engine: bool, scheduler: bool) -> None:
        """Connect, store the prompt where needed, and fill `ops`.

        Raises:
            RuntimeError: a store did not leave the whole prompt cached.
        """
        # Imported here, not at the top: the wire section's spawned clients re-import
        # bench_protocol.py, hence this module, and need neither torch nor the client.
        import torch

        from lmcached.client.engine import CacheEngine
        from lmcached.client.vllm.scheduler import LMCachedConnectorScheduler
        from lmcached.client.serving.specs import ConnectorSettings

        self.echo = EchoClient(echo_sock)
        payload = bytes(NUM_PROMPT_CHUNKS * HASH_BYTES + 32)  # as large as an ACQUIRE of it
        echo_frame, round_trip = FRAME_LENGTH.pack(len(payload)) + payload, self.echo.round_trip

        def echo() -> None:
            round_trip(echo_frame)

        self.ops.append((ECHO_LABEL, echo))
        tokens = np.arange(1000, 1000 + PROMPT_TOKENS, dtype=np.int64)
        engine_layout, rank_layouts = self.layouts()
        options = {"socket": daemon_sock, "strict": True}
        if accepts(CacheEngine.connect, "data_timeout_s"):  # no degrade to misses under load
            options["data_timeout_s"] = 30.0
        kv = torch.zeros(engine_layout.chunk_shape(PROMPT_TOKENS), dtype=torch.bfloat16)

        def store(layout) -> CacheEngine:
            cache = CacheEngine.connect(layout, **options)
            cache.store(tokens, kv.view(layout.chunk_shape(PROMPT_TOKENS)))
            if cache.lookup(tokens) != PROMPT_TOKENS:
                cache.close()
                raise RuntimeError(f"the prompt is not all cached after a store ({layout})")
            return cache

        if engine:
            self.engine = cache = store(engine_layout)

            def retrieve() -> int:
                with cache.retrieve_views(tokens) as views:
                    return views.num_tokens

            self.ops += [("retrieve_views 4k", retrieve),
                         ("lookup 4k", lambda: cache.lookup(tokens)),
                         ("lookup + retrieve_views 4k",
                          lambda: min(cache.lookup(tokens), retrieve()))]
            self.has_pin = accepts(CacheEngine.lookup, "pin")
            if self.has_pin:
                self.ops.append((PIN_LABEL, lambda: min(cache.lookup(tokens, pin=True),
                                                        retrieve())))
        if scheduler:
            for layout in rank_layouts:
                store(layout).close()  # the chunks stay cached
            settings = ConnectorSettings(
                layouts=rank_layouts, chunk_size=CHUNK_TOKENS, block_size=VLLM_BLOCK_TOKENS,
                world_size=TP_SIZE, socket=daemon_sock, daemon_name="unused", timeout_s=30.0,
            )
            self.scheduler = sched = LMCachedConnectorScheduler(settings)
            # vLLM leaves at least one prompt token to compute: one more than the chunks.
            prompt = tokens.tolist() + [7]
            blocks = StandInBlocks(list(range(-(-len(prompt) // VLLM_BLOCK_TOKENS))))
            # request_finished(request) here; vLLM's hook also passes the block ids.
            finished = inspect.signature(sched.request_finished).parameters
            finish_args = (blocks.get_block_ids()[0],) if len(finished) > 1 else ()
            request_ids = itertools.count()

            def vllm_request() -> int:
                """A new request: match, allocate (pins the chunks), finish (unpins)."""
                request = StandInRequest(f"bench-{next(request_ids)}", prompt)
                matched = sched.get_num_new_matched_tokens(request, 0)
                if isinstance(matched, tuple):  # vLLM's hook answers (tokens, load async)
                    matched = matched[0]
                sched.update_state_after_alloc(request, blocks, matched)
                sched.request_finished(request, *finish_args)
                return matched

            self.ops.append((f"vLLM scheduler request, TP={TP_SIZE}", vllm_request))

    def close(self) -> None:
        """Close every session and the echo connection (the daemon drops their pins)."""
        if self.scheduler is not None:
            self.scheduler.shutdown()
        if self.engine is not None:
            self.engine.close()
        if self.echo is not None:
            self.echo.close()


def run_round_trips(args, engine: bool, scheduler: bool, leftovers: list[str]) -> dict:
    """The engine and/or scheduler sections: round trips counted, then timed; prints them.

    Returns:
        The figures, as written by --json.
    """
    import lmcached
    from lmcached.wire.protocol import PROTOCOL_VERSION

    from benchmarks.common import record_block_size

    iterations = args.iterations or (600 if args.quick else 5000)
    rounds = max(1, min(args.rounds or (4 if args.quick else 10), iterations))
    per_round = -(-iterations // rounds)
    warmup = 100 if args.quick else 300
    count_ops = 50 if args.quick else 500
    engine_layout, rank_layouts = RoundTripBench.layouts()
    block_size = record_block_size(engine_layout)
    assert record_block_size(rank_layouts[0]) == block_size, "the two layouts' records differ"
    num_blocks = NUM_PROMPT_CHUNKS * (engine + TP_SIZE * scheduler) + SPARE_BLOCKS
    capacity = str(num_blocks * int(block_size))

    load_before = os.getloadavg()
    started = time.monotonic()
    bench, counter = RoundTripBench(), None
    with private_servers("rt", capacity, block_size, leftovers) as servers:
        try:
            bench.setup(servers.daemon_sock, servers.echo_sock, engine, scheduler)
            setup_s = time.monotonic() - started
            counter = RequestCounter(servers.daemon_sock)
            for label, op in bench.ops:
                time_op(op, warmup, label)
            round_trips = {label: counter.per_op(lambda n: time_op(op, n, label), count_ops)
                           for label, op in bench.ops if label != ECHO_LABEL}
            stats = {}
            for placement, cpus in placements():
                place(cpus, servers.daemon.pid, servers.echo.pid)
                samples = {label: [] for label, _ in bench.ops}
                for _ in range(rounds):
                    for label, op in bench.ops:
                        samples[label].extend(time_op(op, per_round, label))
                stats[placement] = {label: summarize(samples[label]) for label, _ in bench.ops}
            pinned = counter.pinned_blocks()
            if pinned:
                raise RuntimeError(f"{pinned} blocks still pinned after every op was done")
        finally:
            if counter is not None:
                counter.close()
            bench.close()

    mode = "quick" if args.quick else "full"
    sections = [name for name, on in (("engine", engine), ("scheduler", scheduler)) if on]
    print(f"lmcached protocol benchmark, {' + '.join(sections)} round trips ({mode}): "
          f"protocol v{PROTOCOL_VERSION}, lmcached from {os.path.dirname(lmcached.__file__)}, "
          f"Python {platform.python_version()}, {os.cpu_count()} CPUs")
    print(f"prompt: {PROMPT_TOKENS:,} tokens = {NUM_PROMPT_CHUNKS} chunks of {CHUNK_TOKENS}; "
          f"engine: {ENGINE_MODEL[0]} KV; scheduler: {TP_MODEL[0]} KV at TP={TP_SIZE} "
          f"({TP_SIZE} namespaces), vLLM blocks of {VLLM_BLOCK_TOKENS} tokens, one more "
          "prompt token to compute; 8 MiB chunk records")
    print(f"daemon: {num_blocks} blocks of {int(block_size) / 2**20:.2f} MiB, started and "
          f"the prompt stored in {setup_s:.1f} s; "
          f"{per_round * rounds} timed iterations per op in {rounds} interleaved rounds after "
          f"{warmup} warm-up; round trips counted over {count_ops} ops")
    load_after = os.getloadavg()
    print(f"load average (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load_before)}; "
          f"after {', '.join(f'{x:.2f}' for x in load_after)} (other processes share the CPUs)")
    print("round trips/op: requests the daemon counted per op (INFO stats `requests`, less "
          "the INFO itself); a fire-and-forget RELEASE (protocol v2) is counted as a request "
          "but costs no wait")
    result = {"protocol_version": PROTOCOL_VERSION,
              "lmcached": os.path.dirname(lmcached.__file__), "mode": mode,
              "iterations": per_round * rounds, "load_before": load_before,
              "load_after": load_after, "lookup_pin": bench.has_pin,
              "round_trips": round_trips, "latency_us": {}}
    for placement, table in stats.items():
        echo_p50 = table[ECHO_LABEL]["median"]
        print()
        print(f"client, daemon and echo server: {placement}")
        print(f"{'op':<38} {'round trips/op':>14} {'p50 us':>9} {'p99 us':>9} {'x echo p50':>11}")
        result["latency_us"][placement] = {}
        for label, _ in bench.ops:
            s = table[label]
            rts = f"{round_trips[label]:.2f}" if label in round_trips else "1"
            print(f"{label:<38} {rts:>14} {s['median']:>9.1f} {s['p99']:>9.1f} "
                  f"{s['median'] / echo_p50:>11.2f}")
            result["latency_us"][placement][label] = {
                "p50": s["median"], "p99": s["p99"], "x_echo_p50": s["median"] / echo_p50}
        if engine and not bench.has_pin:
            print(f"{PIN_LABEL:<38} {PIN_MISSING}")
    print()
    return result
