"""Prometheus metrics (`lmcached serve --metrics-port`): scraped over HTTP from real daemons.

The counts a scrape shows are checked against INFO's and against what the workload did
(chunks stored, tokens hit and missed as the engine counted them), while a workload runs
and after it. Parsing is prometheus_client's own (`text_string_to_metric_families`).
"""

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from raw_frames import frame, recv_reply
from lmcached.client import CacheEngine, KVLayout
from lmcached.daemon.server_config import ServerConfig
from lmcached.daemon.metrics import (
    DISK_COUNTERS,
    EVENT_FIELDS,
    L2_COUNTERS,
    MAX_NAMESPACE_ROWS,
    OTHER_NAMESPACES,
    l2_families,
    SNAPSHOT_MAX_AGE_S,
    DaemonCollector,
    SnapshotChannel,
    device_tier_families,
    disk_families,
    metric_families,
    take_snapshot,
)
from lmcached.daemon.demotion import DemotionStats
from lmcached.daemon.disk.counters import DiskStats
from lmcached.daemon.info import TIER_BLOCK_STATES, DeviceTierRow
from lmcached.daemon.l2.counters import L2Stats, error_fields as l2_error_fields
from lmcached.daemon.spill.counters import info_fields
from lmcached.daemon.stats import LATENCY_BUCKETS_S, RequestLatency
from lmcached.wire.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Acquire,
    Alloc,
    Commit,
    Error,
    Hello,
    Layout,
    Lookup,
)
from lmcached.daemon.service import CacheService
from lmcached.shm.arena import Arena
from lmcached.shm.janitor import list_segments

CHUNK = 16
LAYOUT = KVLayout("metrics-llama", num_layers=3, num_kv_heads=2, head_size=8,
                  dtype="bfloat16", chunk_size=CHUNK)
PROMPT_TOKENS = 4 * CHUNK  # whole chunks: the daemon's token counts are then exact
NUM_BLOCKS = 255  # 1 MiB arena, 4 KiB blocks, 4 KiB header
STATES = ("free", "ready", "pinned", "detached", "writing")


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's choice)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def scrape(port: int, host: str = "127.0.0.1") -> dict[tuple, float]:
    """GET /metrics, parsed by prometheus_client: {(sample name, labels...): value}."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=30) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, *sorted(sample.labels.items()))] = sample.value
    return samples


def fresh_scrape(port: int, host: str = "127.0.0.1") -> dict[tuple, float]:
    """A scrape whose numbers were copied after this call: a snapshot younger than
    SNAPSHOT_MAX_AGE_S is reused, so wait that long first."""
    time.sleep(SNAPSHOT_MAX_AGE_S)
    return scrape(port, host)


def total(samples: dict, name: str, **labels) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, *ls), v in samples.items() if n == name and wanted <= set(ls))


def blocks_by_state(samples: dict) -> dict[str, float]:
    return {state: samples[("lmcached_blocks", ("state", state))] for state in STATES}


def make_kv(num_tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.chunk_shape(num_tokens), generator=gen).to(LAYOUT.torch_dtype)


# ------------------------------------------------------------ a workload and INFO
def test_scrapes_during_a_workload_are_consistent_and_equal_info_after_it(daemon_factory):
    port = free_port()
    daemon = daemon_factory("--capacity", "1MiB", "--block-size", "4KiB",
                            "--metrics-port", str(port))
    scrapes_done = 0
    stored = []
    failure = []
    abandon = threading.Event()  # the scrapes failed: stop the workload too

    def workload(engine: CacheEngine) -> None:
        """Store and read prompts until the main thread has scraped 5 times: prompts that
        hit, prompts never stored (misses), and early prompts evicted by later ones."""
        try:
            i = 0
            while not abandon.is_set() and (i < 120 or scrapes_done < 5):
                tokens = torch.arange(PROMPT_TOKENS) + 1000 * i
                stored.append(engine.store(tokens, make_kv(PROMPT_TOKENS, i)))
                engine.retrieve(tokens)
                engine.retrieve(torch.arange(2 * CHUNK) + 10_000_000 + 100 * i)
                if i >= 70:  # 280 chunks later: LRU evicted it (255 blocks)
                    engine.retrieve(torch.arange(PROMPT_TOKENS) + 1000 * (i - 70))
                i += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failure.append(exc)

    engine = CacheEngine.connect(LAYOUT, socket=daemon.socket, strict=True)
    worker = threading.Thread(target=workload, args=(engine,))
    worker.start()
    previous = None
    try:
        while worker.is_alive():
            samples = fresh_scrape(port)
            scrapes_done += 1
            assert samples[("lmcached_up",)] == 1
            # one instant between two requests: the states add up to the arena's blocks
            assert sum(blocks_by_state(samples).values()) == NUM_BLOCKS
            assert samples[("lmcached_arena_blocks",)] == NUM_BLOCKS
            if previous is not None:
                for name in ("lmcached_hit_chunks_total", "lmcached_miss_chunks_total",
                             "lmcached_stores_total", "lmcached_requests_total"):
                    assert total(samples, name) >= total(previous, name), name
            previous = samples
    finally:
        abandon.set()
        worker.join()
        assert not failure, failure
    assert scrapes_done >= 5

    info = daemon.info()
    samples = fresh_scrape(port)
    hits, misses = engine.hit_tokens, engine.miss_tokens
    engine.close()
    assert samples[("lmcached_up",)] == 1
    model = {"namespace": "1", "model": LAYOUT.model_name}
    # against INFO
    assert total(samples, "lmcached_hit_chunks_total", **model) == info["hits"] > 0
    assert total(samples, "lmcached_miss_chunks_total", **model) == info["misses"] > 0
    assert samples[("lmcached_stores_total",)] == info["stores"]
    assert samples[("lmcached_evictions_total",)] == info["evictions"] > 0
    assert samples[("lmcached_lookups_total",)] == info["lookups"]
    assert samples[("lmcached_requests_total",)] == info["requests"]
    for field, (name, _, is_counter) in EVENT_FIELDS.items():  # the event feed's
        assert samples[(name + "_total" if is_counter else name,)] == info[field], name
    assert info["events_published"] >= info["stores"] > 0
    assert samples[("lmcached_connections_total",)] == info["connections_received"]
    assert samples[("lmcached_stored_bytes_total",)] == info["total_stored_bytes"]
    assert samples[("lmcached_served_bytes_total",)] == info["total_served_bytes"]
    assert samples[("lmcached_cached_bytes",)] == info["stored_bytes"]
    assert samples[("lmcached_used_bytes",)] == info["used_bytes"]
    assert samples[("lmcached_arena_fill_ratio",)] == info["fill_ratio"]
    assert samples[("lmcached_cached_values",)] == info["cached_values"]
    assert samples[("lmcached_block_size_bytes",)] == info["block_bytes"] == 4096
    assert samples[("lmcached_arena_capacity_bytes",)] == info["capacity_bytes"]
    states = blocks_by_state(samples)
    assert states["free"] == info["free_blocks"]
    assert states["ready"] == info["evictable_blocks"]
    assert states["pinned"] + states["detached"] == info["pinned_blocks"]
    assert states["writing"] == info["writing_blocks"]
    assert total(samples, "lmcached_errors_total") == info["errors"]
    # against the workload
    record_bytes = LAYOUT.record_bytes(CHUNK)
    assert info["stores"] == sum(stored)
    assert samples[("lmcached_stored_bytes_total",)] == sum(stored) * record_bytes
    assert samples[("lmcached_served_bytes_total",)] == info["hits"] * record_bytes
    assert total(samples, "lmcached_hit_tokens_total", **model) == hits
    assert total(samples, "lmcached_miss_tokens_total", **model) == misses
    # every request once in the latency histogram, by type
    counts = {t: total(samples, "lmcached_request_duration_seconds_count", type=t)
              for t in ("hello", "alloc", "commit", "acquire", "info")}
    assert all(counts.values()), counts
    assert total(samples, "lmcached_request_duration_seconds_count") == info["requests"]
    for request_type in counts:
        buckets = [total(samples, "lmcached_request_duration_seconds_bucket",
                         type=request_type, le=le)
                   for le in [*map(_go, LATENCY_BUCKETS_S), "+Inf"]]
        assert buckets == sorted(buckets) and buckets[-1] == counts[request_type]
    assert total(samples, "process_resident_memory_bytes") > 0


def _go(bound: float) -> str:
    """A bucket bound as the exposition writes it (Go's float formatting)."""
    from prometheus_client.utils import floatToGoString

    return floatToGoString(bound)


# ------------------------------------------------------------------- error codes
def test_malformed_frames_count_errors_by_code(daemon_factory):
    port = free_port()
    env = {**os.environ, "LMCACHED_METRICS_PORT": str(port),  # through the environment
           "LMCACHED_METRICS_HOST": "127.0.0.2"}
    daemon = daemon_factory("--capacity", "8MiB", env=env)
    with pytest.raises(urllib.error.URLError):  # only the address asked for
        scrape(port)
    before = scrape(port, "127.0.0.2")
    assert total(before, "lmcached_errors_total") == 0
    with socket.socket(socket.AF_UNIX) as raw:  # not msgpack: bad_request, session goes on
        raw.connect(daemon.socket)
        raw.settimeout(30)
        raw.sendall(frame(b"\xc1junk"))
        reply = recv_reply(raw)
    assert isinstance(reply, Error) and reply.code == "bad_request"
    with socket.socket(socket.AF_UNIX) as raw:  # a frame over the limit: dropped
        raw.connect(daemon.socket)
        raw.sendall(frame(b"", MAX_FRAME_BYTES + 1))
        raw.settimeout(30)
        assert raw.recv(1) == b""
    after = fresh_scrape(port, "127.0.0.2")
    assert after[("lmcached_errors_total", ("code", "bad_request"))] == 1
    assert after[("lmcached_errors_total", ("code", "frame_too_large"))] == 1
    info = daemon.info()
    assert (info["errors_bad_request"], info["errors_frame_too_large"]) == (1, 1)
    assert daemon.stop() == 0
    with pytest.raises(urllib.error.URLError):  # the endpoint stopped with the daemon
        scrape(port, "127.0.0.2")


# ----------------------------------------------------------- on, off, port in use
def test_metrics_are_off_by_default(daemon):
    assert psutil.Process(daemon.proc.pid).net_connections(kind="inet") == []
    assert daemon.info()["connected_clients"] == 1  # this INFO: the daemon serves


def serve_and_fail(name: str, socket_path: str, *args: str) -> list[str]:
    """Run a `lmcached serve` that must not start; its stderr lines that mention an error."""
    proc = subprocess.run(
        [sys.executable, "-m", "lmcached.cli", "serve", "--name", name, "--socket",
         socket_path, "--capacity", "8MiB", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert not os.path.exists(socket_path)
    assert list_segments(name) == []
    return [line for line in proc.stderr.splitlines() if "rror" in line]


def test_a_metrics_port_in_use_stops_the_start_up_with_one_error_line(unique_name, short_tmp):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        errors = serve_and_fail(unique_name, os.path.join(short_tmp, "d.sock"),
                                "--metrics-port", str(port))
    assert errors == [f"Error: metrics port {port} on 127.0.0.1 is already in use: choose "
                      "another --metrics-port, or stop the process that listens there"]


def test_a_metrics_host_not_of_this_machine_stops_the_start_up(unique_name, short_tmp):
    errors = serve_and_fail(unique_name, os.path.join(short_tmp, "d.sock"), "--metrics-port",
                            str(free_port()), "--metrics-host", "192.0.2.1")  # TEST-NET-1
    assert len(errors) == 1 and errors[0].startswith(
        "Error: cannot serve metrics on 192.0.2.1 port "), errors
    assert errors[0].endswith(": Cannot assign requested address; check --metrics-host")


# ------------------------------------------------- in process: the pieces alone
def test_latency_buckets_hold_each_observation_at_its_upper_bound():
    from lmcached.wire.protocol import Ping

    latency = RequestLatency([Lookup, Ping])
    for seconds in (3e-6, 1e-5, 3e-5, 2.0):
        latency.observe(Lookup, seconds)
    counts, sum_s = latency.copy()["lookup"]
    bounds = [*LATENCY_BUCKETS_S, float("inf")]
    assert [bounds[i] for i, n in enumerate(counts) for _ in range(n)] == [5e-6, 1e-5, 5e-5,
                                                                          float("inf")]
    assert sum_s == pytest.approx(2.0 + 4.3e-5)
    assert list(latency.copy()) == ["lookup"]  # types never seen are left out


def test_a_scrape_while_the_loop_does_not_serve_says_lmcached_up_0():
    channel = SnapshotChannel()
    names = [family.name for family in DaemonCollector(channel).collect()]
    assert names == ["lmcached_up"]
    channel.attach(lambda: None, lambda: None)  # a loop that never answers
    started = time.monotonic()
    assert channel.request(timeout_s=0.2) is None and time.monotonic() - started >= 0.2
    channel.close()
    assert channel.request() is None and not channel.pending


@pytest.fixture
def service(unique_name):
    arena = Arena.create(unique_name, 1 << 20, 4096, prefault=False)
    yield CacheService(ServerConfig(name=unique_name, socket="/nonexistent",
                                    metrics_port=9), arena)
    arena.close()


def test_hits_and_misses_per_namespace_add_up_to_the_pools(service):
    """Two TP ranks (two namespaces) in one ACQUIRE: each namespace counts its own."""
    ranks = [Layout("tp-llama", 2, rank, "vllm", "bfloat16", 2, 1, 4, 16, 1000)
             for rank in (0, 1)]
    session = service.open_session(os.getpid(), os.getuid(), os.getgid())
    service.handle(session, Hello(PROTOCOL_VERSION, os.getpid(), "t", ranks))
    hashes = b"".join(i.to_bytes(16, "little") for i in range(3))
    for ns, stored in ((1, hashes), (2, hashes[:16])):  # rank 1 has only the first chunk
        reply = service.handle(session, Alloc(ns, stored, [1000] * (len(stored) // 16)))
        service.handle(session, Commit(reply.block_ids))
    service.handle(session, Acquire([1, 2], hashes))
    service.handle(session, Acquire([1], hashes))
    families = {f.name: f for f in metric_families(take_snapshot(service))}
    hits = {s.labels["namespace"]: s.value for s in families["lmcached_hit_chunks"].samples}
    misses = {s.labels["namespace"]: s.value for s in families["lmcached_miss_chunks"].samples}
    assert (hits, misses) == ({"1": 1 + 3, "2": 1}, {"1": 2 + 0, "2": 2})
    assert sum(hits.values()) == service.pool.stats.hits
    assert sum(misses.values()) == service.pool.stats.misses
    tokens = {s.labels["namespace"]: s.value for s in families["lmcached_hit_tokens"].samples}
    assert tokens == {"1": 4 * 16, "2": 16}
    service.close_session(session)
    assert sum(service.latency.copy()["acquire"][0]) == 2


def test_sglang_namespaces_are_counted_as_info_counts_them(service):
    """Two SGLang page namespaces and a vLLM one: the gauge says 2, as INFO does."""
    layouts = [Layout(name, 1, 0, fmt, "uint8", 1, 1, 8, 504, 4096 + 504 * 16)
               for name, fmt in (("sglang/a", "sglang"), ("sglang/b", "sglang"),
                                 ("vllm-model", "vllm"))]
    session = service.open_session(os.getpid(), os.getuid(), os.getgid())
    reply = service.handle(session, Hello(PROTOCOL_VERSION, os.getpid(), "t", layouts))
    assert len(reply.namespaces) == 3
    snap = take_snapshot(service)
    families = {f.name: f for f in metric_families(snap)}
    (sample,) = families["lmcached_namespaces_sglang"].samples
    assert sample.value == snap.info["clients"]["namespaces_sglang"] == 2
    (sample,) = families["lmcached_namespaces"].samples
    assert sample.value == 3
    service.close_session(session)


def test_get_counts_a_hit_or_a_miss_in_its_namespace(service):
    from lmcached.client.adapters.tensor_store import kv_namespace
    from lmcached.wire.protocol import Get, Put

    session = service.open_session(os.getpid(), os.getuid(), os.getgid())
    service.handle(session, Hello(PROTOCOL_VERSION, os.getpid(), "t",
                                  [kv_namespace("store", 1000)]))
    reply = service.handle(session, Put(1, "present", 1000))
    service.handle(session, Commit(reply.block_ids))
    for key in ("present", "absent", "absent"):
        service.handle(session, Get(1, key))
    row, = take_snapshot(service).namespaces
    assert (row.model, row.hit_chunks, row.miss_chunks) == ("store", 1, 2)
    assert (service.pool.stats.hits, service.pool.stats.misses) == (1, 2)
    assert service.stats.served_bytes == 1000 and service.stats.stored_bytes == 1000
    service.close_session(session)


# -------------------------------------------------- docs/metrics.md and the dashboard
DOCS = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "docs")


def exposed_names(service) -> set[str]:
    """The names of every lmcached_* metric as a scrape writes them (counters with
    `_total`, the info metric with `_info`)."""
    l2_on = {"l2_enabled": 1, "l2_state": "up", "l2_queue_bytes": 0, "l2_queue_values": 0,
             **info_fields(L2Stats(), "l2_"), **l2_error_fields({}),
             **dict.fromkeys(L2_COUNTERS, 0)}  # the families of a daemon with --l2
    disk_on = {"disk_enabled": 1, "disk_used_slots": 0, "disk_slots": 0,
               "disk_stored_bytes": 0, **info_fields(DiskStats(), "disk_"),
               **dict.fromkeys(DISK_COUNTERS, 0)}  # the families of a daemon with --disk-path
    tier = DeviceTierRow(tier_id=1, kind="fake", device="fake-0", failed=False,
                         capacity_bytes=0, stored_bytes=0, num_blocks=0,
                         blocks=dict.fromkeys(TIER_BLOCK_STATES, 0), hits=0)
    families = [*metric_families(take_snapshot(service)), *DaemonCollector(
        SnapshotChannel()).collect(), *l2_families(l2_on),
        *device_tier_families([tier], DemotionStats()),
        *disk_families(disk_on)]
    suffix = {"counter": "_total", "info": "_info"}
    return {family.name + suffix.get(family.type, "") for family in families}


def test_docs_list_every_metric_and_the_dashboard_uses_only_those(service):
    with open(os.path.join(DOCS, "metrics.md")) as f:
        documented = set(re.findall(r"^\| `(lmcached_\w+)` \|", f.read(), re.MULTILINE))
    assert documented == exposed_names(service)
    with open(os.path.join(DOCS, "grafana-dashboard.json")) as f:
        dashboard = json.load(f)
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {re.sub(r"_(bucket|count|sum)$", "", name)
            for expr in exprs for name in re.findall(r"\blmcached_\w+", expr)}
    assert used <= documented, used - documented
    for needed in ("lmcached_hit_chunks_total", "lmcached_stored_bytes_total",
                   "lmcached_request_duration_seconds", "lmcached_arena_fill_ratio",
                   "lmcached_evictions_total", "lmcached_errors_total"):
        assert needed in used, needed
    assert any("histogram_quantile(0.99" in e for e in exprs)
    assert any("histogram_quantile(0.5" in e for e in exprs)


def test_the_dashboard_shows_every_disk_and_l2_family(service):
    tiers = {name for name in exposed_names(service)
             if name.startswith(("lmcached_disk_", "lmcached_l2_"))}
    assert len(tiers) >= 20, tiers  # exposed_names turns both tiers on
    with open(os.path.join(DOCS, "grafana-dashboard.json")) as f:
        dashboard = json.load(f)
    shown = {name for panel in dashboard["panels"] for target in panel.get("targets", [])
             for name in re.findall(r"\blmcached_\w+", target["expr"])}
    assert not tiers - shown, f"no dashboard panel shows {sorted(tiers - shown)}"


def test_namespace_rows_are_bounded_and_the_rest_add_up_in_an_other_row(service):
    """One row per namespace for the MAX_NAMESPACE_ROWS busiest only: the rest, and the
    namespaces freed, add up in one "other" row, so every counter's sum over rows still
    equals the pools' and never goes down when a namespace is freed."""
    num_namespaces = MAX_NAMESPACE_ROWS + 10
    layouts = [Layout(f"m{i}", 1, 0, "vllm", "bfloat16", 2, 1, 4, 16, 1000)
               for i in range(num_namespaces)]
    sessions = []
    for i, layout in enumerate(layouts):
        session = service.open_session(os.getpid(), os.getuid(), os.getgid())
        (ns,) = service.handle(session, Hello(PROTOCOL_VERSION, 1, "t", [layout])).namespaces
        for _ in range(i):  # namespace i + 1 has i misses: the last ones are the busiest
            service.handle(session, Acquire([ns], (0).to_bytes(16, "little")))
        sessions.append(session)

    def rows() -> dict[str, tuple[float, float]]:
        families = {f.name: f for f in metric_families(take_snapshot(service))}
        misses = {s.labels["namespace"]: s.value for s in families["lmcached_miss_chunks"].samples}
        tokens = {s.labels["namespace"]: s.value for s in families["lmcached_miss_tokens"].samples}
        assert {s.labels["model"] for s in families["lmcached_miss_chunks"].samples
                if s.labels["namespace"] == OTHER_NAMESPACES} <= {OTHER_NAMESPACES}
        return {ns: (misses[ns], tokens[ns]) for ns in misses}

    before = rows()
    assert len(before) == MAX_NAMESPACE_ROWS + 1
    assert set(before) == {str(ns) for ns in range(11, num_namespaces + 1)} | {OTHER_NAMESPACES}
    assert before[OTHER_NAMESPACES] == (sum(range(10)), 16 * sum(range(10)))
    assert sum(m for m, _ in before.values()) == service.pool.stats.misses
    service.close_session(sessions[-1])  # the busiest namespace is freed (no value)
    after = rows()
    assert str(num_namespaces) not in after and len(after) == MAX_NAMESPACE_ROWS + 1
    # it moved to "other", and namespace 10 (9 misses) got a row of its own instead
    assert after[OTHER_NAMESPACES][0] == before[OTHER_NAMESPACES][0] + (num_namespaces - 1) - 9
    assert sum(m for m, _ in after.values()) == service.pool.stats.misses
    for session in sessions[:-1]:
        service.close_session(session)
    assert rows() == {OTHER_NAMESPACES: (service.pool.stats.misses, 16 * service.pool.stats.misses)}
