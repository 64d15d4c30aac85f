"""Comments and docstrings say what the code does and why, not its history.

A comment that cites a tracker item ("issue" and its number), narrates a move (where
the code lived before, that the move changed nothing) or points at a file outside the
repository (a design note in a sibling folder, a path of the machine it was written on)
tells a reader nothing they can check from the repository: history belongs in commit
messages, designs in docs/. This test reads every comment and docstring of the project's
Python files (the packages, tests and benchmarks).
"""

import ast
import io
import os
import re
import tokenize

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FOLDERS = ("lmcached", "shm", "client", "examples", "tests", "benchmarks")
# (what is wrong, pattern). External trackers ("LMCache issue #1136") are cited with "#".
HISTORY = [
    ("cites an issue number", re.compile(r"\bissue\s+\d+", re.IGNORECASE)),
    ("narrates a move", re.compile(r"\bmoved\s+from\b|\bpure\s+move\b", re.IGNORECASE)),
    ("cites a path outside the repository",
     re.compile(r"(?<![\w.])\.\./shared\b|(?<![\w.])/wor" r"k/")),
]


def python_files() -> list[str]:
    """The project's .py files, relative to the repository."""
    found = []
    for folder in FOLDERS:
        for root, dirs, files in os.walk(os.path.join(REPO, folder)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
            found += [os.path.relpath(os.path.join(root, f), REPO)
                      for f in sorted(files) if f.endswith(".py")]
    return found


def comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every module, class and function docstring."""
    out = [(tok.start[0], tok.string) for tok in
           tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                             ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                out.append((body[0].lineno, body[0].value.value))
    return out


def history_in(source: str) -> list[str]:
    """"l.N: what is wrong: the text" for each comment or docstring that matches HISTORY."""
    found = []
    for line, text in comments_and_docstrings(source):
        for what, pattern in HISTORY:
            match = pattern.search(text)
            if match:
                start = max(0, match.start() - 40)
                found.append(f"l.{line}: {what}: ...{text[start:match.end() + 40]!r}...")
    return found


def test_no_comment_or_docstring_tells_history():
    found = []
    for path in python_files():
        with open(os.path.join(REPO, path)) as f:
            found += [f"{path} {hit}" for hit in history_in(f.read())]
    assert found == [], ("say what the code does and why (history belongs in commits, "
                         "designs in docs/):\n" + "\n".join(found))


@pytest.mark.parametrize("planted", [
    '"""The causal kernel (issue\n26)."""',
    '"""Pins. Moved from client/vllm/connector.py, unchanged."""',
    '"""Checks. Split from block_pool.py (pure move)."""',
    "# the causal kernel (Issue 26)",
    "# the design: ../shared/designs/cacheblend-in-vllm.md, step 3",
    "# see /wor" "k/shared/DESIGN.md",
], ids=["issue", "Issue", "moved", "pure move", "../shared", "/work/"])
def test_a_planted_history_comment_is_found(planted):
    source = f"{planted}\nx = 1  # a comment that says what x is\n"
    assert len(history_in(source)) == 1, history_in(source)


def test_external_trackers_and_plain_strings_pass():
    """Another project's issue ("#" and its number) is a source, and a string that is
    not a docstring is the code's business (an error message, a metric's help)."""
    source = ('"""Refused, as LMCache issue #1136 shows."""\n'
              'HELP = "Chunks moved from a device tier to the host arena."\n')
    assert history_in(source) == []
