"""Prometheus text format parsing, for tests and tools comparing two scrapes of ``/metrics``."""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_exposition(text: str) -> Samples:
    """Parse Prometheus text format into ``{(sample_name, sorted label pairs): value}``.

    Used by tests to compare scrapes; ``_created`` samples are skipped.
    """
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample_sum(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels`` (0.0 if none; NaN-safe)."""
    total = 0.0
    for (n, lv), v in samples.items():
        if n != name:
            continue
        d = dict(lv)
        if all(d.get(k) == val for k, val in labels.items()) and not math.isnan(v):
            total += v
    return total
