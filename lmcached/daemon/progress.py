"""Progress of the daemon's start-up phases (the disk tier's index rebuild, the arena's
prefault: a bar on a terminal, log lines else), and the `loading` state the daemon
answers with meanwhile.

Why this file exists: prefaulting a large arena takes seconds to minutes (first touch
of shared memory runs at 0.4-1.3 GB/s here, docs/architecture.md, "Prefault"), and so
does rebuilding the index of a big disk tier (~4 s per 100k slots with a cold page
cache, docs/operator.md, "The disk tier"); an operator should see them move, and
systemd's journal should get a few lines, not a bar. While they run the daemon already
answers INFO, PING and the CLI (after Redis's LOADING state): INFO's `loading_*`
fields, the `loading` refusal and systemd's STATUS= all read one `Loading` record.
"""

import sys
import time

from lmcached.wire.logger import init_logger
from lmcached.wire.units import format_bytes

logger = init_logger(__name__)

STATUS_INTERVAL_S = 1.0  # systemd's STATUS= is updated at most this often


class PhaseProgress:
    """What a start-up phase has done of its total, and its rate and time left so far.

    Args:
        total: the phase's work (bytes, slots).

    Attributes:
        done: work done so far (any thread may report it).
        loading: True until the phase's last unit is done.
        elapsed_s: seconds from the start to the last report.
    """

    phase = ""  # its name in INFO's loading_phase

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.loading = True
        self.started = time.monotonic()
        self.elapsed_s = 0.0

    def report(self, done: int) -> None:
        """`done` units of the total are done (any thread)."""
        self.done = done
        self.elapsed_s = time.monotonic() - self.started
        if done >= self.total:
            self.loading = False

    @property
    def rate(self) -> float:
        """Units per second so far (0.0 before the first report)."""
        return self.done / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the speed so far; None before the first report."""
        rate = self.rate
        if not self.loading:
            return 0.0
        return (self.total - self.done) / rate if rate > 0 else None

    def _eta_text(self) -> str:
        eta = self.eta_s
        return "time left unknown yet" if eta is None else f"{eta:.1f} s left"


class IndexProgress(PhaseProgress):
    """Progress of the disk tier's index rebuild (a warm restart), in slots read.

    Args:
        total: the slot file's slots.
    """

    phase = "disk_index"
    waits_for = "the disk tier's index is rebuilt"

    def __call__(self, done_slots: int, num_slots: int) -> None:
        self.report(done_slots)

    def describe(self) -> str:
        """e.g. "rebuilding the disk tier's index: 250000 of 1000000 slots (25%), 84210
        slots/s, 8.9 s left"."""
        return (f"rebuilding the disk tier's index: {self.done} of {self.total} slots "
                f"({100 * self.done // max(self.total, 1)}%), {self.rate:.0f} slots/s, "
                + self._eta_text())


class PrefaultProgress(PhaseProgress):
    """Prefault progress: a bar on a terminal, else a log line every ~10%; and the
    state of the load (bytes done, rate, time left) for INFO, refusals and STATUS=.

    Args:
        total_bytes: the arena's capacity.
    """

    phase = "prefault"
    waits_for = "the arena is prefaulted"

    def __init__(self, total_bytes: int) -> None:
        super().__init__(total_bytes)
        self.tty = sys.stderr.isatty()
        self.next_pct = 10

    @property
    def total_bytes(self) -> int:
        """The arena's capacity."""
        return self.total

    @property
    def done_bytes(self) -> int:
        """Bytes prefaulted so far."""
        return self.done

    def __call__(self, done_bytes: int, total_bytes: int) -> None:
        self.report(done_bytes)
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
        return self.rate

    def describe(self) -> str:
        """e.g. "prefaulting the 4.00G arena: 37% (1.48G), 0.52 GB/s, 4.8 s left"."""
        return (f"prefaulting the {format_bytes(self.total_bytes)} arena: "
                f"{100 * self.done_bytes // max(self.total_bytes, 1)}% "
                f"({format_bytes(self.done_bytes)}), {self.rate_bytes_per_s / 1e9:.2f} GB/s, "
                + self._eta_text())


class Loading:
    """The daemon's loading state (after Redis's LOADING): its start-up phases, which may
    run at once (the index rebuild on a thread while the loop prefaults), read by the
    `loading` refusal, INFO's loading_* fields and systemd's STATUS=.

    Args:
        phases: the phases of this start-up, in the order they start.
    """

    def __init__(self, phases: list[PhaseProgress]) -> None:
        self.phases = phases
        self._next_status = 0.0

    @property
    def running(self) -> list[PhaseProgress]:
        """The phases not done yet."""
        return [p for p in self.phases if p.loading]

    def get(self, phase: str) -> PhaseProgress | None:
        """The phase named `phase` ("disk_index", "prefault"), or None."""
        return next((p for p in self.phases if p.phase == phase), None)

    def describe(self) -> str:
        """The running phases and what the daemon waits for, e.g. "rebuilding the disk
        tier's index: ...; prefaulting the 4.00G arena: ...; the daemon serves once the
        disk tier's index is rebuilt and the arena is prefaulted"."""
        running = self.running or self.phases[-1:]
        return "; ".join([p.describe() for p in running] + [
            "the daemon serves once " + " and ".join(p.waits_for for p in running)])

    def status_due(self) -> bool:
        """Whether systemd's STATUS= should be updated now (every STATUS_INTERVAL_S)."""
        now = time.monotonic()
        if now < self._next_status:
            return False
        self._next_status = now + STATUS_INTERVAL_S
        return True


def loading_fields(loading: Loading | None, running: bool) -> dict[str, int | float | str]:
    """INFO `server`'s loading_* fields, after Redis's INFO `loading_*`: `loading` 1 while
    the daemon loads (`running`), `loading_phase` the phases running ("disk_index",
    "prefault", both as "disk_index,prefault", "none" once it serves); the prefault's
    figures (bytes, percent, GB/s; seconds left, -1 while unknown) and the index
    rebuild's (`loading_disk_*`: slots, percent; seconds left), the final ones once
    done. None (nothing was loaded): 0 and zeros."""
    prefault = loading.get("prefault") if loading else None
    index = loading.get("disk_index") if loading else None
    fields: dict[str, int | float | str] = {
        "loading": int(running),
        "loading_phase": ",".join(p.phase for p in loading.running) if running and loading
        else "none",
    }
    if prefault is None:
        fields.update({"loading_loaded_bytes": 0, "loading_total_bytes": 0,
                       "loading_loaded_perc": 0.0, "loading_rate_gbps": 0.0,
                       "loading_eta_s": 0.0})
    else:
        eta = prefault.eta_s
        fields.update({
            "loading_loaded_bytes": prefault.done_bytes,
            "loading_total_bytes": prefault.total_bytes,
            "loading_loaded_perc": round(100 * prefault.done / max(prefault.total, 1), 2),
            "loading_rate_gbps": round(prefault.rate_bytes_per_s / 1e9, 3),
            "loading_eta_s": -1.0 if eta is None else round(eta, 1),
        })
    eta = index.eta_s if index else 0.0
    fields.update({
        "loading_disk_scanned_slots": index.done if index else 0,
        "loading_disk_slots": index.total if index else 0,
        "loading_disk_scanned_perc": round(100 * index.done / max(index.total, 1), 2)
        if index else 0.0,
        "loading_disk_eta_s": -1.0 if eta is None else round(eta, 1),
    })
    return fields
