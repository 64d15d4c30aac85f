"""Typed counters of the spill tiers: one dataclass per tier, INFO fields and Prometheus
families generated from its fields.

Why this file exists: a tier's counters are plain int attributes of a dataclass
(`counter()` fields), incremented on the loop thread with no string built
(docs/architecture.md, "Performance rules"). INFO's fields of a tier are
`<section>_<field name>` in field order (`info_fields`), so that a counter is named once,
where it is declared; a field that names a Prometheus metric (`metric=`) becomes its
counter family there (`counter_families`), read back from INFO's section (the metrics
exporter reads a snapshot of INFO, never the tier). Field names never change once
shipped: they are INFO's.
"""

import dataclasses
from collections.abc import Iterator


def counter(metric: str = "", doc: str = "") -> int:
    """A counter field of a stats dataclass: an int from 0.

    Args:
        metric: the Prometheus counter family it is exported as (e.g.
            "lmcached_l2_writes"); "" for INFO only.
        doc: the family's help text.
    """
    return dataclasses.field(default=0, metadata={"metric": metric, "doc": doc})


def info_fields(stats, prefix: str) -> dict[str, int]:
    """INFO fields of a stats dataclass: `<prefix><field>` -> value, in field order
    (`prefix`: e.g. "l2_", or "" for fields named as they are)."""
    return {prefix + field.name: getattr(stats, field.name)
            for field in dataclasses.fields(stats)}


def counter_families(stats_type, prefix: str) -> Iterator[tuple[str, str, str]]:
    """(INFO field, metric, help) of each field of `stats_type` exported as a metric, in
    field order (`prefix` as `info_fields`')."""
    for field in dataclasses.fields(stats_type):
        if field.metadata.get("metric"):
            yield prefix + field.name, field.metadata["metric"], field.metadata["doc"]
