"""OpenAI-compatible HTTP server over the speculative decoder (FastAPI + uvicorn). No algorithm logic here.

Endpoints: ``GET /health`` (open), ``GET /metrics`` (Prometheus text), ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE streaming with ``"stream": true``, ending with
``data: [DONE]``). With an API key, ``/v1/*`` needs ``Authorization: Bearer KEY``. Requests run through
:class:`decode.serving.scheduler.Scheduler` (continuous batching). Every bad input is a 4xx in OpenAI's error
shape; a 500 is a bug, and the server keeps serving.
"""
# No `from __future__ import annotations`: FastAPI inspects handler annotations at runtime.

import asyncio
import hmac
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from decode.loading import chat_prompt_ids
from decode.serving.metrics import ServerMetrics
from decode.serving.protocol import (APIError, ChatCompletionRequest, CompletionRequest, completion_body, parse_json,
                                     usage_chunk, validate)
from decode.serving.scheduler import GenerationRequest, Live, Scheduler, shutting_down_error
from decode.stops import stop_token_ids

log = logging.getLogger("decode.serving")
DISCONNECT_CHECK_S = 0.2  # how often a non-streaming request looks for a client that went away


@dataclass
class ServerLimits:
    """Per-request limits, each answered with a clear 4xx.

    max_body_bytes: request body size (413 beyond it). max_tokens: the largest ``max_tokens`` a request may ask
    for (None: the target's context). max_prompt_tokens: the longest prompt after tokenization (None: the
    target's context - 1). body_timeout_s: seconds from the headers to the body's last byte (408 after: a
    client that stalls mid-body holds no connection and no graceful shutdown forever).
    """

    max_body_bytes: int = 1 << 20
    max_tokens: int | None = None
    max_prompt_tokens: int | None = None
    body_timeout_s: float = 30.0


class BearerAuth:
    """ASGI middleware: ``/v1/*`` needs ``Authorization: Bearer <key>`` (compared in constant time)."""

    def __init__(self, app: Any, api_key: str, on_reject: Any = None):
        # Clients' tokens are stripped, so the key is too: a key read with its trailing newline (a secrets file, an
        # env file) would otherwise refuse every client. (create_app refuses a key that is only whitespace.)
        self.app, self.key, self.on_reject = app, api_key.strip().encode(), on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                from fastapi.responses import JSONResponse

                err = APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' with the key the "
                               "server was started with (--api-key or DRAFTKIT_API_KEY)", code="invalid_api_key")
                if self.on_reject is not None:
                    self.on_reject(401)
                await JSONResponse(err.body(), 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def make_server(app: Any, host: str, port: int, graceful_shutdown_s: float = 30.0, log_level: str = "info"):
    """A ``uvicorn.Server`` for an app of :func:`create_app` whose graceful shutdown answers every request.

    On Ctrl-C/SIGTERM (or ``should_exit``) uvicorn stops accepting, waits ``graceful_shutdown_s`` for open
    responses, then cancels them: a bare plain-text 500 with a traceback in the log, or a stream cut mid-body.
    This server starts draining the scheduler at the same moment with a deadline a little inside uvicorn's, so a
    request still running then ends with a 503 ``shutting_down`` in OpenAI's shape (on a stream: an error event and
    ``data: [DONE]``) before uvicorn would cancel it. A second Ctrl-C (uvicorn's ``force_exit``) ends the running
    requests the same way at once and exits.
    """
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None):
            margin = min(1.0, graceful_shutdown_s / 2)  # time for the 503s to reach their clients
            app.state.draining.set()  # bodies still arriving end now with a 503, not at the grace period's end
            scheduler = app.state.scheduler
            drain = asyncio.ensure_future(asyncio.to_thread(scheduler.shutdown, True, graceful_shutdown_s - margin))
            try:
                await super().shutdown(sockets)
            finally:
                while not drain.done() and not self.force_exit:
                    await asyncio.wait({drain}, timeout=0.1)
                if not drain.done():  # a second Ctrl-C: end what still runs now (503s), not after the drain period
                    await asyncio.to_thread(scheduler.shutdown, False, 10.0)
                await drain
                if self.force_exit:  # uvicorn then skips the app's lifespan shutdown, and the cancelled lifespan
                    await self.lifespan.shutdown()  # task logged a CancelledError traceback: run it (quick now)

    return DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                         timeout_graceful_shutdown=graceful_shutdown_s))


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def create_app(decoder: Any, tokenizer: Any, model_name: str = "draftkit", api_key: str | None = None,
               limits: ServerLimits | None = None, max_batch_size: int = 16, max_queue: int = 64,
               info: dict | None = None):
    """Build the FastAPI app serving ``decoder`` (a :class:`decode.engine.SpeculativeDecoder` with the request
    API) under the model id ``model_name``.

    The stop set of every request is :func:`decode.stops.stop_token_ids` (tokenizer eos ∪ the target's
    ``generation_config`` eos ids) ∪ the request's ``stop_token_ids``. The scheduler thread starts with the app
    (lifespan) and, at shutdown, drains the requests still running.
    """
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST
    from starlette.exceptions import HTTPException as StarletteHTTPException

    if api_key and not api_key.strip():  # stripped to b"", it would let "Authorization: Bearer " in
        raise ValueError("the API key is only whitespace; give a key, or None to serve without one")
    limits = limits or ServerLimits()
    context = getattr(decoder, "context_length", None)
    max_prompt = limits.max_prompt_tokens or (context - 1 if context else 1 << 20)
    max_tokens_limit = limits.max_tokens or (context or 1 << 16)
    if limits.max_tokens and context and limits.max_tokens >= context:
        log.warning("--max-tokens-limit %d is not below the target's context (%d tokens): the context is the limit "
                    "(a prompt of at least one token leaves at most %d)", limits.max_tokens, context, context - 1)
    vocab = getattr(decoder, "vocab_size", None) or len(tokenizer)
    base_stops = stop_token_ids(tokenizer, getattr(decoder, "target", None))
    metrics = ServerMetrics()
    scheduler = Scheduler(decoder, tokenizer, metrics, max_batch_size, max_queue)
    created = int(time.time())

    # Tokenizing (and rendering a chat template) takes ~1.4 s for a 1 MB prompt: done on the event loop it froze
    # every stream and /health meanwhile. One worker thread keeps the tokenizer's calls in order.
    tokenize = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draftkit-tokenize")

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        # uvicorn has stopped accepting and waited for open responses; drain what is still running.
        await asyncio.to_thread(scheduler.shutdown, True, 60.0)
        tokenize.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="draftkit speculative decoder", lifespan=lifespan)
    app.state.scheduler, app.state.metrics = scheduler, metrics
    app.state.draining = asyncio.Event()  # set when the graceful shutdown starts (make_server)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key,
                           on_reject=lambda status: metrics.rejected.labels(str(status)).inc())

    @app.exception_handler(APIError)
    async def api_error(request, err: APIError):
        metrics.rejected.labels(str(err.status)).inc()
        return JSONResponse(err.body(), err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, err):
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        metrics.rejected.labels(str(err.status_code)).inc()
        return JSONResponse(APIError(err.status_code, str(err.detail), code=code).body(), err.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request, err):
        log.exception("unhandled error")
        metrics.rejected.labels("500").inc()
        return JSONResponse(APIError(500, f"internal error: {err.__class__.__name__}: {err}").body(), 500)

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load-balancer probes that send it
    async def health():
        return {"status": "ok", "model": model_name, "num_draft_tokens": getattr(decoder, "num_draft_tokens", None),
                "running": scheduler.num_running, **(info or {})}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "draftkit"}]}

    async def read_body(request: Request) -> bytes:
        encoding = ",".join(request.headers.getlist("content-encoding")).strip().lower()  # every header line
        if set(e.strip() for e in encoding.split(",")) - {"", "identity"}:  # gzip read as text: "not valid JSON"
            raise APIError(415, f"Content-Encoding: {encoding} is not supported; send the request body uncompressed",
                           code="unsupported_content_encoding")
        size = request.headers.get("content-length")
        too_big = APIError(413, f"the request body is larger than {limits.max_body_bytes} bytes (--max-body-bytes)",
                           code="request_too_large")
        if size is not None and size.isdigit() and int(size) > limits.max_body_bytes:
            raise too_big

        async def receive() -> bytes:
            chunks, n = [], 0
            async for chunk in request.stream():
                n += len(chunk)
                if n > limits.max_body_bytes:
                    raise too_big
                chunks.append(chunk)
            return b"".join(chunks)

        body, draining = asyncio.ensure_future(receive()), asyncio.ensure_future(app.state.draining.wait())
        try:
            done, _ = await asyncio.wait({body, draining}, timeout=limits.body_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (body, draining):
                task.cancel()
        if body in done:
            return body.result()
        if draining in done:
            raise shutting_down_error()
        raise APIError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s of the headers "
                       "(--body-timeout-s); send the whole body at once", code="request_timeout")

    def prompt_ids_of(req: Any, chat: bool) -> list[int]:
        if chat:
            from jinja2 import TemplateError

            try:
                messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name is not None else {})}
                            for m in req.messages]  # a template that knows `name` renders it
                ids = chat_prompt_ids(tokenizer, messages)
            except ValueError as err:
                raise APIError(400, str(err), param="messages") from err
            except TemplateError as err:  # the template's own raise_exception (e.g. roles must alternate)
                raise APIError(400, f"the model's chat template refused these messages: {err}; change the roles or "
                               "order of messages (or send plain text to /v1/completions)", param="messages",
                               code="invalid_value") from err
        elif isinstance(req.prompt, str):
            ids = list(tokenizer(req.prompt)["input_ids"])
        else:
            ids = list(req.prompt)
        param = "messages" if chat else "prompt"
        if not ids:
            raise APIError(400, f"{param} encodes to no tokens; send a non-empty prompt", param=param)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}", param=param)
        if len(ids) > max_prompt or (context and len(ids) >= context):
            raise APIError(400, f"{param} has {len(ids)} tokens; this server accepts at most "
                           f"{min(max_prompt, context - 1) if context else max_prompt} (the target's context is "
                           f"{context}; --max-prompt-tokens {max_prompt}); shorten the prompt", param=param,
                           code="context_length_exceeded")
        return ids

    def max_new_tokens(req: Any, n_prompt: int, chat: bool) -> int:
        room = (context - n_prompt) if context else max_tokens_limit
        if req.max_tokens is None:
            return max(1, min(16 if not chat else max_tokens_limit, room))
        if req.max_tokens > max_tokens_limit:
            why = "--max-tokens-limit" if limits.max_tokens else "the target's context"
            raise APIError(400, f"max_tokens={req.max_tokens} is above this server's limit of {max_tokens_limit} "
                           f"({why}); ask for at most {max_tokens_limit}", param="max_tokens")
        if req.max_tokens > room:
            raise APIError(400, f"the prompt ({n_prompt} tokens) plus max_tokens={req.max_tokens} exceeds the "
                           f"target's context of {context} tokens; ask for at most {room}", param="max_tokens",
                           code="context_length_exceeded")
        return req.max_tokens

    def generation_request(req: Any, chat: bool) -> GenerationRequest:
        if req.model != model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {model_name!r} "
                           "(GET /v1/models)", param="model", code="model_not_found")
        ids = prompt_ids_of(req, chat)
        extra = req.stop_token_ids or []
        bad = [t for t in extra if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"stop_token_ids outside the vocabulary [0, {vocab}): {bad[:5]}",
                           param="stop_token_ids")
        sampling = dict(max_new_tokens=max_new_tokens(req, len(ids), chat), temperature=req.temperature,
                        top_k=req.top_k, top_p=req.top_p, min_p=req.min_p, presence_penalty=req.presence_penalty,
                        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                        seed=req.seed)
        return GenerationRequest(ids, sampling, sorted(set(base_stops) | set(extra)), req.stop_strings(),
                                 "chat" if chat else "completions")

    async def serve(request: Request, chat: bool):
        req = validate(ChatCompletionRequest if chat else CompletionRequest, parse_json(await read_body(request)))
        loop = asyncio.get_running_loop()
        live = scheduler.submit(await loop.run_in_executor(tokenize, generation_request, req, chat), loop)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if req.stream:
            usage_wanted = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(stream(live, rid, chat, usage_wanted), media_type="text/event-stream")
        return await collect(request, live, rid, chat)

    async def stream(live: Live, rid: str, chat: bool, usage_wanted: bool):
        finished = False
        try:
            if chat:
                yield _sse(completion_body(rid, model_name, "", None, None, chat, chunk=True, first=True))
            while True:
                event = await live.queue.get()
                if event[0] == "delta":
                    yield _sse(completion_body(rid, model_name, event[1], None, None, chat, chunk=True))
                    continue
                finished = True
                if event[0] == "error":
                    yield _sse(event[1].body())
                else:
                    yield _sse(completion_body(rid, model_name, "", event[1], None, chat, chunk=True))
                    if usage_wanted:
                        yield _sse(usage_chunk(rid, model_name, event[2], chat))
                yield "data: [DONE]\n\n"
                return
        finally:
            if not finished:  # the client went away (the response task was cancelled)
                scheduler.abort(live.request_id)

    async def collect(request: Request, live: Live, rid: str, chat: bool):
        parts, finished = [], False
        loop = asyncio.get_running_loop()
        check_at = loop.time() + DISCONNECT_CHECK_S
        try:
            while True:
                # Look for a gone client every DISCONNECT_CHECK_S, whether or not tokens keep arriving (a running
                # row sends one every step, so waiting for a quiet moment would never look).
                try:
                    event = await asyncio.wait_for(live.queue.get(), max(check_at - loop.time(), 0.0))
                except asyncio.TimeoutError:
                    event = None
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
                return completion_body(rid, model_name, "".join(parts), event[1], event[2], chat)
        finally:
            if not finished:
                scheduler.abort(live.request_id)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    return app
