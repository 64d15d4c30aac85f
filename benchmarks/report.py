"""The benchmark report: console and markdown tables, PNG plots, the report files.

Why this file exists: `run.py` measures; this module turns its results dict (the JSON
kept in benchmarks/results/) into what a reader compares: every lmcached figure with its
ratio to the memcpy limit measured in the same run (scenario 1) and to each peer, the
suite's targets with met / NOT met (both computed by report_targets.py), and two plots
(bandwidth vs prompt length, latency vs concurrent clients). It reads only the results
dict, so an old JSON can be re-rendered:

    python -m benchmarks.report benchmarks/results/2026-11-23.json
"""

import json
import math
import os
import sys
from typing import Callable

from benchmarks.report_targets import (LMCACHED_OPS, PEERS, _fmt_tokens, compute_ratios,
                                       evaluate_targets, peer_op)

def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"


# --------------------------------------------------------------------- tables
def _lmcached_rows(results: dict, shape: str, tokens: str) -> list[list[str]]:
    entry = results["lmcached"][shape][tokens]
    rows = []
    for op, moves in LMCACHED_OPS:
        stats = entry["ops"].get(op)
        if not stats:
            continue
        row = [op, _ms(stats["median_s"]), _ms(stats["p90_s"]),
               f"{stats['gbps']:.2f}" if moves else "-", f"{stats['x_memcpy']:.2f}x"]
        for peer, _ in PEERS:
            x = stats.get(f"x_{peer}")
            row.append(f"{x:.1f}x" if x is not None else "-")
        rows.append(row)
    for peer, peer_name in PEERS:
        data = results["peers"].get(peer, {}).get("data", {})
        for op, stats in data.get(shape, {}).get(tokens, {}).get("ops", {}).items():
            moves = op not in ("lookup", "store existing")
            rows.append([f"{peer_name}: {op}", _ms(stats["median_s"]), _ms(stats["p90_s"]),
                         f"{stats['gbps']:.2f}" if moves and "gbps" in stats else "-",
                         f"{stats['x_memcpy']:.2f}x", "", "", ""])
    return rows


def _table(header: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |",
                 "|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = lambda row: "  ".join(  # noqa: E731
        str(x).ljust(w) if i == 0 else str(x).rjust(w) for i, (x, w) in enumerate(zip(row, widths)))
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


DETAIL_HEADER = ["op", "median ms", "p90 ms", "GB/s", "x memcpy", "x Redis",
                 "x LMCache in-proc", "x LMCache server"]


def summary_rows(results: dict) -> list[list[str]]:
    """One row per shape and length: the headline figures and their ratios."""
    rows = []
    for shape, by_tokens in results["lmcached"].items():
        for tokens in sorted(by_tokens, key=int):
            ops = by_tokens[tokens]["ops"]

            def bw(op):
                stats = ops.get(op)
                return f"{stats['gbps']:.1f} ({stats['x_memcpy']:.2f}x)" if stats else "-"

            def peer_bw(peer, op):
                stats = peer_op(results, peer, shape, tokens, op)
                return f"{stats['gbps']:.2f}" if stats and "gbps" in stats else "-"

            rows.append([
                shape, _fmt_tokens(tokens), f"{by_tokens[tokens]['nbytes'] / 2**30:.3g}",
                f"{ops['memcpy']['gbps']:.1f}", bw("store cold"), bw("retrieve out="),
                bw("cross-process"), _ms(ops["views"]["median_s"]),
                f"{ops['store existing']['median_s'] / ops['store cold']['median_s'] * 100:.2f}%",
                f"{ops['lookup']['median_s'] * 1e6:.0f}",
                f"{peer_bw('redis', 'store')} / {peer_bw('redis', 'retrieve')}",
                f"{peer_bw('lmcache_inproc', 'store cold')} / {peer_bw('lmcache_inproc', 'retrieve')}",
                f"{peer_bw('lmcache_server', 'store cold')} / {peer_bw('lmcache_server', 'retrieve')}",
            ])
    return rows


SUMMARY_HEADER = ["KV shape", "tokens", "GiB", "memcpy GB/s", "store GB/s (x memcpy)",
                  "retrieve GB/s (x memcpy)", "cross-process retrieve GB/s", "retrieve_views ms",
                  "re-store / cold store", "lookup us", "Redis store / retrieve GB/s",
                  "LMCache in-proc store / retrieve GB/s", "LMCache server store / retrieve GB/s"]


def scaling_rows(scaling: dict) -> list[list[str]]:
    rows = []
    entries = list(scaling["rounds"]) + ([scaling["paced"]] if scaling.get("paced") else [])
    for r in entries:
        label = str(r["clients"]) + (f" paced {r['paced_load']:.0%}" if r.get("period_s") else "")
        rows.append([label, f"{r['aggregate_gbps']:.2f}", f"{r['requests_per_s']:.0f}",
                     f"{r['retrieve']['p50_ms']:.1f}", f"{r['retrieve']['p99_ms']:.1f}",
                     f"{r['store']['p50_ms']:.1f}", f"{r['store']['p99_ms']:.1f}",
                     f"{r['hit_ratio']:.3f}", f"{r['daemon_cpu_pct']:.1f}",
                     f"{r['daemon_rss_private_bytes'] / 2**20:.1f}", str(r["evictions"]),
                     str(r["nospace_chunks"]), str(r["errors"])])
    return rows


SCALING_HEADER = ["clients", "aggregate GB/s", "requests/s", "retrieve p50 ms", "retrieve p99 ms",
                  "store p50 ms", "store p99 ms", "hit ratio", "daemon CPU %",
                  "daemon private RSS MiB", "evictions", "NOSPACE chunks", "errors"]


def memory_rows(memory: dict) -> list[list[str]]:
    rows = []
    for label, snap in (("empty (no layout yet)", memory["empty"]), ("arena full", memory["before"]),
                        (f"after {memory['cycles']:,} cycles", memory["after"])):
        rows.append([label, f"{snap['rss_bytes'] / 2**20:.1f}", f"{snap['rss_private_bytes'] / 2**20:.2f}",
                     f"{snap['capacity_bytes'] / 2**20:.1f}", f"{snap['used_bytes'] / 2**20:.2f}",
                     f"{snap['stored_bytes'] / 2**20:.2f}", str(snap["block_bytes"]),
                     f"{snap['fill_ratio']:.4f}", str(snap["cached_blocks"]), f"{snap['evictions']:,}"])
    return rows


MEMORY_HEADER = ["state", "RSS MiB", "private RSS MiB", "arena MiB", "used MiB", "stored MiB",
                 "block bytes", "fill ratio", "cached blocks", "evictions"]


def target_rows(targets: list[dict]) -> list[list[str]]:
    verdict = {True: "met", False: "NOT met", None: "not measured"}
    return [[t["target"], verdict[t["met"]], t["value"], t["note"]] for t in targets]


def render(results: dict, markdown: bool) -> str:
    """The whole report as text (console) or markdown."""
    meta, machine = results["meta"], results["meta"]["machine"]
    h = (lambda level, text: f"{'#' * level} {text}") if markdown else (lambda level, text: text.upper() if level < 3 else text)
    out = []
    if markdown:
        out.append(f"# lmcached benchmarks, {meta['date']} ({meta['mode']})\n")
    out.append(f"Command: `{meta['command']}`  ")
    out.append(f"Machine: {machine['cpu']}, {machine['num_cpus']} CPUs, "
               f"{machine['memory_bytes'] / 2**30:.0f} GiB RAM, {machine['kernel']}, "
               f"{machine['libc']}, Python {machine['python']}, torch {machine['torch']}, "
               f"numpy {machine['numpy']}; load average at start {machine['loadavg_at_start'][0]:.2f}; "
               f"{meta['duration_s']:.0f} s in all.  ")
    for note in meta["notes"]:
        out.append(f"- {note}")
    out.append("")
    out.append(h(2, "Summary (medians; ratio to np.copyto of the same bytes in the same run)"))
    out.append(_table(SUMMARY_HEADER, summary_rows(results), markdown))
    out.append("")
    out.append(h(2, "Targets (issue 6)"))
    out.append(_table(["target", "verdict", "value", "note"], target_rows(results["targets"]), markdown))
    out.append("")
    out.append(h(2, "Peers"))
    for peer, peer_name in PEERS:
        info = results["peers"].get(peer, {"status": "not run"})
        line = f"- {peer_name}: {info['status']}"
        if info.get("versions"):
            line += " (" + ", ".join(f"{k} {v}" for k, v in info["versions"].items()) + ")"
        if info.get("reason"):
            line += f": {info['reason']}"
        out.append(line)
        for note in info.get("notes", []):
            out.append(f"  - {note}")
    out.append("")
    out.append(h(2, "Every op (median and p90 of the runs; x = other's time / lmcached's time)"))
    for shape, by_tokens in results["lmcached"].items():
        for tokens in sorted(by_tokens, key=int):
            entry = by_tokens[tokens]
            out.append(h(3, f"{shape}, {_fmt_tokens(tokens)} tokens "
                            f"({entry['nbytes'] / 2**30:.3g} GiB), {entry['repeat']} runs"))
            out.append(_table(DETAIL_HEADER, _lmcached_rows(results, shape, tokens), markdown))
            out.append("")
    for shape, reason in results.get("skipped", {}).items():
        out.append(f"- skipped {shape}: {reason}")
    scaling = results.get("scaling")
    if scaling and scaling.get("rounds"):
        out.append(h(2, f"Scaling: {scaling['layout']}, {_fmt_tokens(scaling['num_tokens'])}-token "
                        f"requests ({scaling['prompt_bytes'] / 2**20:.0f} MiB), "
                        f"{scaling['read_fraction']:.0%} retrieve of {scaling['num_shared_prefixes']} "
                        f"shared prefixes / {1 - scaling['read_fraction']:.0%} store of new prompts, "
                        f"arena {scaling['arena_capacity_bytes'] / 2**30:.2f} GiB, "
                        f"{scaling['duration_s']:g} s per round"))
        out.append(_table(SCALING_HEADER, scaling_rows(scaling), markdown))
        out.append("")
    elif scaling:
        out.append(f"Scaling: {scaling.get('error')}")
    memory = results.get("memory")
    if memory and "after" in memory:
        out.append(h(2, f"Memory: {memory['layout']} shape ({memory['chunk_kv_bytes'] // 1024} KiB "
                        f"per chunk), {memory['cycles']:,} store/evict cycles in "
                        f"{memory['seconds']:.1f} s, a new session every {memory['reconnect_every']}"))
        out.append(_table(MEMORY_HEADER, memory_rows(memory), markdown))
        out.append("")
        out.append(f"Overhead per block: {memory['record_header_bytes']} bytes of record header and "
                   f"token ids + {memory['block_padding_bytes']} bytes of padding to whole pages; "
                   f"daemon private memory {memory['private_bytes_per_block']:.0f} bytes per block; "
                   f"{memory['unused_arena_bytes']} bytes of the arena unused (its header and tail). "
                   f"RSS counts the arena (shared memory) once touched: private RSS = RSS - shared.")
        out.append("")
    elif memory:
        out.append(f"Memory: {memory.get('error')}")
    if results.get("errors"):
        out.append(h(2, "Errors"))
        out += [f"- {e}" for e in results["errors"]]
    return "\n".join(out)


# ---------------------------------------------------------------------- plots
def plot_bandwidth(results: dict, path: str) -> None:
    """GB/s vs prompt length, one panel per KV shape, lmcached and peers (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(results["lmcached"])
    fig, axes = plt.subplots(1, len(shapes), figsize=(6.5 * len(shapes), 5), squeeze=False)
    series = [
        ("lmcached", "memcpy", "memcpy (np.copyto, the limit)", "black", "--", "o"),
        ("lmcached", "store cold", "lmcached store", "tab:blue", "-", "o"),
        ("lmcached", "retrieve out=", "lmcached retrieve", "tab:blue", "-", "s"),
        ("lmcached", "cross-process", "lmcached cross-process retrieve", "tab:cyan", ":", "^"),
        ("redis", "store", "Redis store", "tab:red", "-", "o"),
        ("redis", "retrieve", "Redis retrieve", "tab:red", "-", "s"),
        ("lmcache_inproc", "store cold", "LMCache in-process store", "tab:green", "-", "o"),
        ("lmcache_inproc", "retrieve", "LMCache in-process retrieve", "tab:green", "-", "s"),
        ("lmcache_server", "store cold", "LMCache server store", "tab:purple", "-", "o"),
        ("lmcache_server", "retrieve", "LMCache server retrieve", "tab:purple", "-", "s"),
    ]
    for ax, shape in zip(axes[0], shapes):
        lengths = sorted(results["lmcached"][shape], key=int)
        for source, op, label, color, style, marker in series:
            xs, ys = [], []
            for tokens in lengths:
                if source == "lmcached":
                    stats = results["lmcached"][shape][tokens]["ops"].get(op)
                else:
                    stats = peer_op(results, source, shape, tokens, op)
                if stats and stats.get("gbps"):
                    xs.append(int(tokens))
                    ys.append(stats["gbps"])
            if xs:
                ours = source == "lmcached" and op != "memcpy"
                ax.plot(xs, ys, linestyle=style, marker=marker, color=color, label=label,
                        markerfacecolor="white" if marker == "s" else color,
                        linewidth=2.4 if ours else 1.4, zorder=3 if ours else 2)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([int(t) for t in lengths], [_fmt_tokens(t) for t in lengths])
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("GB/s (1 GB = 1e9 bytes; higher is better)")
        token_kib = results["shapes"][shape]["token_bytes"] // 1024
        ax.set_title(f"{shape} ({token_kib} KiB/token, chunk 256)")
        ax.grid(True, which="both", alpha=0.3)
        ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator(
            [0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50]))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(f"Store / retrieve bandwidth vs prompt length ({results['meta']['date']}, "
                 f"{results['meta']['mode']}, {results['meta']['machine']['num_cpus']} CPUs)")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency(results: dict, path: str) -> None:
    """Request latency (p50 / p99) and aggregate GB/s vs concurrent client processes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scaling = results["scaling"]
    rounds = scaling["rounds"]
    clients = [r["clients"] for r in rounds]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for op, color in (("retrieve", "tab:blue"), ("store", "tab:orange")):
        ax.plot(clients, [r[op]["p50_ms"] for r in rounds], "-o", color=color, label=f"{op} p50")
        ax.plot(clients, [r[op]["p99_ms"] for r in rounds], "--s", color=color,
                markerfacecolor="white", label=f"{op} p99")
    single = rounds[0]["retrieve"]["median_ms"]
    ax.axhline(3 * single, color="gray", linestyle=":", label="target: 3x 1-client retrieve median")
    ax.plot(clients, [single * c for c in clients], color="gray", linestyle="--", linewidth=0.8,
            label="1-client median x clients (equal shares of memory bandwidth)")
    paced = scaling.get("paced")
    if paced:
        ax.plot([paced["clients"]], [paced["retrieve"]["p99_ms"]], "*", color="tab:green",
                markersize=14, label=f"retrieve p99, {paced['clients']} clients paced at "
                                     f"{paced['paced_load']:.0%} load")
    ax.set_xscale("log", base=2)
    ax.set_xticks(clients, [str(c) for c in clients])
    ax.set_xlabel("concurrent client processes (closed loop)")
    ax.set_ylabel("request latency, ms (lower is better)")
    ax.set_title(f"Latency per {_fmt_tokens(scaling['num_tokens'])}-token request "
                 f"({scaling['layout']}, {scaling['prompt_bytes'] / 2**20:.0f} MiB)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax2.plot(clients, [r["aggregate_gbps"] for r in rounds], "-o", color="tab:blue",
             label="aggregate GB/s (retrieved + stored)")
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(clients, [str(c) for c in clients])
    ax2.set_xlabel("concurrent client processes")
    ax2.set_ylabel("aggregate GB/s", color="tab:blue")
    ax2.set_ylim(bottom=0)
    ax2.grid(True, alpha=0.3)
    ax3 = ax2.twinx()
    ax3.plot(clients, [r["daemon_cpu_pct"] for r in rounds], "--^", color="tab:red",
             label="daemon CPU % (one core = 100)")
    ax3.set_ylabel("daemon CPU %", color="tab:red")
    ax3.set_ylim(0, max(100, max(r["daemon_cpu_pct"] for r in rounds) * 1.2))
    lines = ax2.get_legend_handles_labels()[0] + ax3.get_legend_handles_labels()[0]
    ax2.legend(lines, [line.get_label() for line in lines], fontsize=8, loc="lower right")
    ax2.set_title(f"Throughput and daemon CPU ({scaling['read_fraction']:.0%} retrieve / "
                  f"{1 - scaling['read_fraction']:.0%} store, constant eviction)")
    fig.suptitle(f"lmcached with concurrent clients ({results['meta']['date']}, "
                 f"{results['meta']['machine']['num_cpus']} CPUs)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(results: dict, out_dir: str, stem: str) -> dict:
    """Write <stem>.json and <stem>.md, then the PNGs; returns the paths written.

    The results are written before any plot is drawn, so a missing or failing matplotlib
    loses no figure: the plots are skipped with a message.
    """
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, f"{stem}.json"),
             "markdown": os.path.join(out_dir, f"{stem}.md")}
    plots = {}
    if results["lmcached"]:
        plots["bandwidth_png"] = (plot_bandwidth, os.path.join(out_dir, f"{stem}-bandwidth.png"))
    if results.get("scaling", {}).get("rounds"):
        plots["latency_png"] = (plot_latency, os.path.join(out_dir, f"{stem}-latency.png"))
    try:
        import matplotlib  # noqa: F401  (only to know whether plots can be drawn)
    except ImportError:
        print("report: matplotlib is not installed; plots skipped "
              "(pip install 'lmcached[bench]')", file=sys.stderr)
        plots = {}
    paths.update({name: path for name, (_, path) in plots.items()})
    results["outputs"] = {k: os.path.basename(v) for k, v in paths.items()}
    markdown = render(results, markdown=True)
    images = [f"![{name}]({os.path.basename(p)})" for name, p in paths.items() if p.endswith(".png")]
    with open(paths["markdown"], "w") as f:
        f.write(markdown + "\n\n" + "\n".join(images) + "\n")
    with open(paths["json"], "w") as f:
        json.dump(results, f, indent=1, default=json_default)
    for plot, path in plots.values():
        plot(results, path)
    return paths


def json_default(value):
    """`json.dump` default of benchmark results: NaN as null, tensors and arrays as lists."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"cannot serialize {type(value)}")


def report_main(module: str, write_outputs: Callable[[dict, str, str], dict],
                render: Callable[..., str],
                prepare: Callable[[dict], None] | None = None) -> int:
    """`python -m <module> RESULTS.json`: read the results, `prepare` them in place (if
    given), write the report files beside RESULTS.json (`write_outputs(results, its
    folder, its name without .json)`) and print the text report (`render(results,
    markdown=False)`).

    Returns:
        The exit status: 0, or 2 (usage printed) without exactly one argument.
    """
    if len(sys.argv) != 2:
        print(f"usage: python -m {module} RESULTS.json", file=sys.stderr)
        return 2
    with open(sys.argv[1]) as f:
        results = json.load(f)
    if prepare is not None:
        prepare(results)
    stem = os.path.splitext(os.path.basename(sys.argv[1]))[0]
    write_outputs(results, os.path.dirname(os.path.abspath(sys.argv[1])), stem)
    print(render(results, markdown=False))
    return 0


def _add_ratios_and_targets(results: dict) -> None:
    compute_ratios(results)
    results["targets"] = evaluate_targets(results)


def main() -> int:
    return report_main("benchmarks.report", write_outputs, render, _add_ratios_and_targets)


if __name__ == "__main__":
    sys.exit(main())
