"""The work behind the routes of :mod:`decode.serving.app`: :class:`OpenAIServing` (held on ``app.state.serving``)
answers ``/health``, ``/v1/models`` and the two completion endpoints.

A completion: read and parse the body (:mod:`decode.serving.parsing`), tokenize in the tokenizer's thread, submit
to the :class:`decode.serving.scheduler.Scheduler`, then answer from the request's event queue with one JSON body
(:func:`collect_response`) or a stream of server-sent events ending with ``data: [DONE]`` (:func:`stream_events`).
A client that goes away has its request aborted in the scheduler.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi.responses import Response, StreamingResponse

from decode.serving.parsing import RequestRules, ServerLimits, generation_request, parse_request, read_body
from decode.serving.protocol import completion_body, usage_chunk
from decode.serving.scheduler import Live, Scheduler

DISCONNECT_CHECK_S = 0.2  # how often a non-streaming request looks for a client that went away


def sse(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj)}\n\n"


async def stream_events(live: Live, scheduler: Scheduler, rid: str, model: str, chat: bool,
                        usage_wanted: bool) -> AsyncIterator[str]:
    """The request's events as SSE chunks: a chat stream opens with the assistant role; text deltas; the finish
    reason (and a usage chunk when asked); an error event instead when the request failed; ``data: [DONE]``."""
    finished = False
    try:
        if chat:
            yield sse(completion_body(rid, model, "", None, None, chat, chunk=True, first=True))
        while True:
            event = await live.queue.get()
            if event[0] == "delta":
                yield sse(completion_body(rid, model, event[1], None, None, chat, chunk=True))
                continue
            finished = True
            if event[0] == "error":
                yield sse(event[1].body())
            else:
                yield sse(completion_body(rid, model, "", event[1], None, chat, chunk=True))
                if usage_wanted:
                    yield sse(usage_chunk(rid, model, event[2], chat))
            yield "data: [DONE]\n\n"
            return
    finally:
        if not finished:  # the client went away (the response task was cancelled)
            scheduler.abort(live.request_id)


async def _next_event(live: Live, until: float) -> tuple | None:
    """The request's next event, or None when none came before the loop time ``until``."""
    loop = asyncio.get_running_loop()
    try:
        return await asyncio.wait_for(live.queue.get(), max(until - loop.time(), 0.0))
    except asyncio.TimeoutError:
        return None


async def collect_response(request: Any, live: Live, scheduler: Scheduler, rid: str, model: str,
                           chat: bool) -> Any:
    """The whole completion as one body; an error event is raised (answered by the app's handler); a client that
    went away gets a bare 499 and its request is aborted."""
    parts, finished = [], False
    loop = asyncio.get_running_loop()
    check_at = loop.time() + DISCONNECT_CHECK_S
    try:
        while True:
            # Look for a gone client every DISCONNECT_CHECK_S, whether or not tokens keep arriving (a running
            # row sends one every step, so waiting for a quiet moment would never look).
            event = await _next_event(live, check_at)
            if loop.time() >= check_at:
                if await request.is_disconnected():
                    return Response(status_code=499)
                check_at = loop.time() + DISCONNECT_CHECK_S
            if event is None:
                continue
            if event[0] == "delta":
                parts.append(event[1])
                continue
            finished = True
            if event[0] == "error":
                raise event[1]
            return completion_body(rid, model, "".join(parts), event[1], event[2], chat)
    finally:
        if not finished:
            scheduler.abort(live.request_id)


@dataclass
class OpenAIServing:
    """What the routes delegate to: the decoder's scheduler, the tokenizer and the request rules.

    ``tokenize`` runs tokenization (and chat templates): ~1.4 s for a 1 MB prompt, which on the event loop froze
    every stream and ``/health`` meanwhile; one worker thread keeps the tokenizer's calls in order. ``draining``
    is set when the graceful shutdown starts (:func:`decode.serving.app.make_server`).
    """

    decoder: Any
    tokenizer: Any
    rules: RequestRules
    limits: ServerLimits
    scheduler: Scheduler
    draining: asyncio.Event
    info: dict = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))
    tokenize: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="draftkit-tokenize"))

    def health(self) -> dict:
        return {"status": "ok", "model": self.rules.model_name,
                "num_draft_tokens": getattr(self.decoder, "num_draft_tokens", None),
                "running": self.scheduler.num_running, "warning": self.scheduler.metrics.slowdown_warning,
                **self.info}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.rules.model_name, "object": "model", "created": self.created,
                                            "owned_by": "draftkit"}]}

    async def create_completion(self, request: Any, chat: bool) -> Any:
        """``POST /v1/completions`` (``chat=False``) or ``/v1/chat/completions``: a JSON body, or a stream."""
        req = parse_request(await read_body(request, self.limits, self.draining), chat)
        loop = asyncio.get_running_loop()
        gen = await loop.run_in_executor(self.tokenize, generation_request, req, chat, self.tokenizer, self.rules)
        live = self.scheduler.submit(gen, loop)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        model = self.rules.model_name
        if req.stream:
            usage_wanted = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(stream_events(live, self.scheduler, rid, model, chat, usage_wanted),
                                     media_type="text/event-stream")
        return await collect_response(request, live, self.scheduler, rid, model, chat)
