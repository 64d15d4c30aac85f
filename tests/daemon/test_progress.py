"""The loading state's figures (INFO loading_*, the `loading` refusal, systemd's
STATUS=) from what each start-up phase did and the time taken: the disk tier's index
rebuild (IndexProgress, slots) and the arena's prefault (PrefaultProgress, bytes)."""

from lmcached.daemon import progress as progress_module
from lmcached.daemon.progress import IndexProgress, Loading, PrefaultProgress, loading_fields

GiB = 1 << 30
NOT_REBUILT = {"loading_disk_scanned_slots": 0, "loading_disk_slots": 0,
               "loading_disk_scanned_perc": 0.0, "loading_disk_eta_s": 0.0}


def test_progress_gives_percent_rate_and_time_left(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    progress = PrefaultProgress(4 * GiB)
    loading = Loading([progress])
    assert progress.eta_s is None  # no step yet: no rate
    assert progress.describe() == ("prefaulting the 4.00G arena: 0% (0B), 0.00 GB/s, "
                                   "time left unknown yet")
    now[0] = 102.0
    progress(GiB, 4 * GiB)  # 1 GiB in 2 s
    assert progress.loading and progress.eta_s == 6.0  # 3 GiB left at 0.54 GB/s
    assert loading.describe() == ("prefaulting the 4.00G arena: 25% (1.00G), 0.54 GB/s, "
                                  "6.0 s left; the daemon serves once the arena is prefaulted")
    assert loading_fields(loading, True) == {
        "loading": 1, "loading_phase": "prefault", "loading_loaded_bytes": GiB,
        "loading_total_bytes": 4 * GiB, "loading_loaded_perc": 25.0, "loading_rate_gbps": 0.537,
        "loading_eta_s": 6.0, **NOT_REBUILT}
    now[0] = 108.0
    progress(4 * GiB, 4 * GiB)
    assert not progress.loading and progress.eta_s == 0.0
    fields = loading_fields(loading, False)
    assert (fields["loading"], fields["loading_phase"], fields["loading_loaded_perc"],
            fields["loading_eta_s"]) == (0, "none", 100.0, 0.0)


def test_the_index_rebuild_and_the_prefault_are_named_while_they_run(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    index, prefault = IndexProgress(1_000_000), PrefaultProgress(4 * GiB)
    loading = Loading([index, prefault])
    assert loading.describe().startswith(
        "rebuilding the disk tier's index: 0 of 1000000 slots (0%), 0 slots/s, time left "
        "unknown yet; prefaulting the 4.00G arena: 0% ")
    now[0] = 102.0
    prefault(GiB, 4 * GiB)  # both run
    assert loading_fields(loading, True)["loading_phase"] == "disk_index,prefault"
    assert loading.describe().endswith("the daemon serves once the disk tier's index is "
                                       "rebuilt and the arena is prefaulted")
    now[0] = 104.0
    index(250_000, 1_000_000)  # a quarter in 4 s
    prefault(4 * GiB, 4 * GiB)  # the prefault is done first
    assert loading.describe() == (
        "rebuilding the disk tier's index: 250000 of 1000000 slots (25%), 62500 slots/s, "
        "12.0 s left; the daemon serves once the disk tier's index is rebuilt")
    fields = loading_fields(loading, True)
    assert fields["loading"] == 1 and fields["loading_phase"] == "disk_index"
    assert (fields["loading_disk_scanned_slots"], fields["loading_disk_slots"],
            fields["loading_disk_scanned_perc"], fields["loading_disk_eta_s"]) == (
        250_000, 1_000_000, 25.0, 12.0)
    assert fields["loading_loaded_perc"] == 100.0


def test_without_a_prefault_the_fields_say_not_loading():
    assert loading_fields(None, False) == {
        "loading": 0, "loading_phase": "none", "loading_loaded_bytes": 0,
        "loading_total_bytes": 0, "loading_loaded_perc": 0.0, "loading_rate_gbps": 0.0,
        "loading_eta_s": 0.0, **NOT_REBUILT}


def test_status_is_due_once_per_interval(monkeypatch):
    now = [10.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    loading = Loading([PrefaultProgress(GiB)])
    assert loading.status_due() and not loading.status_due()
    now[0] += progress_module.STATUS_INTERVAL_S
    assert loading.status_due()
