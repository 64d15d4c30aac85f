"""The metric families generated from the typed counters (`spill.counters`, `DiskStats`,
`L2Stats`, `DemotionStats`, `TenantRow`, the L2 store's errors): every counter INFO shows
is one sample of exactly one family, with the label value its declaration gives, and a
counter no family shows is one of a pinned list (INFO only, on purpose).

Each INFO field gets a value no other field has, so a sample's value says which field it
was read from: a family that reads the wrong field, or a field read twice, fails here.
"""

import dataclasses
import itertools
import os
import re

import pytest

from lmcached.daemon.demotion import DemotionStats
from lmcached.daemon.disk.counters import DiskStats
from lmcached.daemon.info import TIER_BLOCK_STATES, DeviceTierRow, tenant_fields
from lmcached.daemon.l2.counters import ERROR_KINDS, L2Stats, error_fields
from lmcached.daemon.metrics import (
    DEMOTION_ERROR_CODE,
    Snapshot,
    device_tier_families,
    disk_families,
    l2_families,
    metric_families,
)
from lmcached.daemon.spill.counters import LabelledFamily, counter, info_fields
from lmcached.daemon.stats import StatsSnapshot, TenantRow

# Counters INFO shows and no metric family does, each with why (a new counter is either
# exported, by `counter(metric=)` or `counter(family=, label=)`, or added here).
INFO_ONLY = {
    DiskStats: {
        "spills_present": "an eviction that needed no write: how writes are saved, no fault",
        "spills_ahead": "an eviction its write ahead had covered: the same, no fault",
        "fetches_joined": "a lookup that shared a read in flight: no cost, no fault",
    },
    L2Stats: {
        "clears": "CLEARs run here: an operator's own commands, not the daemon's health",
        "fetches_joined": "a lookup that shared a fetch in flight: no cost, no fault",
    },
    DemotionStats: {},
}
# The label values of each labelled family, as shipped (docs/metrics.md); each is read
# from the field named `..._<label value>`.
LABELS = {
    "lmcached_disk_write_drops": ["queue_full", "oversize", "busy", "late"],
    "lmcached_disk_fetch_rejects": ["verify_checksum", "verify_envelope", "verify_foreign",
                                    "verify_tokens"],
    "lmcached_disk_errors": ["nospace", "io", "readonly", "other"],
    "lmcached_l2_write_drops": ["queue_full", "down", "oversize"],
    "lmcached_l2_fetch_rejects": ["nospace", "oversize", "gone", "verify_envelope",
                                  "verify_foreign", "verify_checksum", "verify_tokens"],
    "lmcached_demotion_skips": ["deduplicated", "dropped", "aborted"],
}


def distinct_values(fields) -> dict[str, int]:
    """{field: a value no other field has} (1000, 1001, ...: above any count the rest of
    a section holds here)."""
    return dict(zip(fields, itertools.count(1000)))


def samples_by_value(families) -> dict[float, list[tuple[str, dict]]]:
    """{sample value: [(sample name, labels), ...]} of every sample of `families`."""
    out: dict[float, list] = {}
    for family in families:
        for sample in family.samples:
            out.setdefault(sample.value, []).append((sample.name, sample.labels))
    return out


def declared(stats_type, name: str):
    """(metric, LabelledFamily, label, divisor) declared on a field of `stats_type`."""
    meta = next(f for f in dataclasses.fields(stats_type) if f.name == name).metadata
    return meta["metric"], meta["family"], meta["label"], meta["divisor"]


def tier_sections():
    """(stats type, INFO prefix, families of an INFO section with the values given)."""
    disk_base = {"disk_enabled": 1, "disk_used_slots": 1, "disk_slots": 2,
                 "disk_stored_bytes": 3, "disk_evictions": 4}
    l2_base = {"l2_enabled": 1, "l2_state": "up", "l2_queue_bytes": 1, "l2_queue_values": 2,
               "l2_reconnects": 3, **error_fields({})}
    row = DeviceTierRow(tier_id=1, kind="fake", device="fake-0", failed=False,
                        capacity_bytes=1, stored_bytes=2, num_blocks=3,
                        blocks=dict.fromkeys(TIER_BLOCK_STATES, 4), hits=5)
    return [
        (DiskStats, "disk_", lambda values: disk_families({**disk_base, **values})),
        (L2Stats, "l2_", lambda values: l2_families({**l2_base, **values})),
        (DemotionStats, "", lambda values: device_tier_families(
            [row], DemotionStats(**values))),
    ]


@pytest.mark.parametrize("stats_type, prefix, families", tier_sections(),
                         ids=["disk", "l2", "demotion"])
def test_every_tier_counter_is_one_sample_of_one_family_or_info_only(stats_type, prefix,
                                                                     families):
    names = [f.name for f in dataclasses.fields(stats_type)]
    values = distinct_values(names)
    section = {prefix + name: value for name, value in values.items()}
    found = samples_by_value(families(section))
    for name, value in values.items():
        metric, family, label, divisor = declared(stats_type, name)
        shown = found.get(value / divisor, [])
        if name in INFO_ONLY[stats_type]:
            assert not metric and family is None and not shown, name
        elif family is not None:
            assert shown == [(family.metric + "_total", {family.label: label})], name
            assert name.endswith("_" + label) and label in LABELS[family.metric], name
        else:
            assert shown == [(metric + "_total", {})], name
    for family in families(section):
        if family.name in LABELS:
            assert [[*s.labels.values()] for s in family.samples] == [
                [label] for label in LABELS[family.name]], family.name
    exported = {n for n in names if n not in INFO_ONLY[stats_type]}
    assert exported == {n for n in names if declared(stats_type, n)[0]
                        or declared(stats_type, n)[1] is not None}


def test_the_l2_store_errors_are_one_sample_each_of_lmcached_l2_errors():
    values = distinct_values(ERROR_KINDS)
    fields = error_fields(values)
    assert list(fields) == [f"l2_errors_{kind}" for kind in sorted(ERROR_KINDS)]
    l2 = {"l2_enabled": 1, "l2_state": "up", "l2_queue_bytes": 1, "l2_queue_values": 2,
          "l2_reconnects": 3, **info_fields(L2Stats(), "l2_"), **fields}
    found = samples_by_value(l2_families(l2))
    for kind, value in values.items():
        assert found[value] == [("lmcached_l2_errors_total", {"kind": kind})], kind


def snapshot(errors: dict[str, int], tenants: dict[str, TenantRow],
             demotion: DemotionStats | None) -> Snapshot:
    """A snapshot of an idle daemon but for `errors`, `tenants` and `demotion`."""
    counters = StatsSnapshot(requests=1, connections_received=2, lookups=3, stores=4,
                             hits=5, misses=6, evictions=7, total_stored_bytes=8,
                             total_served_bytes=9, writing_expired=10, invalidated_chunks=11,
                             errors=errors, tier_hits=(0,), tenants=tenants)
    info = {"server": {"version": "v", "name": "n", "generation": 1, "protocol_version": 1},
            "memory": dict.fromkeys(("capacity_bytes", "block_bytes", "used_bytes",
                                     "stored_bytes", "fill_ratio"), 0),
            "blocks": dict.fromkeys(("num_blocks", "cached_blocks", "evictable_blocks",
                                     "free_blocks", "detached_blocks", "writing_blocks",
                                     "cached_values"), 0),
            "clients": dict.fromkeys(("connected_clients", "namespaces",
                                      "namespaces_sglang"), 0),
            "stats": dict.fromkeys(("events_published", "events_lost", "events_snapshot_sent",
                                    "events_subscribers", "events_subscribers_lagging"), 0),
            "l2": {"l2_enabled": 0}, "disk": {"disk_enabled": 0}}
    rows = [] if demotion is None else [DeviceTierRow(
        tier_id=1, kind="fake", device="fake-0", failed=False, capacity_bytes=0,
        stored_bytes=0, num_blocks=0, blocks=dict.fromkeys(TIER_BLOCK_STATES, 0), hits=0)]
    return Snapshot(info, counters, [], {}, 0.0, rows, demotion)


def test_every_error_code_is_one_sample_of_lmcached_errors():
    """INFO errors_<code> (`info.stats_fields`) -> lmcached_errors{code}; the demotion
    errors are also their own counter (lmcached_demotion_errors), the one counter shown
    twice."""
    errors = distinct_values(("bad_request", "not_owner", "idle_timeout"))
    demotion = DemotionStats(errors_demotion=2000)
    found = samples_by_value(metric_families(snapshot(errors, {}, demotion)))
    for code, value in errors.items():
        assert found[value] == [("lmcached_errors_total", {"code": code})], code
    assert sorted(found[2000]) == [("lmcached_demotion_errors_total", {}),
                                   ("lmcached_errors_total", {"code": DEMOTION_ERROR_CODE})]
    without_tiers = samples_by_value(metric_families(snapshot(errors, {}, None)))
    assert 2000 not in without_tiers  # no errors_demotion without device tiers


def test_every_tenant_field_is_one_sample_of_its_tenant_family():
    values = itertools.count(3000)
    tenants = {name: TenantRow(next(values), next(values), next(values))
               for name in ("unsalted", "other", "0123456789abcdef")}
    snap = snapshot({}, tenants, None)
    found = samples_by_value(metric_families(snap))
    fields = tenant_fields(snap.stats)
    assert fields["tenants_tracked"] == 1
    metric_of = {"hits": "lmcached_tenant_hit_chunks", "misses": "lmcached_tenant_miss_chunks",
                 "lookups": "lmcached_tenant_lookups"}
    for name, row in tenants.items():
        for field, metric in metric_of.items():
            value = getattr(row, field)
            assert fields[f"tenant_{name}_{field}"] == value
            assert found[value] == [(metric + "_total", {"tenant": name})], (name, field)


def test_a_counter_is_in_one_family_only():
    drops = LabelledFamily("lmcached_x_drops", "x", "reason")
    with pytest.raises(ValueError, match="one family"):
        counter("lmcached_x", "x", family=drops, label="full")
    with pytest.raises(ValueError, match="label value"):
        counter(family=drops)


def test_no_metric_family_reads_an_info_field_by_a_name_it_builds():
    """metrics.py names INFO fields only as written literals or through the typed
    counters: no f-string or concatenated subscript, no prefix match over a section."""
    path = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "lmcached",
                        "daemon", "metrics.py")
    with open(path) as f:
        source = f.read()
    assert not re.findall(r"\[f\"|\[\w+ \+ |\.startswith\(\"(?:errors|l2|disk|tier)",
                          source)
