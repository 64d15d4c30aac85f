"""PrefaultProgress: the figures of the `loading` state (INFO loading_*, the `loading`
refusal, systemd's STATUS=) from the bytes done and the time taken."""

from lmcached.daemon import progress as progress_module
from lmcached.daemon.progress import PrefaultProgress, loading_fields

GiB = 1 << 30


def test_progress_gives_percent_rate_and_time_left(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    progress = PrefaultProgress(4 * GiB)
    assert progress.eta_s is None  # no step yet: no rate
    assert progress.describe() == ("prefaulting the 4.00G arena: 0% (0B), 0.00 GB/s, "
                                   "time left unknown yet")
    now[0] = 102.0
    progress(GiB, 4 * GiB)  # 1 GiB in 2 s
    assert progress.loading and progress.eta_s == 6.0  # 3 GiB left at 0.54 GB/s
    assert progress.describe() == ("prefaulting the 4.00G arena: 25% (1.00G), 0.54 GB/s, "
                                   "6.0 s left")
    assert loading_fields(progress) == {
        "loading": 1, "loading_loaded_bytes": GiB, "loading_total_bytes": 4 * GiB,
        "loading_loaded_perc": 25.0, "loading_rate_gbps": 0.537, "loading_eta_s": 6.0}
    now[0] = 108.0
    progress(4 * GiB, 4 * GiB)
    assert not progress.loading and progress.eta_s == 0.0
    fields = loading_fields(progress)
    assert (fields["loading"], fields["loading_loaded_perc"], fields["loading_eta_s"]) == (
        0, 100.0, 0.0)


def test_without_a_prefault_the_fields_say_not_loading():
    assert loading_fields(None) == {
        "loading": 0, "loading_loaded_bytes": 0, "loading_total_bytes": 0,
        "loading_loaded_perc": 0.0, "loading_rate_gbps": 0.0, "loading_eta_s": 0.0}


def test_status_is_due_once_per_interval(monkeypatch):
    now = [10.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    progress = PrefaultProgress(GiB)
    assert progress.status_due() and not progress.status_due()
    now[0] += progress_module.STATUS_INTERVAL_S
    assert progress.status_due()
