"""How to install an optional part of lmcached (an extra of pyproject.toml), said once.

Why this file exists: every layer names an extra when an optional dependency is missing
(redis-py for --l2, cuda-bindings for --gpu-capacity, torch for the client,
transformers for the demo), and lmcached is installed from a checkout (`pip install
'.[l2]'`) as often as from a package index (`pip install 'lmcached[l2]'`): a hint that
gives only one of them fails for the other half of the readers.
"""


def install_hint(extra: str) -> str:
    """The commands that install extra `extra`, from a checkout and from an index.

    Args:
        extra: the name of an extra of pyproject.toml's [project.optional-dependencies],
            e.g. "l2".

    Returns:
        e.g. "pip install '.[l2]' in a checkout of lmcached, or pip install
        'lmcached[l2]' from a package index".
    """
    return (f"pip install '.[{extra}]' in a checkout of lmcached, or "
            f"pip install 'lmcached[{extra}]' from a package index")
