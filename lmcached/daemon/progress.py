"""Progress of the arena prefault at daemon start: a bar on a terminal, log lines else,
and the `loading` state the daemon answers with meanwhile.

Why this file exists: prefaulting a large arena takes seconds to minutes (first touch
of shared memory runs at 0.4-1.3 GB/s here, docs/architecture.md, "Prefault"); an operator should
see it move, and systemd's journal should get a few lines, not a bar. While it runs the
daemon already answers INFO, PING and the CLI (after Redis's LOADING state): INFO's
`loading_*` fields, the `loading` refusal and systemd's STATUS= all read this one record.
"""

import sys
import time

from lmcached.wire.logger import init_logger
from lmcached.wire.units import format_bytes

logger = init_logger(__name__)

STATUS_INTERVAL_S = 1.0  # systemd's STATUS= is updated at most this often


class PrefaultProgress:
    """Prefault progress: a bar on a terminal, else a log line every ~10%; and the
    state of the load (bytes done, rate, time left) for INFO, refusals and STATUS=.

    Args:
        total_bytes: the arena's capacity.

    Attributes:
        done_bytes: bytes prefaulted so far.
        loading: True until the last byte is prefaulted.
    """

    def __init__(self, total_bytes: int) -> None:
        self.total_bytes = total_bytes
        self.done_bytes = 0
        self.loading = True
        self.tty = sys.stderr.isatty()
        self.next_pct = 10
        self.started = time.monotonic()
        self.elapsed_s = 0.0
        self._next_status = 0.0

    def __call__(self, done_bytes: int, total_bytes: int) -> None:
        self.done_bytes = done_bytes
        self.elapsed_s = time.monotonic() - self.started
        if done_bytes >= total_bytes:
            self.loading = False
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
                format_bytes(total_bytes), self.elapsed_s,
            )
            self.next_pct = (pct // 10 + 1) * 10

    @property
    def rate_bytes_per_s(self) -> float:
        """Prefault speed so far, bytes per second (0.0 before the first step)."""
        return self.done_bytes / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the speed so far; None before the first step ends."""
        rate = self.rate_bytes_per_s
        if not self.loading:
            return 0.0
        return (self.total_bytes - self.done_bytes) / rate if rate > 0 else None

    def describe(self) -> str:
        """e.g. "prefaulting the 4.00G arena: 37% (1.48G), 0.52 GB/s, 4.8 s left"."""
        eta = self.eta_s
        return (f"prefaulting the {format_bytes(self.total_bytes)} arena: "
                f"{100 * self.done_bytes // max(self.total_bytes, 1)}% "
                f"({format_bytes(self.done_bytes)}), {self.rate_bytes_per_s / 1e9:.2f} GB/s, "
                + ("time left unknown yet" if eta is None else f"{eta:.1f} s left"))

    def status_due(self) -> bool:
        """Whether systemd's STATUS= should be updated now (every STATUS_INTERVAL_S)."""
        now = time.monotonic()
        if now < self._next_status:
            return False
        self._next_status = now + STATUS_INTERVAL_S
        return True


def loading_fields(progress: PrefaultProgress | None) -> dict[str, int | float]:
    """INFO `server`'s loading_* fields, after Redis's INFO `loading_*`: `loading` 1 while
    the arena is prefaulted, then 0 with the final figures (bytes, percent, GB/s; seconds
    left, -1 while unknown). None (the arena was not prefaulted): 0 and zeros."""
    if progress is None:
        return {"loading": 0, "loading_loaded_bytes": 0, "loading_total_bytes": 0,
                "loading_loaded_perc": 0.0, "loading_rate_gbps": 0.0, "loading_eta_s": 0.0}
    eta = progress.eta_s
    return {
        "loading": int(progress.loading),
        "loading_loaded_bytes": progress.done_bytes,
        "loading_total_bytes": progress.total_bytes,
        "loading_loaded_perc": round(100 * progress.done_bytes / max(progress.total_bytes, 1), 2),
        "loading_rate_gbps": round(progress.rate_bytes_per_s / 1e9, 3),
        "loading_eta_s": -1.0 if eta is None else round(eta, 1),
    }
