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


def render_clients(clients: list[dict[str, int | float | str]]) -> str:
    """One `id=... pid=... name=...` line per client session."""
    lines = []
    for client in clients:
        lines.append(" ".join(f"{k}={_quote(v)}" for k, v in client.items()))
    return "\n".join(lines)


def _quote(value: int | float | str) -> str:
    text = str(value)
    return text if text and " " not in text else repr(text)
