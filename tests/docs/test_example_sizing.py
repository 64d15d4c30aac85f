"""The example configuration (systemd/lmcached.toml.example) follows docs/operator.md's
sizing advice: its block size is one chunk record of the model it names, rounded up to
4 KiB (the value operator.md gives for that model, computed here from the model's
geometry in operator.md's table), and its capacity holds at least the 16 blocks the
daemon wants of a block size it derives."""

import os
import re
import tomllib

from lmcached.client import KVLayout
from lmcached.daemon.namespaces import BLOCK_ALIGN_BYTES, MIN_DERIVED_BLOCKS
from lmcached.shm.arena import HEADER_BYTES
from lmcached.sizes import parse_size

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "systemd", "lmcached.toml.example")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
CHUNK_TOKENS = 256  # operator.md's table is of 256-token chunk records


def _read(*parts: str) -> str:
    with open(os.path.join(REPO, *parts)) as f:
        return f.read()


def _example() -> tuple[dict, str]:
    text = _read("systemd", "lmcached.toml.example")
    return tomllib.loads(text), text


def _comments() -> str:
    """The example's comments as one line of text."""
    return " ".join(line.lstrip("# ") for line in _example()[1].splitlines()
                    if line.startswith("#"))


def _named_model() -> str:
    models = re.findall(r"the chunk record of ([\w.-]+)", _comments())
    assert len(models) == 1, ("the example's block_size comment names no model "
                              "('... the chunk record of MODEL'): its size has no reason")
    return models[0]


def _table_row(model: str) -> re.Match:
    row = re.search(rf"^\| {re.escape(model)} \| (\d+) x (\d+) x (\d+), (\w+) \| [^|]+ \| "
                    r"([\d,]+) bytes \|", _read("docs", "operator.md"), re.MULTILINE)
    assert row, f"docs/operator.md's sizing table has no row for {model}"
    return row


def test_example_block_size_is_one_record_of_the_model_it_names():
    settings, _ = _example()
    model = _named_model()
    layers, kv_heads, head_size, dtype, record = _table_row(model).groups()
    layout = KVLayout(model, num_layers=int(layers), num_kv_heads=int(kv_heads),
                      head_size=int(head_size), dtype=DTYPES[dtype], chunk_size=CHUNK_TOKENS)
    assert layout.record_bytes(CHUNK_TOKENS) == int(record.replace(",", "")), (
        f"operator.md's table gives {model} a record of {record} bytes")
    one_block = -(-layout.record_bytes(CHUNK_TOKENS) // BLOCK_ALIGN_BYTES) * BLOCK_ALIGN_BYTES
    assert "block_size" in settings and parse_size(settings["block_size"]) == one_block, (
        f"the example's block_size is {settings.get('block_size')!r}; one {model} record "
        f"rounded up to 4 KiB is {one_block}")
    advice = " ".join(_read("docs", "operator.md").split())
    assert re.search(rf"For {re.escape(model)}, 256-token chunks: `block_size = {one_block}`",
                     advice), f"operator.md does not advise block_size = {one_block} for {model}"


def test_example_capacity_holds_the_blocks_the_daemon_wants():
    settings, _ = _example()
    assert "block_size" in settings, "the example sets no block_size (operator.md: set it)"
    block_bytes = parse_size(settings["block_size"])
    num_blocks = (parse_size(settings["capacity"]) - HEADER_BYTES) // block_bytes
    assert num_blocks >= MIN_DERIVED_BLOCKS, (
        f"capacity {settings['capacity']} holds {num_blocks} blocks of {block_bytes} bytes; "
        f"operator.md asks for at least {MIN_DERIVED_BLOCKS}")
    stated = re.search(r"holds ([\d,]+) [\w.-]+ chunks", _comments())
    assert stated and int(stated[1].replace(",", "")) == num_blocks, stated
