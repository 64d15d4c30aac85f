"""Progress of the arena prefault at daemon start: a bar on a terminal, log lines else.

Why this file exists: prefaulting a large arena takes seconds to minutes (first touch
of shared memory runs at 0.4-1.3 GB/s here, docs/architecture.md, "Prefault"); an operator should
see it move, and systemd's journal should get a few lines, not a bar.
"""

import sys
import time

from lmcached.wire.logger import init_logger
from lmcached.wire.units import format_bytes

logger = init_logger(__name__)


class PrefaultProgress:
    """Prefault progress: a bar on a terminal, else a log line every ~10%."""

    def __init__(self, total_bytes: int) -> None:
        self.total_bytes = total_bytes
        self.tty = sys.stderr.isatty()
        self.next_pct = 10
        self.started = time.monotonic()

    def __call__(self, done_bytes: int, total_bytes: int) -> None:
        pct = 100 * done_bytes // total_bytes
        if self.tty:
            filled = pct * 30 // 100
            sys.stderr.write(
                f"\rprefaulting arena [{'#' * filled}{' ' * (30 - filled)}] {pct:3d}% "
                f"{format_bytes(done_bytes)}/{format_bytes(total_bytes)}"
            )
            if done_bytes >= total_bytes:
                sys.stderr.write("\n")
            sys.stderr.flush()
        elif pct >= self.next_pct:
            logger.info(
                "prefaulting arena: %d%% (%s of %s, %.1f s)", pct, format_bytes(done_bytes),
                format_bytes(total_bytes), time.monotonic() - self.started,
            )
            self.next_pct = (pct // 10 + 1) * 10
