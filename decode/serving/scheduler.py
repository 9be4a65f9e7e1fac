"""Continuous batching over the engine's request API, in one thread.

The engine (``add_request`` / ``step`` / ``abort``, see :class:`decode.engine.SpeculativeDecoder`) is not
thread-safe, so one scheduler thread owns it. HTTP handlers (asyncio) talk to it through
:meth:`Scheduler.submit` and :meth:`Scheduler.abort`, which only touch lock-protected queues; the thread applies
them between steps (admission at step boundaries, up to ``max_batch_size`` running requests) and sends each
request's events back to its event loop with ``loop.call_soon_threadsafe``. Stop strings are checked here, on
detokenized text (:class:`decode.stops.StopStringFilter`); a hit aborts the request in the engine and finishes it
with ``"stop"``.

Events put on a request's ``asyncio.Queue``: ``("delta", text)``, ``("done", finish_reason, usage_dict)``,
``("error", APIError)``. Exactly one ``done`` or ``error`` ends every request that was not aborted by its client.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from decode import kernels
from decode.serving.metrics import ServerMetrics
from decode.serving.protocol import APIError, usage
from decode.stops import StopStringFilter

log = logging.getLogger("decode.serving")
_ids = itertools.count()


@dataclass
class GenerationRequest:
    """What a handler asks for: prompt ids, the engine's per-request sampling kwargs (``max_new_tokens``,
    ``temperature``, ``top_k``, ``top_p``, ``min_p``, the three penalties, ``seed``), stop ids (the whole stop set)
    and stop strings."""

    prompt_ids: list[int]
    sampling: dict
    stop_ids: list[int]
    stop_strings: list[str] = field(default_factory=list)
    endpoint: str = "completions"


class Live:
    """A request inside the scheduler: its queue, stop filter and timing."""

    def __init__(self, req: GenerationRequest, loop: asyncio.AbstractEventLoop, tokenizer: Any):
        self.req = req
        self.request_id = f"req-{next(_ids)}"
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.filter = StopStringFilter(tokenizer, req.stop_strings, req.stop_ids)
        self.arrival = time.perf_counter()
        self.t_first: float | None = None
        self.t_last = 0.0
        self.n_tokens = 0
        self.done = False

    def emit(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the client's event loop is closed: nobody is listening
            pass


class Scheduler:
    """Owns ``engine`` in one thread and batches the submitted requests continuously.

    Args:
        engine: an object with the request API (``add_request``, ``step``, ``abort``).
        tokenizer: detokenizes for stop strings.
        metrics: where counts and latencies go.
        max_batch_size: the most requests in the running batch; later ones wait.
        max_queue: the most waiting requests; beyond it :meth:`submit` answers 429 with ``Retry-After``.
    """

    def __init__(self, engine: Any, tokenizer: Any, metrics: ServerMetrics, max_batch_size: int = 16,
                 max_queue: int = 64):
        if max_batch_size < 1 or max_queue < 0:
            raise ValueError(f"max_batch_size must be >= 1 and max_queue >= 0, got {max_batch_size}, {max_queue}")
        self.engine, self.tokenizer, self.metrics = engine, tokenizer, metrics
        self.max_batch_size, self.max_queue = max_batch_size, max_queue
        self._lock = threading.Lock()
        self._waiting: deque[Live] = deque()
        self._aborts: list[str] = []
        self._running: dict[str, Live] = {}
        self._admitting = 0  # taken off the queue, not yet in _running (guarded by _lock, as the queue)
        self._stop_hits: list[str] = []
        self._wake = threading.Event()
        self._accepting = True
        self._stopping = False
        self._abandon = False  # shutdown(drain=False): every request still here ends with a 503
        self._thread = threading.Thread(target=self._run, name="draftkit-scheduler", daemon=True)

    # ---------------------------------------------------------------- called from HTTP handlers (any thread)
    def start(self) -> None:
        self._thread.start()

    def submit(self, req: GenerationRequest, loop: asyncio.AbstractEventLoop) -> Live:
        """Queue ``req``; its events arrive on the returned ``Live.queue`` in ``loop``.

        Raises:
            APIError: 503 while shutting down, 429 when ``max_queue`` requests already wait beyond the batch's
                free rows (both with ``Retry-After``).
        """
        live = Live(req, loop, self.tokenizer)
        with self._lock:
            if not self._accepting:
                raise shutting_down_error()
            running = len(self._running) + self._admitting
            free = max(self.max_batch_size - running, 0)  # rows the next step admits from the queue
            if len(self._waiting) >= self.max_queue + free:
                admitted = min(len(self._waiting), free)  # queued requests the next step admits hold rows
                raise APIError(429, f"the server is busy: {running + admitted} of {self.max_batch_size} batch rows "
                               f"taken (--max-batch-size) and {len(self._waiting) - admitted} of {self.max_queue} "
                               "queue places (--max-queue); retry later",
                               type_="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
            self._waiting.append(live)
            self.metrics.queue_depth.set(len(self._waiting))
        self._wake.set()
        return live

    def abort(self, request_id: str) -> None:
        """Drop a request (its client went away); the engine frees its row before the next step."""
        with self._lock:
            self._aborts.append(request_id)
        self._wake.set()

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting; finish (``drain``) or abort the running and waiting requests; stop the thread.

        With ``drain=False`` every request not yet finished (waiting, being admitted or running) leaves the engine
        and ends with an ``("error", APIError(503, code="shutting_down"))`` event, so no handler waits forever; a
        drain still unfinished after ``timeout`` seconds ends the same way."""
        dropped: list[Live] = []
        with self._lock:
            self._accepting = False
            if not drain:
                self._abandon = True
                dropped, self._waiting = list(self._waiting), deque()
                self.metrics.queue_depth.set(0)
            self._stopping = True
        for live in dropped:  # never admitted: the scheduler thread does not touch them any more
            self._error(live, _shutdown_error())
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if drain and self._thread.is_alive():
            log.warning("shutdown: requests still running after %s s; ending them with 503", timeout)
            self.shutdown(drain=False, timeout=10.0)

    @property
    def num_running(self) -> int:
        return len(self._running)

    # ---------------------------------------------------------------- the scheduler thread
    def _run(self) -> None:
        # One decode.kernels.few_row_linear block per busy period: the engine's packed weight copies are checked
        # against their weights once per period, not once per step, and F.linear is the original while idle.
        busy = contextlib.ExitStack()
        try:
            self._loop(busy)
        finally:
            busy.close()

    def _loop(self, busy: contextlib.ExitStack) -> None:
        in_block = False
        while True:
            self._apply_commands()
            if self._abandon:  # shutdown(drain=False), also for requests admitted while it was called
                self._abort_running(_shutdown_error())
            if not self._running:
                if in_block:
                    busy.close()
                    in_block = False
                with self._lock:
                    if self._stopping and not self._waiting:
                        return
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            if not in_block:
                busy.enter_context(kernels.few_row_linear(bool(getattr(self.engine, "few_row_linear", False))))
                in_block = True
            try:
                finished = self.engine.step()
            except Exception as err:  # a bug: fail this batch, keep serving
                log.exception("engine step failed")
                self._fail_running(err)
                continue
            for out in finished:
                self._on_finished(out)
            for rid in self._stop_hits:  # stop strings: the engine still holds these rows
                if self._running.pop(rid, None) is not None:
                    self.engine.abort(rid)
            self._stop_hits.clear()
            self.metrics.running.set(len(self._running))

    def _apply_commands(self) -> None:
        with self._lock:
            aborts, self._aborts = self._aborts, []
            gone = set(aborts)
            dropped = [live for live in self._waiting if live.request_id in gone]
            if dropped:  # queued, never admitted: they end here, and count as aborted like running ones
                self._waiting = deque(live for live in self._waiting if live.request_id not in gone)
            admit = []
            while self._waiting and len(self._running) + len(admit) < self.max_batch_size:
                admit.append(self._waiting.popleft())
            self._admitting = len(admit)
            self.metrics.queue_depth.set(len(self._waiting))
        for live in dropped:
            live.done = True
            self.metrics.requests.labels(live.req.endpoint, "abort").inc()
        for rid in aborts:
            live = self._running.pop(rid, None)
            if live is not None:
                self.engine.abort(rid)
                live.done = True
                self.metrics.requests.labels(live.req.endpoint, "abort").inc()
        for live in admit:
            self._admit(live)
        self.metrics.running.set(len(self._running))

    def _admit(self, live: Live) -> None:
        req = live.req
        try:
            self.engine.add_request(req.prompt_ids, **req.sampling, eos_token_id=list(req.stop_ids),
                                    on_tokens=self._on_tokens, request_id=live.request_id)
        except (ValueError, TypeError) as err:  # the engine refused this request's values
            self._admitted(None)
            self._error(live, APIError(400, str(err), code="invalid_value"))
            return
        except Exception as err:
            self._admitted(None)
            log.exception("add_request failed")
            self._error(live, APIError(500, f"internal error while admitting the request: {err}"))
            return
        self._admitted(live)
        self.metrics.prompt_tokens.inc(len(req.prompt_ids))

    def _admitted(self, live: Live | None) -> None:
        """One request taken off the queue is now a running row (``live``) or refused (None): the count that
        :meth:`submit` holds against the limits moves from ``_admitting`` to ``_running`` in one locked step."""
        with self._lock:
            self._admitting -= 1
            if live is not None:
                self._running[live.request_id] = live

    def _on_tokens(self, request_id: str, tokens: list[int]) -> None:
        live = self._running.get(request_id)
        if live is not None and not live.done and tokens:
            self._deliver(live, [int(t) for t in tokens])

    def _deliver(self, live: Live, tokens: list[int]) -> None:
        now = time.perf_counter()
        if live.t_first is None:
            live.t_first = now
            self.metrics.ttft.observe(now - live.arrival)
        else:
            gap = (now - live.t_last) / len(tokens)
            for _ in tokens:
                self.metrics.itl.observe(gap)
        live.t_last = now
        counted = live.filter.num_tokens
        text = live.filter.push(tokens)
        counted = live.filter.num_tokens - counted  # ids a step ran past a stop string are not the completion's
        live.n_tokens += counted
        self.metrics.generation_tokens.inc(counted)
        if text:
            live.emit(("delta", text))
        if live.filter.stopped:
            self._finish(live, "stop", None)
            self._stop_hits.append(live.request_id)

    def _on_finished(self, out: Any) -> None:
        live = self._running.get(out.request_id)
        if live is None:
            return
        if not live.done:
            new = [int(t) for t in out.new_tokens]
            if len(new) > live.n_tokens:  # tokens the engine did not pass to on_tokens
                self._deliver(live, new[live.n_tokens:])
        if not live.done:
            self._finish(live, out.finish_reason, getattr(out, "stats", None))
        elif live.request_id in self._stop_hits:
            self._stop_hits.remove(live.request_id)  # it left the engine by itself
            self.metrics.record_stats(getattr(out, "stats", None))
        self._running.pop(out.request_id, None)

    def _finish(self, live: Live, reason: str, stats: Any) -> None:
        live.done = True
        tail = live.filter.flush()
        if tail:
            live.emit(("delta", tail))
        live.emit(("done", reason, usage(len(live.req.prompt_ids), live.n_tokens)))
        self.metrics.requests.labels(live.req.endpoint, reason).inc()
        self.metrics.e2e.observe(time.perf_counter() - live.arrival)
        self.metrics.record_stats(stats)

    def _error(self, live: Live, err: APIError) -> None:
        live.done = True
        live.emit(("error", err))
        self.metrics.requests.labels(live.req.endpoint, "error").inc()

    def _fail_running(self, err: Exception) -> None:
        self._abort_running(APIError(500, f"internal error while decoding: {err.__class__.__name__}: {err}"))

    def _abort_running(self, err: APIError) -> None:
        """Every running request leaves the engine; those not yet finished end with ``err``."""
        for rid, live in list(self._running.items()):
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("engine abort failed")
            if not live.done:
                self._error(live, err)
        self._running.clear()
        self._stop_hits.clear()
        self.metrics.running.set(0)


def shutting_down_error() -> APIError:
    """The 503 for a request that arrives while the server shuts down."""
    return APIError(503, "the server is shutting down; retry on another replica", code="shutting_down",
                    headers={"Retry-After": "5"})


def _shutdown_error() -> APIError:
    return APIError(503, "the server shut down before this request finished; retry on another replica",
                    code="shutting_down", headers={"Retry-After": "5"})
