"""The OpenAI wire format: request models with strict validation, error bodies, response and stream chunks.

Follows the OpenAI API reference for ``/v1/completions`` and ``/v1/chat/completions`` (and vLLM's extra
sampling fields ``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``). Every field that would change
the output is either honoured or rejected with a 400 naming it: nothing is accepted and ignored. Unknown fields
are rejected too (a misspelled ``temprature`` must not silently sample at the default).
"""
from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

MAX_SEED = 2**63 - 1


class APIError(Exception):
    """An error answered in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or _default_code(status, param)
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _default_code(status: int, param: str | None) -> str:
    """A machine-readable ``code`` for an error raised without one, so that every error body carries a string code
    (clients branch on ``err.code``): a bad field is ``invalid_value``, a bad request as a whole
    ``invalid_request``, any 5xx ``internal_error`` (503s name their own ``shutting_down``)."""
    if status >= 500:
        return "internal_error"
    return "invalid_value" if param else {404: "not_found", 405: "method_not_allowed"}.get(status, "invalid_request")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a valid JSON number; send a finite number")


def _parse_int(text: str) -> int:
    # Python refuses to convert integers of more than 4300 digits, with advice for the server's code
    # (sys.set_int_max_str_digits). No field takes one of 400: a stand-in of the same sign, out of every field's
    # range, lets the field's own check name it ("seed: ... less than or equal to ...").
    if len(text) > 400:
        return -(10 ** 400) if text.startswith("-") else 10 ** 400
    return int(text)


def parse_json(body: bytes) -> Any:
    """Parse a request body; malformed JSON and NaN/Infinity literals raise a 400 :class:`APIError`."""
    try:
        return json.loads(body, parse_constant=_reject_constant, parse_int=_parse_int)
    except ValueError as err:  # JSONDecodeError and the NaN/Infinity rejection
        raise APIError(400, f"the request body is not valid JSON: {err}", code="invalid_json") from err
    except RecursionError as err:  # [[[[...]]]] deeper than the interpreter's recursion limit
        raise APIError(400, "the request body nests arrays/objects too deeply; send the fields of the API reference",
                       code="invalid_json") from err


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _lone_surrogate(payload: Any) -> str | None:
    """The dotted path of a string (or key) in ``payload`` that is not valid Unicode text (a lone UTF-16 surrogate
    escape such as ``"\\ud800"``, which JSON allows but no tokenizer can encode), else None. Iterative: a deep
    payload cannot overflow the stack."""
    todo: list[tuple[Any, str]] = [(payload, "")]
    while todo:
        value, path = todo.pop()
        if isinstance(value, str):
            if not _is_text(value):
                return path or "body"
            continue
        items: Any = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            name = str(key).encode("utf-8", "backslashreplace").decode("utf-8")  # printable in the error message
            sub = f"{path}.{name}" if path else name
            if isinstance(key, str) and not _is_text(key):
                return sub
            todo.append((item, sub))
    return None


class _Strict(BaseModel):
    # strict: no "1" -> 1 or true -> 1 coercion; forbid: unknown fields are errors; no NaN/inf anywhere.
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        # OpenAI's API takes null for every optional field (the openai client sends it for temperature=None,
        # echo=None, ...): the field's default applies, whatever its type
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if not (v is None and k in fields and not fields[k].is_required() and fields[k].default is not None)}


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
    """Fields shared by both endpoints. Defaults follow OpenAI (temperature 1)."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    user: str | None = None  # accepted: it does not change the output
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _unsupported(self):
        if self.n != 1:
            raise ValueError("n: only n=1 is supported; send n requests instead")
        if self.logit_bias:
            raise ValueError("logit_bias: not supported (it would change the output); leave it out")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop: give up to 4 non-empty strings")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream=true")
        return self

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingFields):
    prompt: str | list[int]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _one_prompt(cls, data: Any) -> Any:
        prompt = data.get("prompt") if isinstance(data, dict) else None
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise ValueError(f"prompt: a list of {len(prompt)} prompts (a batch) is not supported; send one string "
                             "or one list of token ids per request (requests are batched by the server)")
        return data

    @model_validator(mode="after")
    def _completion_unsupported(self):
        if self.logprobs is not None:
            raise ValueError("logprobs: not supported; leave it out")
        if self.echo:
            raise ValueError("echo: not supported; leave it out or set it to false")
        if self.best_of not in (None, 1):
            raise ValueError("best_of: only 1 is supported")
        if self.suffix:
            raise ValueError("suffix: not supported; leave it out")
        return self


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | Annotated[list[TextPart], Field(min_length=1)]
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        parts = data.get("content") if isinstance(data, dict) else None
        for part in parts if isinstance(parts, list) else []:  # an image part read "unknown field ...image_url"
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError("content: only text parts are supported (this server serves a text model), got "
                                 f"a part of type {kind!r}")
        return data

    def text(self) -> str:
        """The content as one string: text parts joined by newlines, as vLLM joins them for text-only models."""
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # Tool calling and structured output are not served: these are accepted only with the value that means
    # "none" (null, or what clients send as the default), and refused otherwise, naming the field.
    tools: list[dict] | None = None
    functions: list[dict] | None = None
    tool_choice: str | dict | None = None
    function_call: str | dict | None = None
    parallel_tool_calls: bool | None = None  # only says how tools may be called: nothing to honour without tools
    response_format: dict | None = None

    @model_validator(mode="after")
    def _chat_unsupported(self):
        if self.logprobs or self.top_logprobs is not None:
            raise ValueError("logprobs: logprobs and top_logprobs are not supported; leave them out")
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise ValueError(f"{name}: tool calling is not supported (this server returns text); leave it out")
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise ValueError(f"{name}: tool calling is not supported; leave it out or send \"none\"")
        if self.response_format not in (None, {"type": "text"}):
            raise ValueError("response_format: only {\"type\": \"text\"} is supported (no JSON or schema-constrained "
                             "output); leave it out")
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None:
                raise ValueError("max_completion_tokens: give max_tokens or max_completion_tokens, not both")
            self.max_tokens = self.max_completion_tokens
        return self


def validate(model: type[BaseModel], payload: Any) -> Any:
    """``model.model_validate(payload)``; a validation error becomes a 400 naming the first bad field."""
    if not isinstance(payload, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_request")
    bad = _lone_surrogate(payload)
    if bad is not None:
        raise APIError(400, f"{bad}: contains a lone UTF-16 surrogate escape (such as \\ud800), which is not valid "
                       "Unicode text; send well-formed UTF-8 (escape pairs only as surrogate pairs)",
                       param=bad.split(".")[0], code="invalid_value")
    try:
        return model.model_validate(payload)
    except ValidationError as err:
        errors = err.errors(include_url=False)
        parts, params = [], []
        for e in errors[:5]:
            loc = ".".join(str(x) for x in e["loc"])
            msg = e["msg"].removeprefix("Value error, ")
            if e["type"] == "extra_forbidden":
                msg = (f"unknown field {loc!r}; remove it (every field this server accepts is honoured, so an "
                       "unknown one is refused rather than ignored)")
            elif loc:
                msg = f"{loc}: {msg}"
            parts.append(msg)
            # Model-level checks have no location; their message starts with the field name.
            params.append(str(e["loc"][0]) if e["loc"] else msg.split(":")[0])
        param = params[0]
        raise APIError(400, "; ".join(parts), param=param, code="invalid_value") from err


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, text: str, finish: str | None, use: dict | None, chat: bool,
                    chunk: bool = False, first: bool = False) -> dict:
    """A response (``chunk=False``) or a stream chunk in the endpoint's shape."""
    if chat:
        if chunk:
            delta: dict = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
    if use is not None:
        body["usage"] = use
    return body


def usage_chunk(rid: str, model: str, use: dict, chat: bool) -> dict:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, only usage."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [], "usage": use}
