"""LMCache beside lmcached: its in-process CPU engine and its multi-process server.

Why this file exists: the suite measures LMCache on the same shapes when `pip install
lmcache` works in a separate virtualenv (`--peers lmcache`). LMCache needs its own
torch and dozens of packages, so it never enters lmcached's venv: this module creates
(or reuses) that venv, records versions, and runs two measurements there:

- in-process: `peers/lmcache_inproc.py` (LMCacheEngine, local CPU backend) writes JSON.
- multi-process server: `lmcache server` (ZMQ on 127.0.0.1, L1 in DRAM) driven by
  LMCache's own client, `lmcache bench server --mode cpu --transfer-mode lmcache_driven`
  (the worker's paged KV cache lives in POSIX shared memory that the server reads and
  writes: LMCache's zero-copy CPU path); per sequence it LOOKUPs, STOREs the prompt
  cold, LOOKUPs again and RETRIEVEs it. Its per-request log lines give the latencies.
  Paged KV of 16-token blocks, as vLLM's.

Every process started here is stopped by pid (SIGTERM, then SIGKILL), whatever happens.
If LMCache cannot be installed or run, the functions raise LMCacheUnavailable with the
error, which the report prints.
"""

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import psutil

from lmcached.launcher import stop_daemon

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_VENV = os.environ.get("LMCACHE_VENV", "/tmp/lmcache-venv")
TORCH_PIN = "torch==2.13.0"
SERVER_START_TIMEOUT_S = 180.0
LOG_LINE = re.compile(
    r"\[seq (\d+)/(cold|warm)\] (STORE|RETRIEVE): (\S+) \((\d+) tokens, ([\d.]+) ms")
LOOKUP_LINE = re.compile(r"\[seq (\d+)/(cold|warm)\] LOOKUP: (\d+)/(\d+) chunks hit \(([\d.]+) ms\)")
PAGE_TOKENS = 16


class LMCacheUnavailable(RuntimeError):
    """LMCache cannot be installed or run here; the message has the error."""


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(LMCACHE_DISABLE_BANNER="1", PYTHONHASHSEED="0", PYTHONWARNINGS="ignore")
    return env


def _tail(text: str, lines: int = 15) -> str:
    kept = [line for line in text.strip().splitlines()
            if "FutureWarning" not in line and "warnings.warn" not in line]
    return "\n".join(kept[-lines:])


def ensure_venv(venv: str = DEFAULT_VENV, install: bool = True) -> str:
    """The venv's python, creating the venv and installing torch + lmcache if missing.

    Raises:
        LMCacheUnavailable: the venv is missing and install=False, or an install step
            failed (the message ends with pip's last lines).
    """
    python = os.path.join(venv, "bin", "python")
    check = [python, "-c", "import torch, lmcache"]
    if os.path.exists(python) and subprocess.run(check, capture_output=True, env=_env(),
                                                 timeout=300).returncode == 0:
        return python
    if not install:
        raise LMCacheUnavailable(f"no working LMCache venv at {venv}")
    steps = [
        [sys.executable, "-m", "venv", venv],
        [python, "-m", "pip", "install", "-q", "--upgrade", "pip"],
        [python, "-m", "pip", "install", "-q", TORCH_PIN],  # the CPU build, before lmcache
        [python, "-m", "pip", "install", "-q", "lmcache"],
    ]
    for step in steps:
        print(f"  LMCache venv: {' '.join(step[-3:])} ...", flush=True)
        done = subprocess.run(step, capture_output=True, text=True, env=_env(), timeout=1800)
        if done.returncode != 0:
            raise LMCacheUnavailable(f"`{' '.join(step)}` failed (exit {done.returncode}):\n"
                                     f"{_tail(done.stderr or done.stdout)}")
    done = subprocess.run(check, capture_output=True, text=True, env=_env(), timeout=300)
    if done.returncode != 0:
        raise LMCacheUnavailable(f"lmcache installed but does not import:\n{_tail(done.stderr)}")
    return python


def versions(python: str) -> dict:
    """Versions of lmcache, torch and python in the venv."""
    code = ("import json, platform, torch; from lmcache._version import version; "
            "print(json.dumps({'lmcache': version, 'torch': torch.__version__, "
            "'python': platform.python_version()}))")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, env=_env(),
                          timeout=300)
    if done.returncode != 0:
        raise LMCacheUnavailable(f"cannot read LMCache versions:\n{_tail(done.stderr)}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def shape_json(layout) -> str:
    return json.dumps({"name": layout.model_name, "num_layers": layout.num_layers,
                       "num_kv_heads": layout.num_kv_heads, "head_size": layout.head_size,
                       "chunk_size": layout.chunk_size})


def run_inproc(python: str, tokens_by_layout: list, repeat: int, timeout_s: float = 1200) -> dict:
    """LMCache's in-process engine: {model_name: {str(tokens): {"nbytes", "samples"}}}.

    Args:
        tokens_by_layout: [(KVLayout, [prompt lengths])].

    Raises:
        LMCacheUnavailable: the script failed (the message has its last lines).
    """
    out_path = tempfile.mktemp(prefix="lmcb-lmcache-", suffix=".json", dir="/tmp")
    cmd = [python, os.path.join(HERE, "lmcache_inproc.py"), "--repeat", str(repeat),
           "--out", out_path, "--tokens"]
    cmd += sorted({n for _, counts in tokens_by_layout for n in counts})
    cmd = [str(c) for c in cmd]
    for layout, counts in tokens_by_layout:
        cmd += ["--shape", shape_json(layout), "--max-tokens", f"{layout.model_name}={max(counts)}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env())
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop_tree(proc)
        raise LMCacheUnavailable(f"LMCache in-process benchmark ran past {timeout_s:.0f} s") from None
    finally:
        _stop_tree(proc)
    try:
        if proc.returncode != 0:
            raise LMCacheUnavailable(
                f"LMCache in-process benchmark failed (exit {proc.returncode}"
                f"{', killed: out of memory?' if proc.returncode in (-9, 137) else ''}):\n"
                f"{_tail(output)}")
        with open(out_path) as f:
            return json.load(f)["shapes"]
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(out_path)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop_tree(proc: subprocess.Popen) -> None:
    """SIGTERM the process and the children it started (by pid), then SIGKILL."""
    if proc.poll() is not None:
        return
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        children = []
    stop_daemon(proc, timeout_s=30)  # SIGTERM, then SIGKILL by pid
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def running_server(python: str, l1_gib: float, chunk_size: int, log_path: str):
    """`lmcache server` on 127.0.0.1 (free ports); yields (rpc_port, http_port, pid)."""
    lmcache_bin = os.path.join(os.path.dirname(python), "lmcache")
    rpc_port, http_port, prom_port = _free_port(), _free_port(), _free_port()
    cmd = [lmcache_bin, "server", "--host", "localhost", "--port", str(rpc_port),
           "--http-host", "127.0.0.1", "--http-port", str(http_port),
           "--prometheus-port", str(prom_port), "--chunk-size", str(chunk_size),
           "--l1-size-gb", f"{l1_gib:g}", "--eviction-policy", "LRU", "--eviction-ratio", "0.5",
           "--l1-read-ttl-seconds", "1", "--l1-write-ttl-seconds", "60",
           "--supported-transfer-mode", "auto", "--disable-observability"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env())
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not (_port_open(rpc_port) and _port_open(http_port)):
            if proc.poll() is not None:
                with open(log_path) as f:
                    raise LMCacheUnavailable(f"`lmcache server` exited with {proc.returncode}:\n"
                                             f"{_tail(f.read())}")
            if time.monotonic() > deadline:
                raise LMCacheUnavailable("`lmcache server` did not open its ports in time")
            time.sleep(0.5)
        yield rpc_port, http_port, proc.pid
    finally:
        _stop_tree(proc)


def _parse_bench_log(text: str) -> dict:
    """Per sequence: its cold STORE, warm LOOKUP and warm RETRIEVE, from the bench log.

    A cold STORE whose warm LOOKUP then misses was dropped by the server (L1 full: the
    STORE reply says "stored" in ~3 ms and nothing is kept); it is counted, not timed.
    """
    seqs: dict[int, dict] = {}
    for match in LOG_LINE.finditer(text):
        seq, kind, op, status, _, ms = match.groups()
        entry = seqs.setdefault(int(seq), {})
        entry[f"{kind} {op.lower()}"] = (status, float(ms) / 1e3)
    for match in LOOKUP_LINE.finditer(text):
        seq, kind, hit, total, ms = match.groups()
        seqs.setdefault(int(seq), {})[f"{kind} lookup"] = (int(hit) == int(total), float(ms) / 1e3)
    ops = {"store": [], "retrieve": [], "lookup": [], "dropped_stores": 0, "failed": []}
    for seq in sorted(seqs):
        entry = seqs[seq]
        warm_hit = entry.get("warm lookup", (False, 0.0))[0]
        store = entry.get("cold store")
        if store and store[0] == "stored" and warm_hit:
            ops["store"].append(store[1])
        elif store and store[0] == "stored":
            ops["dropped_stores"] += 1
        elif store:
            ops["failed"].append(f"seq {seq} cold store: {store[0]}")
        if warm_hit:
            ops["lookup"].append(entry["warm lookup"][1])
        retrieve = entry.get("warm retrieve")
        if retrieve and retrieve[0] == "retrieved":
            ops["retrieve"].append(retrieve[1])
        elif retrieve:
            ops["failed"].append(f"seq {seq} warm retrieve: {retrieve[0]}")
    return ops


def l1_gib_for(prompt_bytes: int, num_sequences: int) -> tuple[float, bool]:
    """L1 for one length: every sequence of the run if it fits in 3 prompts + 0.5 GiB.

    LMCache 0.5.6's server drops a STORE when L1 is full and its eviction has not freed
    enough yet (seen here: evictions run behind back-to-back 512 MiB stores), so L1
    holds the whole run where memory allows; at 16k tokens of Llama-3-8B it cannot, and
    later stores may be dropped (counted, not timed).

    Returns:
        (L1 GiB, whether every sequence fits).
    """
    all_fit = num_sequences * prompt_bytes * 1.05 + (512 << 20)
    bounded = 3 * prompt_bytes + (512 << 20)
    return round(max(1.0, min(all_fit, bounded) / 2**30), 1), all_fit <= bounded


def run_server(python: str, layout, token_counts: list[int], repeat: int,
               timeout_s: float = 900) -> dict:
    """LMCache's multi-process server: {str(tokens): {"nbytes", "samples", ...}}.

    One fresh server per length (L1 from `l1_gib_for`), then `repeat` + 1 sequences of
    `lmcache bench server` (2 * `repeat` + 1 where L1 cannot hold them all): cold LOOKUP,
    STORE, warm LOOKUP, RETRIEVE; the first kept sequence is a warm-up, then at most
    `repeat` are timed. The bench's checksum queries are pointed at a closed port (its HTTP
    checksum of a 512 MiB prompt timed out and competed with the transfers).

    Raises:
        LMCacheUnavailable: the server or the bench client failed (with its last lines).
    """
    results = {}
    tmp = tempfile.mkdtemp(prefix="lmcb-lmcache-", dir="/tmp")
    lmcache_bin = os.path.join(os.path.dirname(python), "lmcache")
    try:
        for num_tokens in token_counts:
            prompt_bytes = num_tokens * layout.token_bytes
            l1_gib, all_fit = l1_gib_for(prompt_bytes, repeat + 1)
            # Where L1 cannot hold every sequence, some STOREs are dropped: run more of them.
            num_sequences = repeat + 1 if all_fit else 2 * repeat + 1
            with running_server(python, l1_gib, layout.chunk_size,
                                os.path.join(tmp, f"server-{num_tokens}.log")) as (rpc_port, _, pid):
                server = psutil.Process(pid)
                idle_rss = server.memory_info().rss
                num_pages = num_tokens // PAGE_TOKENS + 16
                spec = (f"(2,{num_pages},{PAGE_TOKENS},{layout.num_kv_heads},"
                        f"{layout.head_size}):bfloat16:{layout.num_layers}")
                cmd = [lmcache_bin, "bench", "server", "--rpc-url", f"tcp://localhost:{rpc_port}",
                       "--url", f"http://127.0.0.1:{_closed_port()}", "--mode", "cpu",
                       "--transfer-mode", "lmcache_driven", "--num-tokens", str(num_tokens),
                       "--kvcache-shape-spec", spec, "--start", "0", "--end", str(num_sequences),
                       "--interval", "0.2"]
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, env=_env())
                try:
                    output, _ = proc.communicate(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    raise LMCacheUnavailable(
                        f"`lmcache bench server` at {num_tokens} tokens ran past {timeout_s:.0f} s"
                    ) from None
                finally:
                    _stop_tree(proc)
                if proc.returncode != 0:
                    killed = ", killed: out of memory?" if proc.returncode in (-9, 137) else ""
                    raise LMCacheUnavailable(
                        f"`lmcache bench server` at {num_tokens} tokens failed (exit "
                        f"{proc.returncode}{killed}):\n{_tail(output)}")
                if not server.is_running() or server.status() == psutil.STATUS_ZOMBIE:
                    raise LMCacheUnavailable(f"`lmcache server` died at {num_tokens} tokens")
                ops = _parse_bench_log(output)
                server_rss = server.memory_info().rss
            samples = {op: ops[op][1 : repeat + 1] if len(ops[op]) > 1 else ops[op]  # no warm-up
                       for op in ("store", "retrieve", "lookup")}
            results[str(num_tokens)] = {
                "nbytes": prompt_bytes,
                "samples": {"store cold": samples["store"], "retrieve": samples["retrieve"],
                            "lookup": samples["lookup"]},
                "dropped_stores": ops["dropped_stores"],
                "failed": ops["failed"],
                "l1_gib": l1_gib,
                "server_rss_bytes_idle": idle_rss,
                "server_rss_bytes": server_rss,
            }
            print(f"  LMCache server {layout.model_name} {num_tokens}: "
                  f"{len(samples['store'])} stores, {len(samples['retrieve'])} retrieves timed, "
                  f"{ops['dropped_stores']} stores dropped (L1 {l1_gib:g} GiB)", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def _closed_port() -> int:
    """A loopback port nothing listens on (connections are refused at once)."""
    return _free_port()
