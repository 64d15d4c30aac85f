"""`lmcached demo`: worker processes running a real transformer share prompt prefixes.

Why this file exists: it shows, end to end on any machine, what lmcached is for. A
daemon (started here on a temp socket, or an existing one) and N worker processes, each
with the same Llama-architecture model built from a config with random weights (nothing
is downloaded), answer RAG-like prompts: a system prompt, a few documents, a question.
The documents are the topics of Python's own documentation (`pydoc_data.topics`); the
tokenizer is a byte-level BPE trained here on that text with the `tokenizers` library.

Worker 1 serves half the prompts; worker 2 the other half plus prompts that share their
system prompt and documents with worker 1's, so its prefill of those reads worker 1's
KV from shared memory. Every request is also run without the cache, in the same process
with the same model: the headline compares the TTFT of the same prompts with and without
lmcached, and the outputs must be identical.

The demo needs the `hf` extra (torch, transformers, tokenizers). Importing this module
without them raises ImportError at once (the CLI turns it into one `Error:` line), instead
of failing later in a worker process.
"""

import contextlib
import dataclasses
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
import shutil
import statistics
import tempfile
import time
from typing import Callable, Iterator

from lmcached.launcher import temporary_daemon
from lmcached.wire.connection import Connection, hello
from lmcached.wire.protocol import Info, Ping
from lmcached.wire.socket_path import connect_first, daemon_socket_paths

_MISSING = [m for m in ("torch", "transformers", "tokenizers") if importlib.util.find_spec(m) is None]
if _MISSING:
    raise ImportError(f"{', '.join(_MISSING)} not installed")

# Longest silence while waiting for a worker: after it, one line says what it is doing.
HEARTBEAT_S = 10.0

# One line per column of the per-request table (printed above it).
COLUMNS = [
    ("worker", "the worker process that served the request"),
    ("request", "g<document group>-q<question>: prompts of one group share system prompt and documents"),
    ("prompt", "prompt length, tokens"),
    ("cached", "prompt tokens whose KV came from lmcached instead of being computed"),
    ("cross", "of those, tokens that another worker process computed and stored"),
    ("TTFT ms", "time to first token with lmcached (retrieve the cached prefix, prefill the rest)"),
    ("no-cache", "time to first token of the same prompt without lmcached (same process and model)"),
    ("same", "yes when the generated tokens equal those of the no-cache run"),
]

SYSTEM_PROMPT = (
    "You are a careful assistant for Python programmers. Answer the question using only "
    "the reference documents below, quote the relevant rule, and say so when the "
    "documents do not contain the answer. Keep the answer short and precise. "
)
QUESTIONS = [
    "What happens when the condition is false?",
    "Which statements does this apply to?",
    "How does the interpreter evaluate this?",
    "What error is raised in the invalid case?",
    "Give a minimal example.",
    "How did this change in recent Python versions?",
    "What are the common mistakes?",
    "Summarize the rules in one sentence.",
]


@dataclasses.dataclass(frozen=True)
class DemoSize:
    """Model and prompt sizes of a demo run."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    doc_tokens: int
    docs_per_prompt: int
    chunk_size: int
    max_new_tokens: int


SIZES = {
    # A 10-layer model, prompts of ~1.3k tokens: a prefill takes seconds on a CPU.
    "demo": DemoSize(512, 10, 8, 4, 8000, 420, 3, 256, 16),
    # For the end-to-end test: prefills of milliseconds, so the cache's own round trips
    # show and the cached run may well be slower.
    "tiny": DemoSize(64, 2, 4, 2, 1000, 48, 2, 32, 4),
}


def build_model(size: DemoSize, max_positions: int = 8192):
    """The demo's Llama (random weights, fp32, eval mode): same config and seed in every
    process, so the same weights; `max_positions` is its max_position_embeddings."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=size.vocab_size, hidden_size=size.hidden_size,
        intermediate_size=3 * size.hidden_size, num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads, num_key_value_heads=size.num_kv_heads,
        max_position_embeddings=max_positions,
    )
    return LlamaForCausalLM(config).eval()


def train_tokenizer(size: DemoSize, path: str) -> None:
    """Train a byte-level BPE tokenizer on Python's documentation topics, save it to `path`."""
    import pydoc_data.topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size.vocab_size, special_tokens=["[UNK]"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(list(pydoc_data.topics.topics.values()) + [SYSTEM_PROMPT], trainer)
    tokenizer.save(path)


def build_prompts(size: DemoSize, tokenizer_path: str, num_workers: int) -> list[list[dict]]:
    """Prompts per worker: [{"id", "tokens", "group"}]; groups share system prompt + documents.

    Worker 1 gets half of the base prompts, the other workers the rest; every other
    worker also gets prompts on worker 1's document groups (cross-process prefixes).
    """
    import pydoc_data.topics
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_path)
    topics = pydoc_data.topics.topics
    names = sorted(n for n, text in topics.items() if len(text) > 8 * size.doc_tokens)
    docs = [tokenizer.encode(f"Document: {n}\n" + topics[n]).ids[: size.doc_tokens] for n in names]
    system = tokenizer.encode(SYSTEM_PROMPT).ids
    num_groups = 2 * num_workers
    groups = [docs[g * size.docs_per_prompt : (g + 1) * size.docs_per_prompt] for g in range(num_groups)]

    def prompt(group: int, question: int) -> dict:
        body = [t for doc in groups[group] for t in doc]
        q = tokenizer.encode("\nQuestion: " + QUESTIONS[question % len(QUESTIONS)] + "\nAnswer:").ids
        return {"id": f"g{group}-q{question}", "tokens": system + body + q, "group": group}

    per_worker: list[list[dict]] = [[] for _ in range(num_workers)]
    # Worker 1: groups 0 and 1, one of them asked twice (a same-process hit).
    per_worker[0] = [prompt(0, 0), prompt(1, 1), prompt(0, 2)]
    for w in range(1, num_workers):
        own = [prompt(2 * w, 3), prompt(2 * w + 1, 4), prompt(2 * w, 5)]
        shared = [prompt(0, 5 + w), prompt(1, 6 + w)]  # worker 1's documents
        per_worker[w] = own[:2] + shared + own[2:]
    return per_worker


def worker_main(worker_id: int, size: DemoSize, socket: str, tokenizer_path: str, conn) -> None:
    """A worker process: build the model, then serve prompt lists sent by the parent.

    Messages to the parent: `progress` (printed), `status` (what it is doing, printed
    only if it takes longer than HEARTBEAT_S), `ready`, one `result` per request, `done`.
    """
    started = time.perf_counter()

    def progress(text: str) -> None:
        conn.send({"event": "progress", "worker": worker_id, "text": text})

    progress("importing torch and transformers")
    import torch

    from lmcached.client import CacheEngine, hash_request_tokens
    from lmcached.client.hf import generate_with_cache, layout_for_model

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    progress(f"building the {size.num_layers}-layer model (random weights, seed 0)")
    model = build_model(size)
    progress("connecting to the daemon")
    layout = layout_for_model(model, size.chunk_size, model_name="lmcached-demo-llama")
    engine = CacheEngine.connect(layout, socket=socket, strict=True)
    conn.send({"event": "ready", "worker": worker_id, "build_s": time.perf_counter() - started})
    own_hashes: set[bytes] = set()
    try:
        while True:
            message = conn.recv()
            if message is None:
                break
            for request in message:
                conn.send({"event": "status", "worker": worker_id,
                           "text": f"is running {request['id']} with and without the cache"})
                tokens = torch.tensor(request["tokens"], dtype=torch.int64)
                hashes = hash_request_tokens(size.chunk_size, tokens)
                warm = generate_with_cache(model, engine, tokens, size.max_new_tokens)
                cold = generate_with_cache(model, None, tokens, size.max_new_tokens)
                cached_chunks = hashes[: -(-warm.num_cached_tokens // size.chunk_size)]
                cross = sum(
                    min(size.chunk_size, warm.num_cached_tokens - i * size.chunk_size)
                    for i, h in enumerate(cached_chunks) if h not in own_hashes
                )
                own_hashes.update(hashes)
                conn.send({
                    "event": "result", "worker": worker_id, "id": request["id"],
                    "prompt_tokens": warm.num_prompt_tokens,
                    "cached_tokens": warm.num_cached_tokens, "cross_process_tokens": cross,
                    "ttft_s": warm.ttft_s, "ttft_no_cache_s": cold.ttft_s,
                    "identical": bool(torch.equal(warm.output_ids, cold.output_ids)),
                    "max_logit_diff": float((warm.prefill_logits - cold.prefill_logits).abs().max()),
                })
            conn.send({"event": "done", "worker": worker_id})
    finally:
        engine.close()


def block_bytes_for(size: DemoSize) -> int:
    """The demo's chunk record (fp32 KV of `size`'s model), rounded up to 4 KiB: the
    `--block-size` of the daemon the demo starts, so that one chunk takes one block and
    the daemon has no block size to derive (and warn about)."""
    from lmcached.client.layout import KVLayout  # torch: only when the demo starts a daemon

    layout = KVLayout("lmcached-demo-llama", num_layers=size.num_layers,
                      num_kv_heads=size.num_kv_heads, head_size=size.hidden_size // size.num_heads,
                      dtype="float32", chunk_size=size.chunk_size)
    return -(-layout.record_bytes(size.chunk_size) // 4096) * 4096


@contextlib.contextmanager
def _daemon(socket: str | None, name: str | None, capacity: str, block_bytes: int,
            log: Callable[[str], None]) -> Iterator[str]:
    """Use the running daemon at `socket` or named `name`, found as the CLI finds it
    (`daemon_socket_paths`), or start one on a temp socket (blocks of `block_bytes`) and
    stop it after. Yields the socket.

    Raises:
        NoDaemonError (an OSError): `socket` or `name` given and no daemon answers in any
            place looked at (the message lists them).
    """
    if socket is not None or name is not None:
        with connect_first(daemon_socket_paths(socket, name),
                           lambda path: Connection(path, timeout_s=5)) as conn:
            conn.request(Ping())
            path = conn.socket_path
        log(f"using the daemon on {path}")
        yield path
        return
    log(f"starting a daemon with a {capacity} arena on a temp socket")
    with temporary_daemon("--capacity", capacity, "--block-size", str(block_bytes),
                          "--log-level", "WARNING",
                          name=f"demo-{os.getpid()}") as path:
        yield path


def run_demo(num_workers: int = 2, size_name: str = "demo", socket: str | None = None,
             capacity: str = "1GiB", log: Callable[[str], None] = print,
             name: str | None = None) -> dict:
    """Run the demo; print progress and results through `log`; return the summary.

    Args:
        num_workers: worker processes, >= 2 (worker 2 on reuses worker 1's prefixes).
        size_name: a key of SIZES ("demo" or "tiny").
        socket: use the daemon on this socket instead of starting one.
        capacity: arena of the daemon the demo starts (e.g. "1GiB").
        name: use the running daemon of this name (found where the CLI looks) instead of
            starting one.
        log: where progress lines, the table and the summary go.

    Returns:
        The summary (see `summarize`), with every per-request result under "results".

    Raises:
        ValueError: num_workers < 2 or an unknown size.
        RuntimeError: the daemon or a worker failed.
        OSError: `socket` or `name` given and no daemon answers there (NoDaemonError
            lists the places looked at).
    """
    if num_workers < 2:
        raise ValueError("the demo needs at least 2 workers to share prefixes between processes")
    if size_name not in SIZES:
        raise ValueError(f"unknown size {size_name!r}; choose from {', '.join(sorted(SIZES))}")
    size = SIZES[size_name]
    started = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="lmcdemo-")
    ctx = multiprocessing.get_context("spawn")
    workers, pipes = [], []
    try:
        log("training a byte-level BPE tokenizer on Python's documentation topics ...")
        tokenizer_path = os.path.join(tmp, "tokenizer.json")
        train_tokenizer(size, tokenizer_path)
        prompts = build_prompts(size, tokenizer_path, num_workers)
        running = socket is not None or name is not None
        block_bytes = 0 if running else block_bytes_for(size)
        with _daemon(socket, name, capacity, block_bytes, log) as sock:
            log(f"starting {num_workers} worker processes; each builds a {size.num_layers}-layer "
                f"Llama (hidden {size.hidden_size}, random weights) ...")
            for w in range(num_workers):
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(target=worker_main, name=f"lmcached-demo-worker-{w + 1}",
                                   args=(w + 1, size, sock, tokenizer_path, child_end), daemon=True)
                proc.start()
                workers.append(proc)
                pipes.append(parent_end)
            waiter = _Waiter(pipes, workers, log)
            for _ in range(num_workers):
                ready = waiter.next({"ready"})
                log(f"worker {ready['worker']} ready (pid {workers[ready['worker'] - 1].pid}, "
                    f"started in {ready['build_s']:.1f} s)")
            log("")
            log("columns:")
            for name, meaning in COLUMNS:
                log(f"  {name:<9} {meaning}")
            log(f"{'worker':>6} {'request':>8} {'prompt':>7} {'cached':>7} {'cross':>6} "
                f"{'TTFT ms':>8} {'no-cache':>9} {'same':>5}")
            results = []
            for w, pipe in enumerate(pipes):  # worker 1 first: its prefixes are then shared
                pipe.send(prompts[w])
                while (message := waiter.next({"result", "done"}, only=w))["event"] == "result":
                    results.append(message)
                    log(f"{message['worker']:>6} {message['id']:>8} {message['prompt_tokens']:>7} "
                        f"{message['cached_tokens']:>7} {message['cross_process_tokens']:>6} "
                        f"{message['ttft_s'] * 1e3:>8.0f} {message['ttft_no_cache_s'] * 1e3:>9.0f} "
                        f"{'yes' if message['identical'] else 'NO':>5}")
            for pipe in pipes:
                pipe.send(None)
            with Connection(sock) as conn:
                hello(conn, "lmcached-demo")
                info = conn.request(Info()).sections
            summary = summarize(results, info, num_workers, time.perf_counter() - started)
            print_summary(summary, log)
            log("stopping the workers" + ("" if running else " and the daemon") + " ...")
        return summary
    finally:
        for proc in workers:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        shutil.rmtree(tmp, ignore_errors=True)


class _Waiter:
    """Receives the workers' messages: prints progress, fails if a worker dies, and says
    what the busy workers are doing after HEARTBEAT_S without a message."""

    def __init__(self, pipes: list, workers: list, log: Callable[[str], None]) -> None:
        self.pipes, self.workers, self.log = pipes, workers, log
        self.doing = {w + 1: ("is starting", time.monotonic()) for w in range(len(pipes))}

    def next(self, events: set[str], only: int | None = None) -> dict:
        """The next message whose event is in `events` (from worker index `only`, or any).

        Raises:
            RuntimeError: a worker exited with an error.
        """
        pipes = self.pipes if only is None else [self.pipes[only]]
        quiet_since = time.monotonic()
        while True:
            for pipe in multiprocessing.connection.wait(pipes, timeout=0.5):
                message = pipe.recv()
                quiet_since = time.monotonic()
                event, worker = message["event"], message["worker"]
                if event == "progress":
                    self.log(f"worker {worker}: {message['text']} ...")
                    self.doing[worker] = (f"is {message['text']}", time.monotonic())
                elif event == "status":
                    self.doing[worker] = (message["text"], time.monotonic())
                elif event in events:
                    if event in ("ready", "done"):
                        self.doing.pop(worker, None)  # idle until it is sent prompts
                    return message
            dead = [p for p in self.workers if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"{dead[0].name} exited with status {dead[0].exitcode}")
            waited_s = time.monotonic() - quiet_since
            if waited_s >= HEARTBEAT_S:
                now = time.monotonic()
                self.log("  still waiting: " + "; ".join(
                    f"worker {w} {text} ({now - since:.0f} s)" for w, (text, since) in self.doing.items()
                    if only is None or w == only + 1))
                quiet_since = time.monotonic()


def speedup_headline(ttft_s: float | None, ttft_no_cache_s: float | None, num_prompts: int) -> str:
    """The demo's headline: the median TTFT of the prompts that found a cached prefix,
    against the median TTFT of the SAME prompts run without lmcached.

    Args:
        ttft_s: median TTFT with lmcached, seconds (None: no prompt found a prefix).
        ttft_no_cache_s: median TTFT of the same prompts without lmcached, seconds.
        num_prompts: how many prompts the medians cover.

    Returns:
        One line; "N.Nx faster" or "N.Nx slower" (two decimals below 1.1x), or why there
        is no comparison.
    """
    if not num_prompts or ttft_s is None or ttft_no_cache_s is None:
        return "no prompt found a cached prefix: nothing to compare"
    if ttft_s <= 0 or ttft_no_cache_s <= 0:
        raise ValueError(f"TTFTs must be positive seconds, got {ttft_s} and {ttft_no_cache_s}")
    ratio = ttft_no_cache_s / ttft_s  # above 1: faster with lmcached
    factor = max(ratio, 1 / ratio)
    verdict = ("as fast" if ratio == 1 else
               f"{factor:.{2 if factor < 1.1 else 1}f}x {'faster' if ratio > 1 else 'slower'}")
    return (f"{ttft_s * 1e3:.0f} ms median with lmcached, {ttft_no_cache_s * 1e3:.0f} ms for the "
            f"same {num_prompts} prompt{'s' if num_prompts != 1 else ''} without it: {verdict}")


def summarize(results: list[dict], info: dict, num_workers: int, wall_s: float) -> dict:
    """The demo's summary from its per-request results and the daemon's INFO sections.

    TTFT medians: `ttft_warm_median_s` and `ttft_warm_no_cache_median_s` are over the same
    prompts (those that found a cached prefix), with and without lmcached;
    `ttft_warm_speedup` is the second over the first (above 1: faster with lmcached).
    `ttft_cold_median_s` is over the prompts that found nothing to reuse.
    """
    cold = [r["ttft_s"] for r in results if r["cached_tokens"] == 0]
    warm = [r for r in results if r["cached_tokens"] > 0]
    warm_s = statistics.median(r["ttft_s"] for r in warm) if warm else None
    warm_no_cache_s = statistics.median(r["ttft_no_cache_s"] for r in warm) if warm else None
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    cached_tokens = sum(r["cached_tokens"] for r in results)
    stats = info["stats"]
    return {
        "workers": num_workers,
        "requests": len(results),
        "num_warm_requests": len(warm),
        "ttft_cold_median_s": statistics.median(cold) if cold else None,
        "ttft_warm_median_s": warm_s,
        "ttft_warm_no_cache_median_s": warm_no_cache_s,
        "ttft_warm_speedup": warm_no_cache_s / warm_s if warm else None,
        "headline": speedup_headline(warm_s, warm_no_cache_s, len(warm)),
        "cross_process_hit_tokens": sum(r["cross_process_tokens"] for r in results),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "hit_rate": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        "outputs_identical": all(r["identical"] for r in results),
        "num_identical": sum(r["identical"] for r in results),
        "max_logit_diff": max(r["max_logit_diff"] for r in results),
        "daemon": {
            "hits": stats["hits"], "misses": stats["misses"], "stores": stats["stores"],
            "evictions": stats["evictions"], "stored_bytes": info["memory"]["stored_bytes"],
            "stored_human": info["memory"]["stored_human"],
            "clients_seen": stats["connections_received"],
        },
        "wall_s": wall_s,
        "results": results,
    }


def print_summary(s: dict, log: Callable[[str], None]) -> None:
    """Print `summarize`'s result, headline first, one explained line per figure."""
    num_cold = s["requests"] - s["num_warm_requests"]
    cold = "-" if s["ttft_cold_median_s"] is None else f"{s['ttft_cold_median_s'] * 1e3:.0f} ms median"
    d = s["daemon"]
    log("")
    log(f"TTFT with a cached prefix         {s['headline']}")
    log(f"TTFT with no cached prefix        {cold} ({num_cold} prompt{'s' if num_cold != 1 else ''} "
        f"seen for the first time: nothing to reuse; the KV is stored for the others)")
    log(f"requests                          {s['requests']} on {s['workers']} worker processes")
    log(f"cross-process hit tokens          {s['cross_process_hit_tokens']} (computed by one "
        f"worker process, read by another)")
    log(f"hit rate                          {s['hit_rate'] * 100:.1f}% "
        f"({s['cached_tokens']} of {s['prompt_tokens']} prompt tokens from the cache)")
    log(f"outputs identical to no-cache run {'yes' if s['outputs_identical'] else 'NO'} "
        f"({s['num_identical']}/{s['requests']}; max prefill logit difference "
        f"{s['max_logit_diff']:.1e})")
    log(f"daemon                            hits={d['hits']} misses={d['misses']} "
        f"stores={d['stores']} evictions={d['evictions']} stored={d['stored_human']}")
    log("                                  (`lmcached info` fields: chunks found / not found, "
        "chunks stored, chunks evicted; stored: KV bytes held, K/M/G = KiB/MiB/GiB)")
    log(f"wall time                         {s['wall_s']:.1f} s")
