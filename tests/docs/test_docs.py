"""The repository's Markdown stands on its own: every relative link resolves to a file in
the repository (and a `#heading` to a heading of that file), and the README uses no
internal jargon (issue numbers, "the seed")."""

import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SKIP_DIRS = {".git", "build", "dist", "node_modules", "__pycache__"}
# [text](target) outside code spans; targets with a scheme (https:, mailto:) are external.
LINK = re.compile(r"(?<!`)\[[^\]\n]*\]\(([^)\s]+)\)")
FENCED = re.compile(r"```.*?```", re.DOTALL)
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)


def _markdown_files() -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(REPO):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")
                       and not d.endswith(".egg-info")]
        found += [os.path.join(dirpath, f) for f in filenames if f.endswith(".md")]
    return sorted(found)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: str) -> set[str]:
    with open(path) as f:
        text = FENCED.sub("", f.read())  # a "#" line in a code block is no heading
    return {_slug(m[1]) for m in re.finditer(r"^#+\s+(.*)$", text, re.MULTILINE)}


def _links(path: str) -> list[str]:
    with open(path) as f:
        text = CODE.sub("", f.read())
    return [m[1] for m in LINK.finditer(text) if not re.match(r"[a-z][a-z0-9+.-]*:", m[1])]


MARKDOWN = _markdown_files()


def test_the_docs_are_found():
    names = {os.path.relpath(p, REPO) for p in MARKDOWN}
    assert {"README.md", "docs/architecture.md", "docs/operator.md", "docs/troubleshooting.md",
            "systemd/README.md"} <= names


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: os.path.relpath(p, REPO))
def test_relative_links_resolve_inside_the_repository(path):
    broken = []
    for target in _links(path):
        file_part, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
        if os.path.commonpath([REPO, resolved]) != REPO:
            broken.append(f"{target}: outside the repository")
        elif not os.path.exists(resolved):
            broken.append(f"{target}: no such file")
        elif anchor and resolved.endswith(".md") and anchor not in _anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {os.path.relpath(resolved, REPO)}")
    assert not broken, broken


def test_readme_has_a_docs_index_and_no_internal_jargon():
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    for doc in ("docs/architecture.md", "docs/operator.md", "docs/troubleshooting.md",
                "docs/metrics.md", "docs/cacheblend.md", "systemd/README.md"):
        assert f"]({doc})" in readme, doc
    for jargon in (r"\bissue \d+", r"\bthe seed'?s?\b", r"\.\./shared/", r"DESIGN\.md"):
        assert not re.search(jargon, readme, re.IGNORECASE), jargon


# Fixed parts of the messages docs/troubleshooting.md quotes: each must still be printed
# by the code (lmcached/, client/, shm/), so that an edited message fails here until the
# page quotes the new one.
QUOTED_MESSAGES = [
    "no daemon is running on",
    "looked there in this order; ",
    "give --socket, or --name if the daemon has another name",
    "connect as the daemon's user or root, or as a member of the group the daemon allows",
    "cannot talk to the daemon on",
    "the daemon serves once ",
    "rebuilding the disk tier's index: ",
    "closed the connection without answering: it is stopping, or it does not accept this user",
    "clear asks for confirmation on a terminal, and stdin is not one: pass --yes",
    "is allowed to the daemon's user",
    "a member could replace the socket",
    "not a socket: refusing to remove it",
    "another lmcached daemon is listening on",
    "stop it first, or start this one with another --name",
    "is more than /dev/shm has free",
    "free space there, or lower --capacity",
    "cannot parse size",
    "and one session may hold",
    "start the daemon with --capacity",
    "refuses this client",
    "this daemon speaks",
    "KV dtype is",
    "--block-size is unset: the first layout",
    "start the daemon with --block-size",
    "does not hold the requested tokens (hash collision, corrupted index, or a tier this "
    "process has not mapped): treated as a miss",
    "pinned lookups were never retrieved: unpinning the oldest",
    "were released before they were read (the session ended: a timeout, --idle-timeout, "
    "or a restart): read again from the daemon",
    "copies stay staged; raise RLIMIT_MEMLOCK (LimitMEMLOCK=infinity) to page-lock it",
    "CUDA is not available: arena not registered",
    "max number of clients reached",
    "max_clients lowered from",
    "serving without the cache (misses, skipped stores) and reconnecting in the background",
    "caching again",
    "needs torch, which the base install",
    "the demo needs the hf extra",
    "needs redis-py",
    "next try in",
    "list several addresses only for a cluster",
    "does not speak RESP (Redis' protocol): to PING it answered",
    "refuses lmcached",
    "a read-only replica",
    "Never change its mode: use a private subdirectory",
    "is larger than a Redis value may be",
]


def _source_text() -> str:
    """Every .py of the packages, adjacent string literals joined ("a " "b" -> "a b")."""
    text = []
    for folder in ("lmcached", "client", "shm"):
        for dirpath, _, filenames in os.walk(os.path.join(REPO, folder)):
            for name in filenames:
                if name.endswith(".py"):
                    with open(os.path.join(dirpath, name)) as f:
                        text.append(f.read())
    return re.sub(r"""(["'])\s*\n\s*[rbf]*(["'])""", "", "\n".join(text))


def test_troubleshooting_quotes_messages_the_code_prints():
    with open(os.path.join(REPO, "docs", "troubleshooting.md")) as f:
        page = re.sub(r"\s+", " ", f.read())
    source = _source_text()
    unquoted = [m for m in QUOTED_MESSAGES if m not in page]
    assert not unquoted, f"the page does not quote {unquoted}"
    gone = [m for m in QUOTED_MESSAGES if m not in source]
    assert not gone, f"the code no longer prints {gone}: quote the new messages in the page"
