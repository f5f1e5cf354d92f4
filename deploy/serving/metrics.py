"""The server's Prometheus metrics: requests by outcome, latency and batch-size histograms,
the queue, the batcher's busy time.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


# Seconds; fine enough for GPU batches of a millisecond, wide enough for CPU ones of seconds.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Metrics:
    """Prometheus metrics of one server, in a registry of its own (two servers
    in one process, as in the tests, do not share counters)."""

    def __init__(self, model: str):
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            Gauge,
            Histogram,
            ProcessCollector,
            disable_created_metrics,
        )

        disable_created_metrics()  # the *_created series only double every metric's size
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        p = "tvm_serve_"
        self.requests = Counter(p + "requests", "Inference requests by outcome (success, bad_request, not_found, "
                                "too_large, overloaded, not_ready, timeout, disconnected, shutdown, error)",
                                ["model", "outcome"], registry=r)
        self.latency = Histogram(p + "request_seconds", "Arrival to response of successful inference requests",
                                 ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram(p + "queue_seconds", "Enqueued to the start of its batch", ["model"],
                               buckets=LATENCY_BUCKETS, registry=r)
        self.compute = Histogram(p + "compute_seconds", "One batch from its launch (rows already in host memory) to its outputs back",
                                 ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_rows = Histogram(p + "batch_rows", "Samples per batch, before padding", ["model"],
                                    buckets=ROW_BUCKETS, registry=r)
        self.batch_requests = Histogram(p + "batch_requests", "Requests merged into one batch", ["model"],
                                        buckets=ROW_BUCKETS, registry=r)
        self.bucket_runs = Counter(p + "bucket_runs", "Module runs per batch bucket (a split request counts "
                                   "each piece)", ["model", "bucket"], registry=r)
        self.padded_rows = Counter(p + "padded_rows", "Padding rows run to fill a bucket", ["model"], registry=r)
        self.in_flight = Gauge(p + "in_flight", "Inference requests being read, queued or run", ["model"], registry=r)
        self.ready = Gauge(p + "ready", "1 once the package is loaded and warmed up", ["model"], registry=r)
        self.model = model
        self._children: dict = {}

    def child(self, metric, *labels: str):
        """`metric.labels(self.model, *labels)`, looked up once: labels()
        validates, locks and builds a key on every call, several times per
        request. Children are still created on first use (a series appears
        when it is first counted, as before)."""
        key = (metric, labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(self.model, *labels)
        return c
