"""`GET /metrics`: Prometheus metrics of one server (its own registry, so several can share a process).

The server observes each finished request: `ling_requests_total{finish_reason}`, and the
histograms `ling_time_to_first_token_seconds`, `ling_time_per_output_token_seconds` (from the
first new token to the last, per token after the first; requests of 2+ tokens) and
`ling_e2e_request_latency_seconds` (submission to finish), all from the engine's handle times.
Every value of `engine.stats()` is read at scrape time as `ling_engine_<key>`: a counter where the
key ends in `_total`, else a gauge (running, waiting, pages_used, pages_total, and the spec_* /
prefix_* keys of an engine with speculation or a prefix cache).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                  0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
_STATS_HELP = {
    "running": "requests in the engine's batch",
    "waiting": "requests queued for a slot",
    "pages_used": "latent-cache pages in use",
    "pages_total": "latent-cache pages in the pool",
    "prompt_tokens_total": "prompt tokens admitted",
    "generation_tokens_total": "new tokens generated",
    "requests_total": "requests the engine finished",
    "prefill_chunks_total": "prompt chunks prefilled",
    "prefill_calls_total": "prefill calls (each runs the chunks of up to --prefill-rows prompts)",
    "decode_calls_total": "decode calls",
    "decode_steps_total": "decode steps (a speculative call counts one)",
    "decode_row_steps_total": "decode steps times the requests decoding in them",
    "decode_slot_steps_total": "decode steps times the slots they computed (their bucket)",
    "spec_verify_calls": "speculative calls (MTP drafts verified by the main model)",
    "spec_draft_tokens": "MTP drafts verified",
    "spec_accepted_tokens": "MTP drafts accepted",
}


class _EngineStats:
    """A collector of `engine.stats()`, read at each scrape."""

    def __init__(self, engine: Any):
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        for key, value in sorted(self.engine.stats().items()):
            doc = _STATS_HELP.get(key, f"engine.stats()['{key}']")
            family = CounterMetricFamily if key.endswith("_total") else GaugeMetricFamily
            yield family(f"ling_engine_{key}", doc, value=float(value))


class Metrics:
    def __init__(self, engine: Any):
        self.registry = CollectorRegistry()
        self.requests = Counter("ling_requests", "finished requests by finish reason", ["finish_reason"],
                                registry=self.registry)
        self.ttft = Histogram("ling_time_to_first_token_seconds", "submission to the first new token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("ling_time_per_output_token_seconds", "time per new token after the first",
                              buckets=_TOKEN_BUCKETS, registry=self.registry)
        self.e2e = Histogram("ling_e2e_request_latency_seconds", "submission to the request's end",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_EngineStats(engine))

    def observe(self, handle: Any, finish_reason: str, n_tokens: int) -> None:
        """One finished request: its handle's times (`submitted`, `first_token_at` or None; `finished_at`,
        or now where the engine has not finished the handle yet: a stop string's cancel) and its
        number of new tokens."""
        self.requests.labels(finish_reason).inc()
        first = handle.first_token_at
        end = handle.finished_at if handle.finished_at is not None else time.perf_counter()
        self.e2e.observe(end - handle.submitted)
        if first is not None:
            self.ttft.observe(first - handle.submitted)
            if n_tokens > 1:
                self.tpot.observe((end - first) / (n_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
