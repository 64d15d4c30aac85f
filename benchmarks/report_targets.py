"""The benchmark suite's ops and peers, the ratios between them, and its targets.

Why this file exists: a results dict of `run.py` holds timings; what they are measured
against is defined here: the lmcached ops in display order (`LMCACHED_OPS`, and
`MOVES_BYTES`, the ops whose GB/s mean something), the peers and which of their ops each
lmcached op compares with (`PEERS`, `PEER_OPS`), the speed-ups added to every op
(`compute_ratios`: x memcpy, x each peer) and the suite's targets with met / NOT met
(`evaluate_targets`). report.py renders them.
"""


# lmcached ops in display order; True where the op moves the prompt's KV bytes (GB/s).
LMCACHED_OPS = [
    ("memcpy", True), ("memcpy chunked", True), ("alloc+fill", True), ("store cold", True),
    ("store existing", False), ("lookup", False), ("retrieve out=", True),
    ("retrieve alloc", True), ("views", False), ("views+copy", True), ("verify", False),
    ("cross-process", True),
]
MOVES_BYTES = {op for op, moves in LMCACHED_OPS if moves}
PEERS = [("redis", "Redis"), ("lmcache_inproc", "LMCache in-process"),
         ("lmcache_server", "LMCache server")]
# lmcached op -> the op of each peer it is compared with.
PEER_OPS = {
    "store cold": {"redis": "store", "lmcache_inproc": "store cold", "lmcache_server": "store cold"},
    "store existing": {"lmcache_inproc": "store existing"},
    "lookup": {"redis": "lookup", "lmcache_inproc": "lookup", "lmcache_server": "lookup"},
    "retrieve out=": {"redis": "retrieve", "lmcache_inproc": "retrieve", "lmcache_server": "retrieve"},
    "views+copy": {"redis": "retrieve", "lmcache_inproc": "retrieve", "lmcache_server": "retrieve"},
    "cross-process": {"redis": "retrieve", "lmcache_server": "retrieve"},
}
SCALING_TARGET_TOKENS = 4096


def _fmt_tokens(n: int | str) -> str:
    n = int(n)
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def peer_op(results: dict, peer: str, shape: str, tokens: str, op: str) -> dict | None:
    """A peer's summary for one op, or None when not measured."""
    data = results["peers"].get(peer, {}).get("data", {})
    return data.get(shape, {}).get(tokens, {}).get("ops", {}).get(op)


def compute_ratios(results: dict) -> None:
    """Add `x_memcpy` and `x_<peer>` (speed-up: other time / lmcached time) to every op."""
    for shape, by_tokens in results["lmcached"].items():
        for tokens, entry in by_tokens.items():
            ops = entry["ops"]
            memcpy_s = ops["memcpy"]["median_s"]
            for op, stats in ops.items():
                stats["x_memcpy"] = memcpy_s / stats["median_s"]
                for peer, peer_op_name in PEER_OPS.get(op, {}).items():
                    other = peer_op(results, peer, shape, tokens, peer_op_name)
                    if other:
                        stats[f"x_{peer}"] = other["median_s"] / stats["median_s"]
            for peer, _ in PEERS:
                data = results["peers"].get(peer, {}).get("data", {})
                for op_stats in data.get(shape, {}).get(tokens, {}).get("ops", {}).values():
                    op_stats["x_memcpy"] = memcpy_s / op_stats["median_s"]


def _target(name: str, met: bool | None, value: str, note: str = "") -> dict:
    return {"target": name, "met": met, "value": value, "note": note}


def evaluate_targets(results: dict) -> list[dict]:
    """The suite's targets with their measured values; met is None when not measured."""
    targets = []
    for shape, by_tokens in results["lmcached"].items():
        lengths = sorted(by_tokens, key=int)
        at = "16384" if "16384" in by_tokens else lengths[-1]
        note = "" if at == "16384" else "16k not measured in this mode: checked at the longest length run"
        ops = by_tokens[at]["ops"]
        label = f"{shape} @{_fmt_tokens(at)}"
        for op, title in (("store cold", "store"), ("retrieve out=", "retrieve (copy)")):
            x = ops[op]["x_memcpy"]
            targets.append(_target(f"{title} >= 0.7x memcpy, {label}", x >= 0.7, f"{x:.3f}x", note))
        views_ms = ops["views"]["median_s"] * 1e3
        targets.append(_target(f"retrieve_views < 1 ms, {label}", views_ms < 1,
                               f"{views_ms:.3f} ms", note))
        share = ops["store existing"]["median_s"] / ops["store cold"]["median_s"]
        targets.append(_target(f"re-store of a stored prompt < 2% of a cold store, {label}",
                               share < 0.02, f"{share * 100:.2f}%", note))
    for peer, factor in (("redis", 5), ("lmcache_inproc", 3), ("lmcache_server", 3)):
        info = results["peers"].get(peer, {})
        peer_name = dict(PEERS)[peer]
        if not info.get("data"):
            targets.append(_target(f">= {factor}x {peer_name} on store and retrieve at 4k and 16k",
                                   None, "not measured", f"{info.get('status', 'not run')}"
                                   + (f": {info['reason'][:300]}" if info.get("reason") else "")))
            continue
        for shape, by_tokens in results["lmcached"].items():
            for tokens in ("4096", "16384"):
                if tokens not in by_tokens:
                    continue  # not run in this mode
                for op, title in (("store cold", "store"), ("retrieve out=", "retrieve")):
                    name = f">= {factor}x {peer_name} on {title}, {shape} @{_fmt_tokens(tokens)}"
                    x = by_tokens[tokens]["ops"][op].get(f"x_{peer}")
                    if x is None:
                        skipped = results.get("skipped", {})
                        why = next((v for k, v in skipped.items() if shape in k and tokens in k),
                                   f"{peer_name} has no figure here")
                        targets.append(_target(name, None, "not measured", why))
                    else:
                        targets.append(_target(name, x >= factor, f"{x:.1f}x"))
    scaling = results.get("scaling")
    if scaling and scaling.get("rounds"):
        rounds = {r["clients"]: r for r in scaling["rounds"]}
        last = rounds[max(rounds)]
        single = rounds[min(rounds)]
        total_errors = sum(r["errors"] for r in scaling["rounds"])
        targets.append(_target(f"{last['clients']} clients: no errors", total_errors == 0,
                               f"{last['errors']} errors ({total_errors} in all rounds)"))
        ratio = last["retrieve"]["p99_ms"] / single["retrieve"]["median_ms"]
        targets.append(_target(
            f"{last['clients']} clients: p99 of a {_fmt_tokens(scaling['num_tokens'])}-token retrieve "
            f"< 3x its single-client median", ratio < 3,
            f"{ratio:.1f}x ({last['retrieve']['p99_ms']:.1f} ms vs {single['retrieve']['median_ms']:.1f} ms)",
            "closed loop: every client copies at memory speed back to back; see the paced round"))
        paced = scaling.get("paced")
        if paced:
            ratio = paced["retrieve"]["p99_ms"] / single["retrieve"]["median_ms"]
            targets.append(_target(
                f"{paced['clients']} clients paced at {paced['paced_load']:.0%} of one client's load: "
                f"p99 retrieve < 3x single-client median", ratio < 3,
                f"{ratio:.1f}x ({paced['retrieve']['p99_ms']:.1f} ms)", "informative, open loop"))
        growth = last["daemon_rss_private_bytes"] - single["daemon_rss_private_bytes"]
        targets.append(_target(f"daemon RSS flat from 1 to {last['clients']} clients",
                               abs(growth) < 4 << 20,
                               f"private RSS {single['daemon_rss_private_bytes'] / 2**20:.1f} -> "
                               f"{last['daemon_rss_private_bytes'] / 2**20:.1f} MiB"))
    memory = results.get("memory")
    if memory and "after" in memory:
        growth = memory["rss_private_growth_bytes"]
        targets.append(_target(f"daemon memory flat over {memory['cycles']:,} store/evict cycles",
                               abs(growth) < 1 << 20,
                               f"private RSS {growth / 2**10:+.0f} KiB, RSS "
                               f"{memory['rss_growth_bytes'] / 2**10:+.0f} KiB, "
                               f"{memory['evictions_during_cycles']:,} evictions"))
    return targets
