"""The code blocks of README.md and docs/*.md run as written, or say why they cannot.

Every fenced block is one of these, and the test does what its kind asks:

- **fragment**: the line before the block is `<!-- fragment: REASON -->` (invisible on
  GitHub); skipped, the reason shown. For what needs a GPU node, a model or a long run.
- **python**: the python blocks of one file run in order in one fresh interpreter (names
  carry over from block to block, as in a notebook), against a daemon this test starts
  (`$LMCACHED_SOCKET`), offline, with a time limit. A block that raises fails the test;
  the traceback names the Markdown file and line. A `print(...)  # VALUE` line must
  print VALUE. A block after `<!-- needs: vllm -->` runs only where vLLM is installed
  (`make test-vllm`), with the file's other python blocks.
- **shell** (tagged `sh`, `bash`, `shell` or `console`, or untagged with a line that starts
  with a command of SHELL_COMMANDS): each command line is checked without running it.
  `lmcached ...` is parsed by the CLI's own click commands (an unknown command or option,
  or a bad value, fails) and a `serve` line is resolved into the daemon's configuration;
  `make T`: T is a target of the Makefile; `pip install SPEC`: SPEC's extras are extras
  of pyproject.toml; `python FILE`: FILE is in the repository; `python -m benchmarks.G.M`:
  benchmarks/G/M.py is in the repository, each folder above it a package (with its
  `__init__.py`). Any other command fails: mark its block as a fragment.
- **toml**: resolved by the daemon's configuration loader (unknown keys, bad values fail);
  **yaml**: parsed; **promql**: every `lmcached_*` series it reads is a metric of
  docs/metrics.md's table (which tests/daemon/test_metrics.py checks against the code).
- **text** (untagged, no command): output, messages and diagrams; test_docs.py and
  test_docs_facts.py check the messages against the code.

A planted broken block of each runnable kind is shown to fail (the `test_planted_*`
tests), so that an unmarked block that no longer runs cannot pass.
"""

import glob
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import textwrap
import tomllib
from dataclasses import dataclass

import click
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ["README.md", *sorted(os.path.relpath(p, REPO)
                             for p in glob.glob(os.path.join(REPO, "docs", "*.md")))]
FENCE = re.compile(r"^```\s*(\S*)\s*$")
FRAGMENT = re.compile(r"^<!--\s*fragment:\s*(\S.*?)\s*-->$")
NEEDS = re.compile(r"^<!--\s*needs:\s*(\w+)\s*-->$")
SHELL_TAGS = {"sh", "bash", "shell", "console"}
SHELL_COMMANDS = {"lmcached", "pip", "pip3", "make", "python", "python3", "vllm", "sudo",
                  "systemctl", "journalctl", "redis-server", "redis-cli", "curl", "docker",
                  "cd", "export", "git", "kill", "mount", "rm", "cp", "mkdir", "chmod"}
PYTHON_TIMEOUT_S = 300
# The arena of the daemon a file's python blocks use: README's example stores 4,096
# Llama-3-8B tokens (16 chunks of 32 MiB) in one session, which may hold half the arena.
ARENA = {"README.md": "2GiB"}
DEFAULT_ARENA = "256MiB"


@dataclass(frozen=True)
class Block:
    """One fenced code block: its file (relative to the repository), the line of its
    opening fence (1-based), its info string, its text, its fragment reason and the
    package it needs (`<!-- needs: vllm -->`)."""

    path: str
    line: int
    lang: str
    text: str
    fragment: str | None
    needs: str | None = None

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def read_blocks(path: str, root: str = REPO) -> list[Block]:
    """The fenced blocks of the Markdown file `path` (relative to `root`)."""
    with open(os.path.join(root, path)) as f:
        lines = f.read().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker, needs = FRAGMENT.match(before), NEEDS.match(before)
        blocks.append(Block(path, i + 1, opening[1], "\n".join(lines[i + 1:end]),
                            marker[1] if marker else None, needs[1] if needs else None))
        i = end + 1
    return blocks


def command_lines(text: str) -> list[list[str]]:
    """The shell commands of a block: continuation lines joined, comments dropped, an
    optional `$ ` prompt removed; each as its words."""
    commands, pending = [], ""
    for line in re.sub(r"\\\n", " ", text).splitlines():
        pending += line
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on on the next line
            pending += "\n"
            continue
        pending = ""
        if words and words[0] == "$":
            words = words[1:]
        if words:
            commands.append(words)
    assert not pending, f"a quote is never closed in {text!r}"
    return commands


def kind(block: Block) -> str:
    """fragment, python, shell, toml, yaml, promql or text (see the module docstring)."""
    if block.fragment:
        return "fragment"
    if block.lang in SHELL_TAGS:
        return "shell"
    if block.lang:
        return block.lang
    first_words = {line.split()[0] for line in block.text.splitlines() if line.split()}
    first_words |= {line.split()[1] for line in block.text.splitlines()
                    if len(line.split()) > 1 and line.split()[0] == "$"}
    return "shell" if first_words & SHELL_COMMANDS else "text"


# ------------------------------------------------------------------------ shell commands
def _pyproject_extras() -> set[str]:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return set(tomllib.load(f)["project"]["optional-dependencies"])


def _make_targets() -> set[str]:
    with open(os.path.join(REPO, "Makefile")) as f:
        return set(re.findall(r"^([\w-]+):", f.read(), re.MULTILINE))


def check_lmcached(args: list[str]) -> None:
    """Parse `lmcached ARGS` with the CLI's click commands, without running them; a
    `serve` line is also resolved into the daemon's configuration (sizes, policies).

    Raises:
        click.ClickException: an unknown command or option, or a value it refuses.
    """
    from lmcached.cli import main
    from lmcached.config import config_from_context

    if not args or args[0].startswith("-"):
        try:
            main.make_context("lmcached", list(args))
        except click.exceptions.Exit as exc:  # --help, --version
            assert exc.exit_code == 0
        return
    command = main.commands.get(args[0])
    if command is None:
        raise click.UsageError(f"no command {args[0]!r}; lmcached has {sorted(main.commands)}")
    with command.make_context(f"lmcached {args[0]}", list(args[1:])) as ctx:
        if args[0] == "serve":
            config_from_context(ctx, check_shm_free=False)


def repository_module_problem(name: str) -> str | None:
    """Why `python -m NAME` would not find NAME in the repository from its root (None: it
    would): NAME's file (`a/b/c.py`) must exist and every folder above it (`a`, `a/b`) must
    be a package with its `__init__.py`."""
    parts = name.split(".")
    path = os.path.join(*parts) + ".py"
    if not os.path.isfile(os.path.join(REPO, path)):
        return f"no module {name} (no file {path})"
    for depth in range(1, len(parts)):
        init = os.path.join(*parts[:depth], "__init__.py")
        if not os.path.isfile(os.path.join(REPO, init)):
            return f"{'.'.join(parts[:depth])} is not a package (no file {init})"
    return None


def shell_problems(block: Block) -> list[str]:
    """What is wrong with the commands of a shell block (empty: every one checked)."""
    problems = []
    for words in command_lines(block.text):
        program, args = words[0], words[1:]
        line = " ".join(words)
        if program == "lmcached":
            try:
                check_lmcached(args)
            except click.ClickException as exc:
                problems.append(f"{line}: {exc.format_message()}")
        elif program == "make":
            missing = [t for t in args if not t.startswith("-") and "=" not in t
                       and t not in _make_targets()]
            if missing:
                problems.append(f"{line}: no Makefile target {missing}")
        elif program in ("pip", "pip3") and args[:1] == ["install"]:
            for spec in args[1:]:
                match = re.fullmatch(r"(?:\.|lmcached)(?:\[([\w,-]+)\])?", spec)
                if not match:
                    problems.append(f"{line}: {spec!r} is not this package")
                    continue
                unknown = set(filter(None, (match[1] or "").split(","))) - _pyproject_extras()
                if unknown:
                    problems.append(f"{line}: pyproject.toml has no extra {sorted(unknown)}")
        elif program in ("python", "python3") and args and args[0].endswith(".py"):
            if not os.path.isfile(os.path.join(REPO, args[0])):
                problems.append(f"{line}: no file {args[0]}")
        elif (program in ("python", "python3") and args[:1] == ["-m"] and len(args) > 1
              and args[1].split(".")[0] == "benchmarks"):
            missing = repository_module_problem(args[1])
            if missing:
                problems.append(f"{line}: {missing}")
        else:
            problems.append(f"{line}: the test cannot check {program!r}; run it in a test, "
                            f"or mark the block <!-- fragment: REASON -->")
    return problems


# --------------------------------------------------------------------------- python
DRIVER = textwrap.dedent("""\
    import contextlib, io, json, sys
    namespace = {"__name__": "__main__"}
    for path, line, source in json.load(open(sys.argv[1])):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            # blank lines first: a traceback then names the block's line in the Markdown file
            exec(compile("\\n" * line + source, path, "exec"), namespace)
        print(json.dumps({"ran": f"{path}:{line}", "printed": printed.getvalue()}), flush=True)
    """)
# `print(...)  # VALUE: ...`: the block says what the line prints.
PRINT_CLAIM = re.compile(r"^\s*print\(.*\)\s*#\s*([^\s:,;]+)", re.MULTILINE)


def ran_blocks(stdout: str) -> list[dict]:
    """The driver's report of each block it ran: {"ran": "path:line", "printed": text}."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith('{"ran": ')]


def print_claims_broken(block: Block, printed: str) -> list[str]:
    """The `print(...)  # VALUE` lines of `block` whose output (in order) is not VALUE."""
    claims = PRINT_CLAIM.findall(block.text)
    lines = printed.splitlines()
    return [f"prints {got!r}, the block says {claim!r}"
            for claim, got in zip(claims, lines + [""] * len(claims)) if got != claim]


def run_python_blocks(blocks: list[Block], socket: str, workdir: str,
                      **env_vars: str) -> subprocess.CompletedProcess:
    """`blocks` in order, in one fresh interpreter that runs in `workdir` (also its
    TMPDIR) against the daemon on `socket`, offline, with `env_vars` added to its
    environment; killed after PYTHON_TIMEOUT_S."""
    blocks_path = os.path.join(workdir, "blocks.json")
    with open(blocks_path, "w") as f:
        json.dump([(b.path, b.line, b.text) for b in blocks], f)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHED_")}
    env.update(LMCACHED_SOCKET=socket, TMPDIR=workdir, HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONPATH=REPO, **env_vars)
    return subprocess.run([sys.executable, "-c", DRIVER, blocks_path], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=PYTHON_TIMEOUT_S)


# --------------------------------------------------------------------------- the docs
BLOCKS = [block for path in DOCS for block in read_blocks(path)]
PYTHON_DOCS = sorted({b.path for b in BLOCKS if kind(b) == "python"})
VLLM_DOCS = sorted({b.path for b in BLOCKS if kind(b) == "python" and b.needs == "vllm"})


def _blocks_of(kinds: set[str]) -> list:
    return [pytest.param(b, id=b.where) for b in BLOCKS if kind(b) in kinds]


def test_the_blocks_are_found():
    assert len(BLOCKS) > 50 and {"README.md", "docs/cacheblend.md"} <= set(PYTHON_DOCS)
    unknown = {b.where: b.lang for b in BLOCKS
               if kind(b) not in ("fragment", "python", "shell", "toml", "yaml", "promql",
                                  "text")}
    assert not unknown, f"blocks of a language this test cannot check: {unknown}"
    needs = {b.where: b.needs for b in BLOCKS
             if b.needs and (b.needs, kind(b)) != ("vllm", "python")}
    assert not needs, f"only python blocks may need a package, and only vllm: {needs}"


def check_python_blocks(path: str, blocks: list[Block], daemon_factory, workdir: str,
                        **env_vars: str) -> None:
    """Run `blocks` of `path` (run_python_blocks) and fail the test unless each ran and
    printed what it says it prints."""
    daemon = daemon_factory("--capacity", ARENA.get(path, DEFAULT_ARENA))
    try:
        proc = run_python_blocks(blocks, daemon.socket, workdir, **env_vars)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the python blocks of {path} ran past {PYTHON_TIMEOUT_S} s:\n{exc.stdout}")
    assert proc.returncode == 0, (
        f"a python block of {path} failed (or mark it <!-- fragment: REASON -->):\n"
        f"{proc.stdout}\n{proc.stderr[-6000:]}")
    ran = ran_blocks(proc.stdout)
    assert [r["ran"] for r in ran] == [b.where for b in blocks], proc.stdout
    broken = {b.where: print_claims_broken(b, r["printed"]) for b, r in zip(blocks, ran)}
    assert not any(broken.values()), broken


@pytest.mark.slow
@pytest.mark.timeout(PYTHON_TIMEOUT_S + 60)
@pytest.mark.parametrize("path", PYTHON_DOCS)
def test_python_blocks_run_as_written(path, daemon_factory, tmp_path):
    blocks = [b for b in BLOCKS if b.path == path and kind(b) == "python" and not b.needs]
    check_python_blocks(path, blocks, daemon_factory, str(tmp_path))


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(PYTHON_TIMEOUT_S + 60)
@pytest.mark.parametrize("path", VLLM_DOCS)
def test_python_blocks_that_need_vllm_run_as_written(path, daemon_factory, tmp_path):
    """Every python block of `path`, the vLLM ones included, in order (`make test-vllm`)."""
    pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs "
                                       "these blocks in .venv-vllm")
    blocks = [b for b in BLOCKS if b.path == path and kind(b) == "python"]
    check_python_blocks(path, blocks, daemon_factory, str(tmp_path), VLLM_CPU_KVCACHE_SPACE="1",
                        VLLM_ENABLE_V1_MULTIPROCESSING="0")


@pytest.mark.parametrize("block", _blocks_of({"shell"}))
def test_shell_blocks_are_commands_this_repository_has(block):
    problems = shell_problems(block)
    assert not problems, f"{block.where}: " + "; ".join(problems)


@pytest.mark.parametrize("block", _blocks_of({"toml"}))
def test_toml_blocks_are_settings_the_daemon_accepts(block, tmp_path, monkeypatch):
    from lmcached.config import load_config

    for name in [k for k in os.environ if k.startswith("LMCACHED_")]:
        monkeypatch.delenv(name)
    path = tmp_path / "block.toml"
    path.write_text(block.text)
    load_config({}, str(path), check_shm_free=False)


@pytest.mark.parametrize("block", _blocks_of({"yaml"}))
def test_yaml_blocks_parse(block):
    yaml = pytest.importorskip("yaml")
    assert yaml.safe_load(block.text)


@pytest.mark.parametrize("block", _blocks_of({"promql"}))
def test_promql_blocks_read_metrics_the_daemon_exposes(block):
    with open(os.path.join(REPO, "docs", "metrics.md")) as f:
        documented = set(re.findall(r"^\| `(lmcached_\w+)` \|", f.read(), re.MULTILINE))
    used = {re.sub(r"_(bucket|count|sum)$", "", name)
            for name in re.findall(r"\blmcached_\w+", block.text)}
    assert used and used <= documented, f"{block.where}: not metrics {sorted(used - documented)}"


def test_fragments_say_why():
    fragments = [b for b in BLOCKS if b.fragment]
    assert fragments and all(len(b.fragment.split()) >= 3 for b in fragments), [
        (b.where, b.fragment) for b in fragments]


# --------------------------------------------------------------- planted broken blocks
PLANTED = """\
# A page

```python
value = 41
print(value + 1)  # 42
```

Then:

```python
print(value + undefined_name)
```

<!-- fragment: a broken block that is marked, and skipped -->
```python
raise SystemExit(3)
```

```
lmcached serve --capacity lots
lmcached serve --no-such-option 1
lmcached frobnicate
make no-such-target
pip install '.[no-such-extra]'
python -m benchmarks.engine.no_such_bench --tokens 256
rm -rf /tmp/nothing-here
```

```
Error: an output line, not a command
```
"""


@pytest.fixture
def planted(tmp_path) -> list[Block]:
    (tmp_path / "planted.md").write_text(PLANTED)
    return read_blocks("planted.md", root=str(tmp_path))


def test_planted_blocks_are_classified(planted):
    assert [kind(b) for b in planted] == ["python", "python", "fragment", "shell", "text"]
    assert planted[2].fragment == "a broken block that is marked, and skipped"
    assert planted[1].line == 10
    assert print_claims_broken(planted[0], "42\n") == []
    assert print_claims_broken(planted[0], "41\n") == ["prints '41', the block says '42'"]


def test_planted_broken_python_block_fails_naming_its_line(planted, daemon, tmp_path):
    runnable = [b for b in planted if kind(b) == "python"]
    proc = run_python_blocks(runnable, daemon.socket, str(tmp_path))
    assert proc.returncode != 0
    assert ran_blocks(proc.stdout) == [{"ran": "planted.md:3", "printed": "42\n"}]
    assert 'File "planted.md", line 11' in proc.stderr, proc.stderr
    assert "NameError: name 'undefined_name' is not defined" in proc.stderr, proc.stderr


def test_planted_broken_shell_commands_each_fail(planted):
    problems = shell_problems(planted[3])
    assert len(problems) == 7, problems
    assert "cannot parse size 'lots'" in problems[0], problems[0]
    assert "No such option" in problems[1] and "no command 'frobnicate'" in problems[2]
    assert "no Makefile target ['no-such-target']" in problems[3]
    assert "no extra ['no-such-extra']" in problems[4]
    assert "no module benchmarks.engine.no_such_bench" in problems[5] and "fragment" in problems[6]


def test_benchmark_modules_resolve_from_the_repository_root():
    assert repository_module_problem("benchmarks.engine.bench_engine") is None
    assert repository_module_problem("benchmarks.run") is None
    moved = repository_module_problem("benchmarks.bench_engine")
    assert moved == "no module benchmarks.bench_engine (no file benchmarks/bench_engine.py)"
    # A folder without __init__.py: `-m` would not import it as part of the package.
    assert repository_module_problem("tests.docs.test_doc_blocks") == (
        "tests is not a package (no file tests/__init__.py)")
