"""The service's latency histograms against prometheus_client's own Histogram: the same
exposition for the same values, bounds included (Prometheus buckets are `le`)."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from service.metrics import LATENCY_BUCKETS, P, LatencyHistogram


def exposition_lines(registry: CollectorRegistry) -> list[str]:
    # prometheus_client's Histogram adds a `_created` timestamp series; ours has none.
    return [line for line in generate_latest(registry).decode().splitlines()
            if "_created" not in line]


def test_latency_histogram_exposes_what_prometheus_clients_histogram_does():
    rng = random.Random(0)
    values = [*LATENCY_BUCKETS, 0.0, 1e-9, 1e3]  # each bound exactly, and both ends
    values += [rng.choice(LATENCY_BUCKETS) * rng.uniform(0.5, 1.5) for _ in range(500)]
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Histogram(P + "probe_seconds", "doc", buckets=LATENCY_BUCKETS, registry=theirs)
    histogram = LatencyHistogram("probe_seconds", "doc")
    ours.register(histogram)
    for v in values:
        reference.observe(v)
    for v in values:
        histogram.observe(v)
    assert exposition_lines(ours) == exposition_lines(theirs)


def test_a_chunk_counts_each_of_its_intervals():
    single, chunked = LatencyHistogram("a_seconds", "doc"), LatencyHistogram("b_seconds", "doc")
    for _ in range(3):
        single.observe(0.03)
    chunked.observe(0.03, 3)
    assert chunked.counts == single.counts and sum(chunked.counts) == 3
    assert chunked.sum == pytest.approx(single.sum) and single.sum == pytest.approx(0.09)
