"""Typed counters of the spill tiers: one dataclass per tier, INFO fields and Prometheus
families generated from its fields.

Why this file exists: a tier's counters are plain int attributes of a dataclass
(`counter()` fields), incremented on the loop thread with no string built
(docs/architecture.md, "Performance rules"). INFO's fields of a tier are
`<section>_<field name>` in field order (`info_fields`), so that a counter is named once,
where it is declared. A field that names a Prometheus metric (`metric=`) becomes its
counter family (`counter_families`); a field that names a `LabelledFamily` and a label
value (`family=`, `label=`) becomes one sample of that family (`labelled_families`), so
that "drops by reason" and "errors by kind" are declared beside the counters they show.
The exporter reads both back from INFO's section (it reads a snapshot of INFO, never
the tier). Field names never change once shipped: they are INFO's.
"""

import dataclasses
from collections.abc import Iterable, Iterator


@dataclasses.dataclass(frozen=True)
class LabelledFamily:
    """A Prometheus counter family with one label, whose samples are counters named
    elsewhere: the fields of a stats dataclass that name it (`counter(family=)`), or the
    INFO fields of `counts_fields` (counts kept in a dict, e.g. the L2 store's errors).

    Attributes:
        metric: the family's name (e.g. "lmcached_disk_write_drops").
        doc: its help text.
        label: its label's name (e.g. "reason", "kind").
    """

    metric: str
    doc: str
    label: str

    def counts_fields(self, prefix: str, counts: dict[str, int],
                      values: Iterable[str]) -> dict[str, int]:
        """INFO fields of counts kept in a dict: `<prefix><value>` -> counts[value], for
        each of `values` (the label values, in INFO's order; 0 for one not counted yet).
        `samples_of_counts` names the same fields."""
        return {prefix + value: counts.get(value, 0) for value in values}

    def samples_of_counts(self, prefix: str,
                          values: Iterable[str]) -> tuple[tuple[str, str], ...]:
        """(label value, INFO field) of each of `values`, as `counts_fields` names them."""
        return tuple((value, prefix + value) for value in values)


def counter(metric: str = "", doc: str = "", *, family: LabelledFamily | None = None,
            label: str = "", divisor: float = 1) -> int:
    """A counter field of a stats dataclass: an int from 0.

    Args:
        metric: the Prometheus counter family it is exported as (e.g.
            "lmcached_l2_writes"); "" for none.
        doc: the family's help text.
        family: a labelled family it is one sample of, with label value `label`; a
            field is in at most one family, `metric`'s or `family`'s.
        label: its label value in `family`.
        divisor: the counter's units per unit of its metric (1e6: a counter of
            microseconds exported in seconds).

    Raises:
        ValueError: both `metric` and `family`, or `family` without `label` (a bug in
            the dataclass's declaration).
    """
    if family is not None and (metric or not label):
        raise ValueError(f"counter(family={family.metric!r}): give a label value and no "
                         "metric of its own (a counter is in one family)")
    return dataclasses.field(default=0, metadata={"metric": metric, "doc": doc,
                                                  "family": family, "label": label,
                                                  "divisor": divisor})


def info_fields(stats, prefix: str) -> dict[str, int]:
    """INFO fields of a stats dataclass: `<prefix><field>` -> value, in field order
    (`prefix`: e.g. "l2_", or "" for fields named as they are)."""
    return {prefix + field.name: getattr(stats, field.name)
            for field in dataclasses.fields(stats)}


def counter_families(stats_type, prefix: str) -> Iterator[tuple[str, str, str, float]]:
    """(INFO field, metric, help, divisor) of each field of `stats_type` exported as a
    metric of its own, in field order (`prefix` as `info_fields`'; the metric's value is
    the field's / divisor)."""
    for field in dataclasses.fields(stats_type):
        if field.metadata.get("metric"):
            yield (prefix + field.name, field.metadata["metric"], field.metadata["doc"],
                   field.metadata["divisor"])


def labelled_families(stats_type, prefix: str
                      ) -> Iterator[tuple[LabelledFamily, tuple[tuple[str, str], ...]]]:
    """(family, its samples as (label value, INFO field)) of each `LabelledFamily` the
    fields of `stats_type` name, in the order of their first fields; samples in field
    order (`prefix` as `info_fields`')."""
    samples: dict[LabelledFamily, list[tuple[str, str]]] = {}
    for field in dataclasses.fields(stats_type):
        family = field.metadata.get("family")
        if family is not None:
            samples.setdefault(family, []).append((field.metadata["label"],
                                                   prefix + field.name))
    for family, rows in samples.items():
        yield family, tuple(rows)
