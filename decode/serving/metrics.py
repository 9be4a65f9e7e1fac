"""Prometheus metrics of the server (``GET /metrics``, text format), through ``prometheus-client``.

Each app gets its own ``CollectorRegistry`` (so tests can run several servers in one process), with the process
collector (``process_resident_memory_bytes`` and friends) registered on it. Names follow the decode metrics:
acceptance rate = Σaccepted / Σdrafted, mean accepted length τ = Σ(accepted + 1) / verify steps (see
:mod:`decode.metrics`); both are computed from the counters at scrape time, pooled over every finished request.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    """The server's counters, gauges and histograms on one registry."""

    def __init__(self):
        self._sums = [0, 0, 0, 0]  # drafted, accepted, verify steps, new tokens (for the derived gauges)
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        self.requests = Counter("draftkit_requests", "Finished requests by endpoint and finish reason "
                                "(stop, length, abort, error)", ["endpoint", "finish_reason"], registry=r)
        self.rejected = Counter("draftkit_rejected_requests", "Requests answered with an HTTP error, by status",
                                ["status"], registry=r)
        self.prompt_tokens = Counter("draftkit_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("draftkit_generation_tokens", "Generated tokens", registry=r)
        self.drafted = Counter("draftkit_drafted_tokens", "Draft tokens proposed (finished requests)", registry=r)
        self.accepted = Counter("draftkit_accepted_tokens", "Draft tokens accepted (finished requests)", registry=r)
        self.verify_steps = Counter("draftkit_verify_steps", "Verify steps (finished requests)", registry=r)
        Gauge("draftkit_acceptance_rate", "Σaccepted / Σdrafted over finished requests (NaN: nothing drafted)",
              registry=r).set_function(self._acceptance_rate)
        Gauge("draftkit_mean_accepted_length", "τ = Σ(accepted + 1) / verify steps over finished requests (1: "
              "tokens without verify steps, plain decoding; NaN: no tokens yet)",
              registry=r).set_function(self._mean_accepted_length)
        self.queue_depth = Gauge("draftkit_queue_depth", "Requests waiting for a batch slot", registry=r)
        self.running = Gauge("draftkit_running_requests", "Requests in the running batch", registry=r)
        self.ttft = Histogram("draftkit_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("draftkit_inter_token_latency_seconds", "Seconds per token between deliveries "
                             "(a step's accepted window shares the gap)", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("draftkit_request_latency_seconds", "Arrival to finish", buckets=LATENCY_BUCKETS,
                             registry=r)

    def _acceptance_rate(self) -> float:
        drafted, accepted = self._sums[:2]  # undefined without drafts: NaN (generate --json: null), not a 0 rate
        return accepted / drafted if drafted else float("nan")

    def _mean_accepted_length(self) -> float:
        _, accepted, steps, tokens = self._sums  # as DecodeStats.mean_accepted_length: plain decoding is 1
        return (accepted + steps) / steps if steps else 1.0 if tokens else float("nan")

    def count_rejected(self, status: int) -> None:
        """One request answered with the HTTP error ``status``."""
        self.rejected.labels(str(status)).inc()

    def record_stats(self, stats) -> None:
        """Add a finished request's :class:`decode.metrics.DecodeStats` (or None)."""
        if stats is None:
            return
        counts = [getattr(stats, name, 0) for name in ("num_drafted", "num_accepted", "num_verify_steps",
                                                        "num_new_tokens")]
        for counter, n in zip((self.drafted, self.accepted, self.verify_steps), counts):
            counter.inc(n)
        self._sums = [a + b for a, b in zip(self._sums, counts)]  # one writer: the scheduler thread

    def render(self) -> bytes:
        return generate_latest(self.registry)
