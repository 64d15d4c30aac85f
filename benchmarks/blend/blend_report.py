"""The CacheBlend benchmark's report: tables (console and markdown) and the quality/TTFT plot.

Why this file exists: benchmarks/blend/bench_blend.py measures; this module turns its results
dict (the JSON kept in benchmarks/results/) into what a reader compares, so an old JSON can
be re-rendered without re-running anything:

    python -m benchmarks.blend.blend_report benchmarks/results/<date>-blend.json
"""

import json
import math
import os
import sys

from benchmarks.report import json_default, report_main

QUALITY_HEADER = ["method", "KL continue", "KL fact", "KL p90 (all)", "top-1 agree continue",
                  "top-1 agree fact", "acc continue", "acc 1-hop", "acc 2-hop", "recomputed"]
# Methods in display order (bench_blend.methods() plus the two references).
ORDER = ["full", "prefix", "cacheblend 0", "cacheblend 0.05", "cacheblend 0.15",
         "cacheblend 0.3", "cacheblend 1", "legolink 1", "legolink 4", "legolink 16"]


def _table(header: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header)] + [fmt.format(*r) for r in rows])


def _fmt_tokens(n: int | str) -> str:
    n = int(n)
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _kl(x: float) -> str:
    return "0" if x == 0 else f"{x:.2e}" if x < 1e-2 else f"{x:.3f}"


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.1f}" if ms < 100 else f"{ms:.0f}"


def _pct(x: float) -> str:
    return "-" if x != x else f"{x:.1%}"  # NaN: no prompt of that kind


def quality_rows(quality: dict) -> list[list[str]]:
    rows = []
    for name in ORDER:
        m = quality["methods"].get(name)
        if m is None:
            continue
        rows.append([name, _kl(m["kl_mean_continue"]), _kl(m["kl_mean_fact"]), _kl(m["kl_p90"]),
                     _pct(m["top1_agreement_continue"]), _pct(m["top1_agreement_fact"]),
                     _pct(m["accuracy_continue"]), _pct(m["accuracy_1_hop"]),
                     _pct(m["accuracy_2_hop"]), _pct(m["recomputed_fraction_mean"])])
    return rows


def speed_rows(by_length: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows: one row per method, one column per prompt length,
    "median ms (min ms) speed-up" where speed-up = full's median / the method's median."""
    lengths = sorted(by_length, key=int)
    header = ["method"] + [f"{_fmt_tokens(n)}: ms (min) speed-up" for n in lengths]
    names = [n for n in ORDER if any(n in by_length[k]["methods"] for k in lengths)]
    rows = []
    for name in names:
        row = [name]
        for n in lengths:
            m = by_length[n]["methods"].get(name)
            row.append(f"{_ms(m['median_s'])} ({_ms(min(m['samples_s']))}) {m['x_full']:.2f}x"
                       if m else "-")
        rows.append(row)
    rows.append(["(store_segments, once)"] + [_ms(by_length[n]["store_s"]) for n in lengths])
    return header, rows


def render(results: dict, markdown: bool) -> str:
    """The whole report as text (markdown=False: aligned console columns)."""
    def h(level: int, text: str) -> str:
        return f"{'#' * level} {text}" if markdown else f"\n{text}\n{'=' * len(text)}"

    meta, model, quality = results["meta"], results["model"], results["quality"]
    machine = meta["machine"]
    train = model["train"]
    out = [h(1, f"CacheBlend quality and TTFT ({meta['date']}, {meta['mode']})"), ""]
    out.append(f"Command: `{meta['command']}`; {meta['duration_s']:.0f} s in all. Machine: "
               f"{machine['cpu']}, {machine['num_cpus']} CPUs (shared), torch "
               f"{machine['torch']}, {meta['threads']} torch threads, load average at start "
               f"{machine['loadavg_at_start'][0]:.2f}; devices {', '.join(meta['devices'])}"
               + (f" ({meta['cuda']})" if meta.get("cuda") else "") + ".")
    out.append("")
    out.append(f"Model: Llama {model['model']['num_hidden_layers']} layers, hidden "
               f"{model['model']['hidden_size']}, {train['num_params'] / 1e6:.2f}M params, "
               f"trained {train['steps_done']} steps ({train['tokens']:,} tokens, "
               f"{train['seconds']:.0f} s) by benchmarks/blend/train_blend_model.py; final loss "
               f"{train['lm_loss']:.3f}, fact-value loss {train['answer_loss']:.3f}; held-out "
               f"accuracy under full prefill: continuation tokens "
               f"{model['accuracy']['continue']:.1%}, facts 1-hop {model['accuracy']['1_hop']:.1%}, "
               f"2-hop {model['accuracy']['2_hop']:.1%} ({model['accuracy']['num_prompts']} "
               "prompts).")
    out.append("")
    kinds = quality["num_prompts_by_kind"]
    out.append(h(2, f"Quality against a full prefill ({quality['num_prompts']} prompts of 4-6 of "
                    f"{quality['pool_docs']} stored chunks; median "
                    f"{quality['prompt_tokens_median']:.0f} tokens)"))
    out.append(f"{kinds['continue']} \"continue\" prompts ({quality['answer_positions']['continue']}"
               f" answer positions each: the text of the chunk that follows the prompt's last one) "
               f"and {kinds['fact_1_hop']} + {kinds['fact_2_hop']} \"fact\" prompts (1-hop + 2-hop; "
               f"{quality['answer_positions']['fact']} answer positions each). KL(full || method) in "
               "nats per answer position, teacher-forced (the answer is fed after the prompt over "
               "the method's KV); top-1 agree: argmax equal to the full prefill's; acc continue: "
               "argmax equal to the true next token; acc 1-hop / 2-hop: both values are the "
               "argmax; recomputed: tokens computed through every layer / prompt tokens.")
    out.append("")
    out.append(_table(QUALITY_HEADER, quality_rows(quality), markdown))
    out.append("")
    for label, by_device in results["speed"].items():
        for device, by_length in by_device.items():
            title = "trained model (3.4M params)" if label == "trained" else \
                "random-weight Llama, 8 layers, hidden 1024"
            runs = len(by_length[min(by_length, key=int)]["methods"]["full"]["samples_s"])
            out.append(h(2, f"TTFT, {title}, {device} (median and min of {runs} timed runs "
                            "after a warm-up, methods interleaved; speed-up = full prefill's "
                            "median / the method's)"))
            header, rows = speed_rows(by_length)
            out.append(_table(header, rows, markdown))
            out.append("")
    out.append("TTFT prompts: documents of 512 tokens stored alone, a 3-token question; each "
               "method's num_recomputed_tokens is in the JSON. The plot pairs these TTFTs with "
               "the KL of the quality prompts, whose chunks are short (LegoLink's recompute "
               "share differs between the two).")
    return "\n".join(out)


def plot_quality_vs_ttft(results: dict, path: str) -> None:
    """KL(full || method) (log) against TTFT relative to a full prefill, per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    quality = results["quality"]["methods"]
    # Exact methods (full, prefix, cacheblend 1) have KL ~1e-14: drawn at a floor a decade
    # under the smallest KL of an inexact one.
    inexact = [m["kl_mean_continue"] for m in quality.values() if m["kl_mean_continue"] > 1e-9]
    floor = 10 ** (math.floor(math.log10(min(inexact))) - 1) if inexact else 1e-9
    fig, ax = plt.subplots(figsize=(8, 5.5))
    markers = {"trained": "o", "random_8l_1024": "s"}
    for label, by_device in results["speed"].items():
        for device, by_length in by_device.items():
            # The longest length with the most methods timed.
            longest = max(by_length, key=lambda n: (len(by_length[n]["methods"]), int(n)))
            speed = by_length[longest]["methods"]
            names = [n for n in ORDER if n in speed and n in quality]
            xs = [speed[n]["median_s"] / speed["full"]["median_s"] for n in names]
            ys = [max(quality[n]["kl_mean_continue"], floor) for n in names]
            model = "trained 3.4M" if label == "trained" else "random 8L/1024"
            line, = ax.plot(xs, ys, linestyle="none", marker=markers.get(label, "^"),
                    label=f"TTFT of {model}, {device}, {_fmt_tokens(longest)} tokens")
            for x, y, n in zip(xs, ys, names):
                ax.annotate(n, (x, y), textcoords="offset points", fontsize=7,
                            xytext=(4, 3) if label == "trained" else (4, -9),
                            color=line.get_color())
    ax.set_yscale("log")
    ax.set_xlabel("TTFT / TTFT of a full prefill (lower is faster)")
    ax.set_ylabel(f"mean KL(full || method) per continuation token, nats\n"
                  f"(trained model; drawn at {floor:g}: exact)")
    ax.set_title(f"CacheBlend / LegoLink: quality vs TTFT ({results['meta']['date']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(results: dict, out_dir: str, stem: str) -> dict:
    """Write <stem>.json first, then <stem>.md and <stem>-quality.png; returns their paths.

    The plot is skipped with a message when matplotlib is not installed
    (`pip install -e .[bench]`).
    """
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, f"{stem}.json"),
             "markdown": os.path.join(out_dir, f"{stem}.md")}
    with open(paths["json"], "w") as f:
        json.dump(results, f, indent=1, default=json_default)
    png = os.path.join(out_dir, f"{stem}-quality.png")
    try:
        plot_quality_vs_ttft(results, png)
        paths["png"] = png
    except ImportError as exc:
        print(f"plot skipped: {exc} (pip install matplotlib, or .[bench])", file=sys.stderr)
    markdown = render(results, markdown=True)
    if "png" in paths:
        markdown += f"\n![quality vs TTFT]({os.path.basename(png)})\n"
    with open(paths["markdown"], "w") as f:
        f.write(markdown + "\n")
    return paths


def main() -> int:
    return report_main("benchmarks.blend.blend_report", write_outputs, render)


if __name__ == "__main__":
    sys.exit(main())
