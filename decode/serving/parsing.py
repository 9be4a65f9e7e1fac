"""Request parsing: an OpenAI request body -> what the scheduler runs (:class:`GenerationRequest`: prompt ids,
sampling settings, stop ids and strings), every bad input a 4xx :class:`APIError` naming its field.

The steps, in order: :func:`read_body` (encoding, size and arrival time), :func:`parse_request` (JSON and the
pydantic models of :mod:`decode.serving.protocol`), then :func:`generation_request` (model id, prompt tokens,
``max_tokens``, stop ids) against the server's :class:`RequestRules`. Apart from :func:`read_body` these take no
HTTP objects, so tests call them directly.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from decode.loading import chat_prompt_ids
from decode.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_json, validate
from decode.serving.scheduler import GenerationRequest, shutting_down_error
from decode.stops import stop_token_ids

log = logging.getLogger("decode.serving")
NO_CONTEXT_PROMPT_TOKENS = 1 << 20  # the prompt limit when neither the target nor --max-prompt-tokens gives one
NO_CONTEXT_MAX_TOKENS = 1 << 16  # the max_tokens limit likewise
DEFAULT_COMPLETION_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI's default


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


@dataclass(frozen=True)
class RequestRules:
    """What a request is checked against: the served model's id, vocabulary and context, the limits in tokens and
    the stop ids every request gets.

    context: the target's context length (None: it states none). max_tokens_flag: whether ``max_tokens`` is
    ``--max-tokens-limit`` (else the target's context), for the error message. stop_ids:
    :func:`decode.stops.stop_token_ids` (tokenizer eos ∪ the target's ``generation_config`` eos ids).
    """

    model_name: str
    vocab_size: int
    context: int | None
    max_prompt_tokens: int
    max_tokens: int
    max_tokens_flag: bool
    stop_ids: tuple[int, ...]


def request_rules(decoder: Any, tokenizer: Any, model_name: str, limits: ServerLimits) -> RequestRules:
    """The rules for ``decoder`` (a :class:`decode.engine.SpeculativeDecoder`) served as ``model_name``."""
    context = getattr(decoder, "context_length", None)
    if limits.max_tokens and context and limits.max_tokens >= context:
        log.warning("--max-tokens-limit %d is not below the target's context (%d tokens): the context is the limit "
                    "(a prompt of at least one token leaves at most %d)", limits.max_tokens, context, context - 1)
    return RequestRules(
        model_name=model_name,
        vocab_size=getattr(decoder, "vocab_size", None) or len(tokenizer),
        context=context,
        max_prompt_tokens=limits.max_prompt_tokens or (context - 1 if context else NO_CONTEXT_PROMPT_TOKENS),
        max_tokens=limits.max_tokens or (context or NO_CONTEXT_MAX_TOKENS),
        max_tokens_flag=bool(limits.max_tokens),
        stop_ids=tuple(stop_token_ids(tokenizer, getattr(decoder, "target", None))))


# ------------------------------------------------------------------------------------------------ the body
def check_content_encoding(encoding: str) -> None:
    """A compressed body is refused with a 415 (read as text it would be "not valid JSON"). ``encoding`` is every
    ``Content-Encoding`` header line joined by commas."""
    encoding = encoding.strip().lower()
    if set(e.strip() for e in encoding.split(",")) - {"", "identity"}:
        raise APIError(415, f"Content-Encoding: {encoding} is not supported; send the request body uncompressed",
                       code="unsupported_content_encoding")


def body_too_large(limits: ServerLimits) -> APIError:
    return APIError(413, f"the request body is larger than {limits.max_body_bytes} bytes (--max-body-bytes)",
                    code="request_too_large")


async def _receive(request: Any, max_bytes: int, too_big: APIError) -> bytes:
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > max_bytes:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def read_body(request: Any, limits: ServerLimits, draining: asyncio.Event) -> bytes:
    """The body of ``request`` (a Starlette ``Request``) within ``limits``: 415 for a compressed body, 413 beyond
    ``max_body_bytes``, 408 when it has not all arrived within ``body_timeout_s``, 503 when the server starts
    shutting down (``draining``) while it arrives."""
    check_content_encoding(",".join(request.headers.getlist("content-encoding")))
    size = request.headers.get("content-length")
    too_big = body_too_large(limits)
    if size is not None and size.isdigit() and int(size) > limits.max_body_bytes:
        raise too_big
    body = asyncio.ensure_future(_receive(request, limits.max_body_bytes, too_big))
    shutdown = asyncio.ensure_future(draining.wait())
    try:
        done, _ = await asyncio.wait({body, shutdown}, timeout=limits.body_timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (body, shutdown):
            task.cancel()
    if body in done:
        return body.result()
    if shutdown in done:
        raise shutting_down_error()
    raise APIError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s of the headers "
                   "(--body-timeout-s); send the whole body at once", code="request_timeout")


def parse_request(body: bytes, chat: bool) -> CompletionRequest | ChatCompletionRequest:
    """The body as the endpoint's request model; malformed JSON or a bad field is a 400."""
    return validate(ChatCompletionRequest if chat else CompletionRequest, parse_json(body))


# ------------------------------------------------------------------------------------------------ the request
def check_model(req: Any, rules: RequestRules) -> None:
    if req.model != rules.model_name:
        raise APIError(404, f"the model {req.model!r} does not exist; this server serves {rules.model_name!r} "
                       "(GET /v1/models)", param="model", code="model_not_found")


def chat_ids(req: ChatCompletionRequest, tokenizer: Any) -> list[int]:
    """The messages rendered by the tokenizer's chat template (with the generation prompt), as token ids."""
    try:
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name is not None else {})}
                    for m in req.messages]  # a template that knows `name` renders it
        return chat_prompt_ids(tokenizer, messages)
    except ValueError as err:
        raise APIError(400, str(err), param="messages") from err
    except TemplateError as err:  # the template's own raise_exception (e.g. roles must alternate)
        raise APIError(400, f"the model's chat template refused these messages: {err}; change the roles or "
                       "order of messages (or send plain text to /v1/completions)", param="messages",
                       code="invalid_value") from err


def check_prompt_ids(ids: list[int], param: str, rules: RequestRules) -> None:
    """No tokens, ids outside the vocabulary, or more tokens than the limit or the context allow: a 400."""
    if not ids:
        raise APIError(400, f"{param} encodes to no tokens; send a non-empty prompt", param=param)
    bad = [t for t in ids if not 0 <= t < rules.vocab_size]
    if bad:
        raise APIError(400, f"prompt has token ids outside the vocabulary [0, {rules.vocab_size}): {bad[:5]}",
                       param=param)
    limit, context = rules.max_prompt_tokens, rules.context
    if len(ids) > limit or (context and len(ids) >= context):
        raise APIError(400, f"{param} has {len(ids)} tokens; this server accepts at most "
                       f"{min(limit, context - 1) if context else limit} (the target's context is {context}; "
                       f"--max-prompt-tokens {limit}); shorten the prompt", param=param,
                       code="context_length_exceeded")


def prompt_ids(req: Any, chat: bool, tokenizer: Any, rules: RequestRules) -> list[int]:
    """The prompt's token ids: rendered chat messages, tokenized text, or the ids as sent; checked."""
    if chat:
        ids = chat_ids(req, tokenizer)
    elif isinstance(req.prompt, str):
        ids = list(tokenizer(req.prompt)["input_ids"])
    else:
        ids = list(req.prompt)
    check_prompt_ids(ids, "messages" if chat else "prompt", rules)
    return ids


def max_new_tokens(req: Any, n_prompt: int, chat: bool, rules: RequestRules) -> int:
    """``max_tokens``, checked against the server's limit and the room the prompt leaves in the context; when
    left out, OpenAI's defaults: 16 for a completion, as many as fit for a chat."""
    limit, context = rules.max_tokens, rules.context
    room = (context - n_prompt) if context else limit
    if req.max_tokens is None:
        return max(1, min(DEFAULT_COMPLETION_TOKENS if not chat else limit, room))
    if req.max_tokens > limit:
        why = "--max-tokens-limit" if rules.max_tokens_flag else "the target's context"
        raise APIError(400, f"max_tokens={req.max_tokens} is above this server's limit of {limit} ({why}); ask "
                       f"for at most {limit}", param="max_tokens")
    if req.max_tokens > room:
        raise APIError(400, f"the prompt ({n_prompt} tokens) plus max_tokens={req.max_tokens} exceeds the "
                       f"target's context of {context} tokens; ask for at most {room}", param="max_tokens",
                       code="context_length_exceeded")
    return req.max_tokens


def stop_ids(req: Any, rules: RequestRules) -> list[int]:
    """The server's stop ids ∪ the request's ``stop_token_ids`` (which must lie in the vocabulary)."""
    extra = req.stop_token_ids or []
    bad = [t for t in extra if not 0 <= t < rules.vocab_size]
    if bad:
        raise APIError(400, f"stop_token_ids outside the vocabulary [0, {rules.vocab_size}): {bad[:5]}",
                       param="stop_token_ids")
    return sorted(set(rules.stop_ids) | set(extra))


def sampling_settings(req: Any, max_tokens: int) -> dict:
    """The engine's per-request sampling keyword arguments (``add_request``)."""
    return dict(max_new_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                min_p=req.min_p, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty, seed=req.seed)


def generation_request(req: Any, chat: bool, tokenizer: Any, rules: RequestRules) -> GenerationRequest:
    """A validated request of either endpoint -> what the scheduler runs. Tokenizes (slow for a long prompt: the
    server calls this off the event loop)."""
    check_model(req, rules)
    ids = prompt_ids(req, chat, tokenizer, rules)
    stops = stop_ids(req, rules)
    sampling = sampling_settings(req, max_new_tokens(req, len(ids), chat, rules))
    return GenerationRequest(ids, sampling, stops, req.stop_strings(), "chat" if chat else "completions")
