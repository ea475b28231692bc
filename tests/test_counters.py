"""The plain counters every owner bumps, and how metrics renders them."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from kvtier.counters import Counts, Histograms
from kvtier.metrics import _histogram


def test_counts_by_label_and_bound_cells() -> None:
    c = Counts("tier", "outcome")
    cell = c.bind("s3", "ok")
    cell.inc()
    cell.inc(2)
    c.inc("s3", "error")
    assert c.value("s3", "ok") == 3 and c.value("s3", "error") == 1 and c.value("x", "y") == 0
    assert c.total() == 4
    assert sorted(c.samples()) == [(("s3", "error"), 1.0), (("s3", "ok"), 3.0)]
    with pytest.raises(ValueError, match="labels"):
        c.bind("s3")


def test_histogram_matches_prometheus_client_exposition() -> None:
    bounds = (0.001, 0.01, 0.1, 1.0)
    ours = Histograms(bounds, "op")
    registry = CollectorRegistry()
    theirs = Histogram("x_seconds", "doc", ["op"], buckets=bounds, registry=registry)
    for v in (0.0005, 0.001, 0.002, 0.05, 0.5, 3.0, 1.0):
        ours.observe(v, "get")
        theirs.labels("get").observe(v)
    cell = ours.bind("get")
    assert cell.count == 7 and sum(cell.buckets) == 7
    family = _histogram("x_seconds", "doc", ours)
    mine = {s.name + str(sorted(s.labels.items())): s.value for s in family.samples}
    (reference,) = [m for m in registry.collect() if m.name == "x_seconds"]
    expected = {
        s.name + str(sorted(s.labels.items())): s.value
        for s in reference.samples
        if not s.name.endswith("_created")
    }
    assert mine == pytest.approx(expected)
    assert b'x_seconds_bucket{le="+Inf",op="get"} 7.0' in generate_latest(registry)


def test_bounds_must_be_sorted() -> None:
    with pytest.raises(ValueError, match="sorted"):
        Histograms((1.0, 0.5))
