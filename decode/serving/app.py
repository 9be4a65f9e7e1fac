"""OpenAI-compatible HTTP server over the speculative decoder (FastAPI + uvicorn). No algorithm logic here.

Endpoints: ``GET /health`` (open), ``GET /metrics`` (Prometheus text), ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE streaming with ``"stream": true``, ending with
``data: [DONE]``). With an API key, ``/v1/*`` needs ``Authorization: Bearer KEY``. Each route is a function of
:data:`router` that delegates to the :class:`decode.serving.handlers.OpenAIServing` on ``app.state.serving``;
requests are parsed by :mod:`decode.serving.parsing` and run through :class:`decode.serving.scheduler.Scheduler`
(continuous batching). Every bad input is a 4xx in OpenAI's error shape; a 500 is a bug, and the server keeps
serving.
"""
# No `from __future__ import annotations`: FastAPI inspects handler annotations at runtime.

import asyncio
import hmac
import logging
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from decode.serving.handlers import OpenAIServing
from decode.serving.metrics import ServerMetrics
from decode.serving.parsing import ServerLimits, request_rules
from decode.serving.protocol import APIError
from decode.serving.scheduler import Scheduler

log = logging.getLogger("decode.serving")


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
                err = APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' with the key the "
                               "server was started with (--api-key or DRAFTKIT_API_KEY)", code="invalid_api_key")
                if self.on_reject is not None:
                    self.on_reject(401)
                await JSONResponse(err.body(), 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


class DrainingServer(uvicorn.Server):
    """A ``uvicorn.Server`` for an app of :func:`create_app` whose graceful shutdown answers every request.

    On Ctrl-C/SIGTERM (or ``should_exit``) uvicorn stops accepting, waits ``timeout_graceful_shutdown`` for open
    responses, then cancels them: a bare plain-text 500 with a traceback in the log, or a stream cut mid-body.
    This server starts draining the scheduler at the same moment with a deadline a little inside uvicorn's, so a
    request still running then ends with a 503 ``shutting_down`` in OpenAI's shape (on a stream: an error event and
    ``data: [DONE]``) before uvicorn would cancel it. A second Ctrl-C (uvicorn's ``force_exit``) ends the running
    requests the same way at once and exits.
    """

    async def shutdown(self, sockets=None):
        app, grace = self.config.app, self.config.timeout_graceful_shutdown
        margin = min(1.0, grace / 2)  # time for the 503s to reach their clients
        app.state.serving.draining.set()  # bodies still arriving end now with a 503, not at the grace period's end
        scheduler = app.state.scheduler
        drain = asyncio.ensure_future(asyncio.to_thread(scheduler.shutdown, True, grace - margin))
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


def make_server(app: Any, host: str, port: int, graceful_shutdown_s: float = 30.0,
                log_level: str = "info") -> DrainingServer:
    """The server that ``decode serve`` runs: a :class:`DrainingServer` for ``app`` on ``host:port``."""
    return DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                         timeout_graceful_shutdown=graceful_shutdown_s))


# ------------------------------------------------------------------------------------------------ routes
router = APIRouter()


@router.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load-balancer probes that send it
async def health(request: Request):
    return request.app.state.serving.health()


@router.get("/metrics")
async def prometheus(request: Request):
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request):
    return request.app.state.serving.models()


@router.post("/v1/completions")
async def completions(request: Request):
    return await request.app.state.serving.create_completion(request, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await request.app.state.serving.create_completion(request, chat=True)


# ------------------------------------------------------------------------------------------------ errors
async def api_error(request: Request, err: APIError):
    request.app.state.metrics.count_rejected(err.status)
    return JSONResponse(err.body(), err.status, headers=err.headers)


async def http_error(request: Request, err: StarletteHTTPException):
    """Starlette's own errors (unknown path, wrong method) in OpenAI's shape."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
    request.app.state.metrics.count_rejected(err.status_code)
    return JSONResponse(APIError(err.status_code, str(err.detail), code=code).body(), err.status_code)


async def internal_error(request: Request, err: Exception):
    log.exception("unhandled error")
    request.app.state.metrics.count_rejected(500)
    return JSONResponse(APIError(500, f"internal error: {err.__class__.__name__}: {err}").body(), 500)


@asynccontextmanager
async def lifespan(app: FastAPI):
    """The scheduler thread runs while the app does; at shutdown it drains the requests still running."""
    app.state.scheduler.start()
    yield
    # uvicorn has stopped accepting and waited for open responses; drain what is still running.
    await asyncio.to_thread(app.state.scheduler.shutdown, True, 60.0)
    app.state.serving.tokenize.shutdown(wait=False, cancel_futures=True)


def create_app(decoder: Any, tokenizer: Any, model_name: str = "draftkit", api_key: str | None = None,
               limits: ServerLimits | None = None, max_batch_size: int = 16, max_queue: int = 64,
               info: dict | None = None, cost_model: dict | None = None) -> FastAPI:
    """Build the FastAPI app serving ``decoder`` (a :class:`decode.engine.SpeculativeDecoder` with the request
    API) under the model id ``model_name``.

    The stop set of every request is :func:`decode.stops.stop_token_ids` (tokenizer eos ∪ the target's
    ``generation_config`` eos ids) ∪ the request's ``stop_token_ids``. The scheduler thread starts with the app
    (:func:`lifespan`) and, at shutdown, drains the requests still running. ``cost_model`` (the decoder's costs at
    batch size 1, :func:`decode.cli_args.fixed_gamma_cost_model`) turns on the slowdown check of a fixed γ
    (:class:`decode.serving.metrics.ServerMetrics`).
    """
    if api_key and not api_key.strip():  # stripped to b"", it would let "Authorization: Bearer " in
        raise ValueError("the API key is only whitespace; give a key, or None to serve without one")
    limits = limits or ServerLimits()
    gamma = getattr(decoder, "num_draft_tokens", None)
    metrics = ServerMetrics(gamma if isinstance(gamma, int) else None, cost_model)
    scheduler = Scheduler(decoder, tokenizer, metrics, max_batch_size, max_queue)
    app = FastAPI(title="draftkit speculative decoder", lifespan=lifespan)
    app.state.scheduler, app.state.metrics = scheduler, metrics
    app.state.serving = OpenAIServing(decoder, tokenizer, request_rules(decoder, tokenizer, model_name, limits),
                                      limits, scheduler, asyncio.Event(), info or {})
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key, on_reject=metrics.count_rejected)
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    app.include_router(router)
    return app
