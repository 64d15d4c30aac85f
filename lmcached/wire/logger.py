"""One logger factory for the package (after vLLM's `init_logger`).

Every module does `logger = init_logger(__name__)`. Handlers are configured once, by the
daemon or the CLI, with `configure_logging`; library users keep their own logging setup.
"""

import logging
import sys

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def init_logger(name: str) -> logging.Logger:
    """Return the logger for module `name` (a child of the `lmcached` logger)."""
    return logging.getLogger(name)


def configure_logging(level: str | int = "INFO", stream=None) -> None:
    """Send lmcached's log records to `stream` (stderr) at `level`; idempotent.

    Raises:
        ValueError: unknown level name.
    """
    if isinstance(level, str):
        numeric = logging.getLevelName(level.upper())
        if not isinstance(numeric, int):
            raise ValueError(f"unknown log level {level!r}; use DEBUG, INFO, WARNING or ERROR")
        level = numeric
    root = logging.getLogger("lmcached")
    root.setLevel(level)
    if not any(getattr(h, "_lmcached", False) for h in root.handlers):
        handler = logging.StreamHandler(stream or sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler._lmcached = True
        root.addHandler(handler)
