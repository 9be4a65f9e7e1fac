"""Prometheus metrics of the server (``GET /metrics``, text format), through ``prometheus-client``.

Each app gets its own ``CollectorRegistry`` (so tests can run several servers in one process), with the process
collector (``process_resident_memory_bytes`` and friends) registered on it. Names follow the decode metrics:
acceptance rate = Σaccepted / Σdrafted, mean accepted length τ = Σ(accepted + 1) / verify steps (see
:mod:`decode.metrics`); both are computed from the counters at scrape time, pooled over every finished request.

With a fixed γ > 0 and its cost model (measured at start-up, :func:`decode.cli_args.fixed_gamma_cost_model`), the
predicted speedup of that γ at the per-token acceptance α measured so far is a gauge too; once at least
:data:`decode.cli_args.MIN_DRAFTED_TO_WARN` tokens were drafted and it is below 1, a warning is logged once and kept
in :attr:`ServerMetrics.slowdown_warning` (``GET /health``).
"""
from __future__ import annotations

import logging
import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from decode.cli_args import MIN_DRAFTED_TO_WARN, fixed_gamma_speedup, slowdown_warning

log = logging.getLogger("decode.serving")
SLOWDOWN_FIX = "restart with --num-draft-tokens auto (the default) or 0, or with a better draft"

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    """The server's counters, gauges and histograms on one registry.

    ``gamma`` and ``cost_model``: the server's fixed γ and its cost model at batch size 1 (``{"cost_ratio": c,
    "verify": [v_0, ..]}``), for the slowdown check; None (auto γ, no draft) leaves the check out."""

    def __init__(self, gamma: int | None = None, cost_model: dict | None = None):
        self._sums = [0, 0, 0, 0, 0]  # drafted, accepted, verify steps, new tokens, rejections (derived gauges)
        self.gamma, self.cost_model = (gamma, cost_model) if gamma and cost_model else (None, None)
        self.slowdown_warning: str | None = None
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
        Gauge("draftkit_predicted_speedup", f"Predicted speedup over plain decoding of the fixed γ at the per-token "
              f"acceptance measured so far, by the costs measured at start-up (below 1: slower than the target "
              f"alone; NaN: auto γ, no draft, or fewer than {MIN_DRAFTED_TO_WARN} drafted tokens)",
              registry=r).set_function(self.predicted_speedup)
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
        _, accepted, steps, tokens, _ = self._sums  # as DecodeStats.mean_accepted_length: plain decoding is 1
        return (accepted + steps) / steps if steps else 1.0 if tokens else float("nan")

    def count_rejected(self, status: int) -> None:
        """One request answered with the HTTP error ``status``."""
        self.rejected.labels(str(status)).inc()

    def record_stats(self, stats) -> None:
        """Add a finished request's :class:`decode.metrics.DecodeStats` (or None)."""
        if stats is None:
            return
        counts = [getattr(stats, name, 0) for name in ("num_drafted", "num_accepted", "num_verify_steps",
                                                        "num_new_tokens", "num_rejections")]
        for counter, n in zip((self.drafted, self.accepted, self.verify_steps), counts):
            counter.inc(n)
        self._sums = [a + b for a, b in zip(self._sums, counts)]  # one writer: the scheduler thread
        self._check_slowdown()

    def alpha(self) -> float:
        """Per-token acceptance α = Σaccepted / (Σaccepted + rejections) over finished requests (NaN: no trials)."""
        _, accepted, _, _, rejections = self._sums
        return accepted / (accepted + rejections) if accepted + rejections else float("nan")

    def predicted_speedup(self) -> float:
        """The fixed γ's predicted speedup at :meth:`alpha` (:func:`decode.cli_args.fixed_gamma_speedup`); NaN
        without a fixed γ and its cost model, or before ``MIN_DRAFTED_TO_WARN`` drafted tokens."""
        alpha = self.alpha()
        if self.gamma is None or self._sums[0] < MIN_DRAFTED_TO_WARN or math.isnan(alpha):
            return float("nan")
        return fixed_gamma_speedup(alpha, self.gamma, self.cost_model)

    def _check_slowdown(self) -> None:
        """Log the slowdown warning once, the first time :meth:`predicted_speedup` is below 1."""
        if self.slowdown_warning is not None or not self.predicted_speedup() < 1.0:
            return
        self.slowdown_warning = slowdown_warning(self.alpha(), self._sums[0], self.gamma, self.cost_model,
                                                 SLOWDOWN_FIX)
        log.warning(self.slowdown_warning)

    def render(self) -> bytes:
        return generate_latest(self.registry)
