"""Prometheus metrics (GET /metrics), named as vLLM's under an `fmserve:` prefix.

Latencies are histograms observed as replies go out (service/replies.py); everything the
service already counts (service/counters.py, the scheduler's accounting, draft acceptance) is
read at scrape time by a collector, so no number is kept twice. Each Service has its own
registry: tests run several in one process. The gauges of requests and KV use sum over the
data-parallel replicas; `fmserve:replica_*` series give each replica's, labelled `replica`.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily)
from prometheus_client.utils import floatToGoString

from ipc.client_messages import ReplicaStatus
from ipc.spec_settings import SpecSettings
from service.counters import ServiceCounters

P = "fmserve:"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)


class LatencyHistogram:
    """A histogram of seconds over LATENCY_BUCKETS, observed once per token on the step loop:
    bucket counts in a list and a sum, no lock (observed and scraped on the event loop's one
    thread). prometheus_client's Histogram.observe took 1.7 us a value here (a lock, two
    counters of their own): ~55 us a step at 32 streams, on the path a GPU's worker waits on."""

    def __init__(self, name: str, doc: str) -> None:
        self.name, self.doc = P + name, doc
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last one: above every bound
        self.sum = 0.0

    def observe(self, seconds: float, times: int = 1) -> None:
        """`seconds`, `times` times over (a chunk of k tokens: k intervals of one length)."""
        self.counts[bisect_left(LATENCY_BUCKETS, seconds)] += times  # le: bound inclusive
        self.sum += seconds * times

    def collect(self):
        buckets, total = [], 0
        for bound, count in zip((*LATENCY_BUCKETS, float("inf")), self.counts):
            total += count
            buckets.append((floatToGoString(bound), total))
        yield HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=self.sum)


class _CountersCollector:
    """Counters and gauges from what the service counts, read when Prometheus scrapes."""

    def __init__(self, counters: ServiceCounters, schedulers: Callable[[], list],
                 replicas: Callable[[], list[ReplicaStatus]], worker_state: Callable[[], str],
                 drafts_per_verify: int) -> None:
        self.counters, self.schedulers, self.worker_state = counters, schedulers, worker_state
        self.replicas = replicas
        self.drafts_per_verify = drafts_per_verify

    def collect(self):
        c, schedulers = self.counters, self.schedulers()
        yield CounterMetricFamily(P + "prompt_tokens", "Prefilled prompt tokens of finished "
                                  "requests", value=c.prompt_tokens)
        yield CounterMetricFamily(P + "generation_tokens", "Output tokens sent to clients",
                                  value=c.output_tokens)
        success = CounterMetricFamily(P + "request_success", "Requests ended, by finish "
                                      "reason (error: failed)", labels=["finished_reason"])
        for reason, n in sorted(c.finished_by_reason.items()):
            success.add_metric([reason], n)
        yield success
        yield CounterMetricFamily(P + "worker_restarts", "Worker processes restarted after "
                                  "dying", value=c.worker_restarts)
        yield CounterMetricFamily(P + "clients_cut_off", "ZMQ clients cut off for leaving "
                                  "service.max_queued_replies unread", value=c.clients_cut_off)
        yield GaugeMetricFamily(P + "worker_idle_share", "Share of step time the worker waited "
                                "for the scheduler while work was queued (overlap hides it)",
                                value=c.worker_idle_share)
        up = GaugeMetricFamily(P + "worker_state", "1 for the worker's current state",
                               labels=["state"])
        for state in ("ready", "restarting", "down"):
            up.add_metric([state], float(self.worker_state() == state))
        yield up
        if not schedulers:
            return
        accs = [s.core.accounting() for s in schedulers]
        acc = {k: sum(a[k] for a in accs) for k in accs[0]}
        yield GaugeMetricFamily(P + "num_requests_running", "Requests holding a slot",
                                value=acc["running"])
        yield GaugeMetricFamily(P + "num_requests_waiting", "Requests queued for a slot",
                                value=acc["waiting"])
        used = acc["total_pages"] - acc["free_pages"]
        yield GaugeMetricFamily(P + "kv_cache_usage_perc", "Share of KV pages in use (0-1)",
                                value=used / max(1, acc["total_pages"]))
        yield CounterMetricFamily(P + "prefix_cache_hits", "Prompt tokens served from the "
                                  "prefix cache", value=acc["prefix_cache_hit_tokens"])
        yield from self._per_replica()
        spec = schedulers[0].core.spec_stats  # one for all replicas
        yield CounterMetricFamily(P + "spec_decode_num_drafts", "Verify steps (one request's "
                                  "draft tree checked once)", value=spec.verify_steps)
        yield CounterMetricFamily(P + "spec_decode_num_draft_tokens", "Draft tokens proposed "
                                  "for verification", value=spec.verify_steps
                                  * self.drafts_per_verify)
        yield CounterMetricFamily(P + "spec_decode_num_accepted_tokens", "Draft tokens "
                                  "accepted", value=spec.accepted_drafts)
        yield GaugeMetricFamily(P + "spec_decode_mean_accept_length", "Tokens per verify step "
                                "since start (accepted drafts + 1); 0 before any",
                                value=(spec.verify_steps + spec.accepted_drafts)
                                / spec.verify_steps if spec.verify_steps else 0.0)


    def _per_replica(self):
        """Each data-parallel replica's requests, KV use and worker state."""
        statuses = self.replicas()
        running = GaugeMetricFamily(P + "replica_num_requests_running", "Requests holding a "
                                    "slot, per replica", labels=["replica"])
        waiting = GaugeMetricFamily(P + "replica_num_requests_waiting", "Requests queued for "
                                    "a slot, per replica", labels=["replica"])
        kv = GaugeMetricFamily(P + "replica_kv_cache_usage_perc", "Share of a replica's KV "
                               "pages in use (0-1)", labels=["replica"])
        up = GaugeMetricFamily(P + "replica_worker_state", "1 for each replica's worker state",
                               labels=["replica", "state"])
        for r in statuses:
            label = str(r.index)
            running.add_metric([label], r.running)
            waiting.add_metric([label], r.waiting)
            kv.add_metric([label], (r.total_pages - r.free_pages) / max(1, r.total_pages))
            for state in ("ready", "restarting", "down"):
                up.add_metric([label, state], float(r.worker_state == state))
        yield from (running, waiting, kv, up)


class ServiceMetrics:
    def __init__(self, counters: ServiceCounters, schedulers: Callable[[], list],
                 replicas: Callable[[], list[ReplicaStatus]], worker_state: Callable[[], str],
                 spec: SpecSettings) -> None:
        """`schedulers` and `replicas`: the data-parallel replicas' (one with dp = 1)."""
        # Draft tokens one verify step checks: the tree's tokens less its root.
        drafts_per_verify = 0 if spec.algorithm == "none" else spec.num_draft_tokens - 1
        self.registry = CollectorRegistry()
        self.registry.register(_CountersCollector(counters, schedulers, replicas, worker_state,
                                                  drafts_per_verify))

        def histogram(name: str, doc: str) -> LatencyHistogram:
            h = LatencyHistogram(name, doc)
            self.registry.register(h)
            return h
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first output token")
        self.itl = histogram("inter_token_latency_seconds", "Between two output tokens of a "
                             "request (a chunk of k tokens counts k intervals)")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the terminal message")

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
