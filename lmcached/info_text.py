"""Text rendering of INFO and CLIENTS replies for the CLI, after redis-cli.

`# Section` headers and `snake_case:value` lines for INFO; one `key=value` line per
client for CLIENTS. The daemon builds the fields (`info.py`); their names never change
once shipped; scripts use `--json`.
"""


def render_info(sections: dict[str, dict[str, int | float | str]]) -> str:
    """INFO sections as text: a `# Name` header, then `field:value` lines, per section."""
    lines = []
    for name, fields in sections.items():
        if lines:
            lines.append("")
        lines.append(f"# {name.capitalize()}")
        lines.extend(f"{field}:{value}" for field, value in fields.items())
    return "\n".join(lines)


def blocks_note(sections: dict[str, dict[str, int | float | str]]) -> str | None:
    """Why INFO shows block_bytes or num_blocks 0, or None when it shows neither.

    The arena (capacity_bytes) is created and prefaulted at start, but without
    --block-size it is cut into blocks only when the first layout arrives in a HELLO
    (docs/architecture.md, "Block size").
    """
    if sections.get("memory", {}).get("block_bytes", 1) and \
            sections.get("blocks", {}).get("num_blocks", 1):
        return None
    return ("note: block_bytes and num_blocks are 0 because no client has sent a layout "
            "yet. The arena is allocated, but without --block-size it is cut into blocks "
            "when the first layout arrives (block size: that layout's chunk record, rounded "
            "up to 4 KiB, or cut in equal pieces where the arena would hold fewer than 16). "
            "Start the daemon with --block-size to cut it at start.")


def loading_note(sections: dict[str, dict[str, int | float | str]]) -> str | None:
    """What INFO's loading:1 means (the phases running: the disk tier's index rebuild,
    the arena's prefault), or None when the daemon serves."""
    server = sections.get("server", {})
    if not server.get("loading"):
        return None
    phases = str(server.get("loading_phase", "prefault")).split(",")
    doing = []
    if "disk_index" in phases:
        eta = server.get("loading_disk_eta_s", -1)
        doing.append(f"rebuilds its disk tier's index ({server.get('loading_disk_scanned_perc')}% "
                     f"of {server.get('loading_disk_slots')} slots, "
                     + ("time left unknown yet" if eta < 0 else f"{eta} s left") + ")")
    if "prefault" in phases:
        eta = server.get("loading_eta_s", -1)
        doing.append(f"prefaults its arena ({server.get('loading_loaded_perc')}% at "
                     f"{server.get('loading_rate_gbps')} GB/s, "
                     + ("time left unknown yet" if eta < 0 else f"{eta} s left") + ")")
    return (f"note: the daemon is loading: it {' and '.join(doing) or 'starts'}; until then "
            "it answers INFO, CLIENTS and CONFIG, and refuses clients' requests with "
            "`loading` (a miss for them)")


def render_clients(clients: list[dict[str, int | float | str]]) -> str:
    """One `id=... pid=... name=...` line per client session."""
    lines = []
    for client in clients:
        lines.append(" ".join(f"{k}={_quote(v)}" for k, v in client.items()))
    return "\n".join(lines)


def _quote(value: int | float | str) -> str:
    text = str(value)
    return text if text and " " not in text else repr(text)
