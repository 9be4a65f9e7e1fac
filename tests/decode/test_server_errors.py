"""Every bad input gets a 4xx in OpenAI's error shape naming the problem, and the server keeps serving; API key,
body size, max_tokens and prompt limits. Real uvicorn on loopback, real HTTP (httpx) and the real openai client."""
import time

import httpx
import openai
import pytest

from decode.serving.app import create_app
from decode.serving.metrics import ServerMetrics
from decode.serving.parsing import ServerLimits
from decode.serving.protocol import APIError, ChatCompletionRequest, validate
from decode.serving.scheduler import GenerationRequest, Scheduler
from tests.decode.server_helpers import MODEL, EndlessEngine, metric, running_server, tiny_pair

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def server():
    dec, tok = tiny_pair()
    limits = ServerLimits(max_body_bytes=4096, max_tokens=64, max_prompt_tokens=40)
    with running_server(dec, tok, api_key=KEY, limits=limits, max_batch_size=2, max_queue=2) as (url, app, _):
        yield url, app


def post(url, payload=None, content=None, key=KEY, path="/v1/completions"):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if content is not None:
        headers["content-type"] = "application/json"
        return httpx.post(url + path, content=content, headers=headers, timeout=30)
    return httpx.post(url + path, json=payload, headers=headers, timeout=30)


def ok(**kw):
    return {"model": MODEL, "prompt": "w1 w2", "max_tokens": 2, **kw}


def chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 2, **kw}


def assert_error(r, status, needle, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["code"], str) and err["code"], err  # every error carries a machine-readable code
    assert needle in err["message"], err
    if param is not None:
        assert err["param"] == param, err


BAD = [
    (ok(temperature=-1), "temperature"),
    (ok(temperature="hot"), "temperature"),
    (ok(max_tokens="4"), "max_tokens"),          # strict types: no silent "4" -> 4
    (ok(max_tokens=True), "max_tokens"),
    (ok(max_tokens=0), "max_tokens"),
    (ok(top_p=3), "top_p"),
    (ok(top_k=0), "top_k"),
    (ok(min_p=1.5), "min_p"),
    (ok(presence_penalty=3), "presence_penalty"),
    (ok(frequency_penalty=-9), "frequency_penalty"),
    (ok(repetition_penalty=0), "repetition_penalty"),
    (ok(seed=2**64), "seed"),
    (ok(seed=2**70), "seed"),
    (ok(seed=-(2**63) - 1), "seed"),
    (ok(seed=-1), "seed"),
    (ok(seed=1.5), "seed"),
    (ok(stop=""), "stop"),
    (ok(stop=["a", "b", "c", "d", "e"]), "stop"),
    (ok(stop=[3]), "stop"),
    (ok(n=2), "n"),
    (ok(logprobs=2), "logprobs"),
    (ok(echo=True), "echo"),
    (ok(best_of=3), "best_of"),
    (ok(logit_bias={"5": 10}), "logit_bias"),
    (ok(temprature=0.5), "temprature"),         # a misspelled sampling field is not ignored
    (ok(stream_options={"include_usage": True}), "stream_options"),
    (ok(stop_token_ids=[5000]), "stop_token_ids"),
    (ok(prompt=[5, 100000]), "outside the vocabulary"),
    (ok(prompt=""), "no tokens"),
    (ok(prompt=123), "prompt"),
    ({"prompt": "w1"}, "model"),
    ([1, 2], "JSON object"),
    (chat(logprobs=True), "logprobs"),
    (chat(messages=[]), "messages"),
    (chat(messages=[{"role": "wizard", "content": "w1"}]), "messages.0.role"),
    (chat(max_tokens=3, max_completion_tokens=3), "max_completion_tokens"),
    (chat(tools=[{"type": "function"}]), "tools"),
    (chat(functions=[{"name": "f"}]), "functions"),
    (chat(tool_choice="auto"), "tool_choice"),
    (chat(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice"),
    (chat(function_call="auto"), "function_call"),
    (chat(response_format={"type": "json_object"}), "response_format"),
    (chat(parallel_tool_calls="yes"), "parallel_tool_calls"),
]


@pytest.mark.parametrize("payload,needle", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_field_is_a_400_naming_it(server, payload, needle):
    url, _ = server
    path = "/v1/chat/completions" if isinstance(payload, dict) and "messages" in payload else "/v1/completions"
    # A field name as the needle: the error's param names that field too.
    assert_error(post(url, payload, path=path), 400, needle, param=needle if needle.isidentifier() else None)


def test_null_sampling_fields_take_their_defaults(server):
    """OpenAI's API takes null for temperature, the penalties, n and stream (the openai client sends null for
    temperature=None): the request runs as if the field were left out."""
    url, _ = server
    nulls = dict(temperature=None, presence_penalty=None, frequency_penalty=None, repetition_penalty=None, n=None,
                 stream=None, echo=None)  # echo=None was a 400 "echo: Input should be a valid boolean" (a new user)
    got, ref = post(url, ok(seed=7, max_tokens=6, **nulls)), post(url, ok(seed=7, max_tokens=6))
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]
    assert post(url, chat(temperature=None), path="/v1/chat/completions").status_code == 200
    streamed = post(url, ok(max_tokens=2, stream=True, stream_options={"include_usage": None}))
    assert streamed.status_code == 200, streamed.text


def test_tool_and_format_fields_that_mean_none_are_accepted(server):
    """Clients send tools, tool_choice, response_format ... as null or as their "none" value (an OpenAI-style
    client with tools=None); the request then runs as if they were left out (they were a 400 "unknown field")."""
    url, _ = server
    nones = dict(tools=None, functions=None, tool_choice="none", function_call=None, parallel_tool_calls=False,
                 response_format={"type": "text"})
    path = "/v1/chat/completions"
    got = post(url, chat(seed=7, max_tokens=6, **nones), path=path)
    ref = post(url, chat(seed=7, max_tokens=6), path=path)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["message"] == ref.json()["choices"][0]["message"]
    assert post(url, chat(tools=[], tool_choice=None, response_format=None), path=path).status_code == 200


@pytest.mark.parametrize("content,needle", [(b"{not json", "not valid JSON"),
                                            (b'{"model": "tiny", "prompt": "w1", "temperature": NaN}', "NaN"),
                                            (b'{"model": "tiny", "prompt": "w1", "temperature": Infinity}',
                                             "Infinity"),
                                            (b'{"model": "tiny", "prompt": "w1", "top_p": -Infinity}', "Infinity")])
def test_malformed_json_and_nan_are_400(server, content, needle):
    url, _ = server
    assert_error(post(url, content=content), 400, needle)


def test_a_huge_integer_is_a_400_that_names_it_not_pythons_advice():
    """Python refuses integers of more than 4300 digits with advice for the server's code (call
    sys.set_int_max_str_digits()), which the 400 passed on."""
    dec, tok = tiny_pair()
    with running_server(dec, tok) as (url, _, _):
        r = post(url, content=b'{"model": "tiny", "prompt": "w1", "seed": ' + b"9" * 5001 + b"}", key=None)
    assert_error(r, 400, "less than or equal to 9223372036854775807", param="seed")
    assert "sys." not in r.text


def test_a_compressed_body_is_415_not_a_json_error(server):
    """A gzip body (Content-Encoding: gzip) was read as JSON text: 400 'not valid JSON', which sends a user looking
    at the JSON. Uncompressed bodies with an explicit identity encoding still work."""
    import gzip
    import json

    url, _ = server
    body = json.dumps(ok()).encode()
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    r = httpx.post(url + "/v1/completions", content=gzip.compress(body), timeout=30,
                   headers={**headers, "Content-Encoding": "gzip"})
    assert_error(r, 415, "Content-Encoding: gzip is not supported; send the request body uncompressed")
    r = httpx.post(url + "/v1/completions", content=gzip.compress(body), timeout=30,  # two header lines: all count
                   headers=httpx.Headers([*headers.items(), ("Content-Encoding", "identity"),
                                          ("Content-Encoding", "gzip")]))
    assert_error(r, 415, "is not supported; send the request body uncompressed")
    r = httpx.post(url + "/v1/completions", content=body, timeout=30, headers={**headers, "Content-Encoding": "identity"})
    assert r.status_code == 200, r.text


def test_unknown_model_is_404_and_limits(server):
    url, _ = server
    assert_error(post(url, ok(model="gpt-4")), 404, "gpt-4", param="model")
    assert_error(post(url, ok(max_tokens=65)), 400, "limit of 64", param="max_tokens")
    long_prompt = " ".join(f"w{i % 90}" for i in range(41))
    assert_error(post(url, ok(prompt=long_prompt)), 400, "41 tokens", param="prompt")
    assert_error(post(url, content=b'{"model": "tiny", "prompt": "' + b"w1 " * 2000 + b'"}'), 413, "4096 bytes")
    assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"  # still serving


@pytest.mark.parametrize("prompt", [["w1 w2", "w3"], [[5, 6], [7]]])
def test_a_batch_of_prompts_is_a_400_that_says_so(server, prompt):
    """OpenAI accepts a list of prompts; here it was refused as 'prompt.str: ...; prompt.list[int].0: ...'."""
    url, _ = server
    assert_error(post(url, ok(prompt=prompt)), 400, f"a list of {len(prompt)} prompts (a batch) is not supported",
                 param="prompt")


def test_prompt_longer_than_the_context_is_400():
    dec, tok = tiny_pair()
    with running_server(dec, tok, limits=ServerLimits(max_prompt_tokens=10_000)) as (url, _, _):
        ctx = dec.context_length
        prompt = [5] * ctx
        assert_error(post(url, ok(prompt=prompt), key=None), 400, "context")
        assert_error(post(url, ok(prompt=[5] * (ctx - 4), max_tokens=8), key=None), 400, "context",
                     param="max_tokens")


def test_api_key_required_on_v1_health_open(server):
    url, _ = server
    assert_error(post(url, ok(), key=None), 401, "API key")
    assert_error(post(url, ok(), key="wrong"), 401, "API key")
    assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    client = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]


def test_openai_client_sees_bad_request(server):
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="seed"):
        client.completions.create(model=MODEL, prompt="w1", max_tokens=2, seed=2**64)
    with pytest.raises(openai.BadRequestError, match="n: only n=1"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w1"}], n=2)


def test_requests_being_admitted_count_against_the_queue_limit():
    """Rows taken off the queue but not yet in the running batch (the engine's add_request is slow: a prefill)
    were counted as free, so a burst could exceed --max-batch-size + --max-queue."""
    import asyncio
    import threading


    release, entered = threading.Event(), threading.Event()

    class SlowEngine:  # the request API; add_request blocks like a long prefill
        def add_request(self, *a, **k):
            entered.set()
            release.wait(30)

        def step(self):
            return []

        def abort(self, rid):
            pass

        def has_unfinished(self):
            return False

    sched = Scheduler(SlowEngine(), None, ServerMetrics(), max_batch_size=2, max_queue=0)
    sched.start()
    loop = asyncio.new_event_loop()
    req = GenerationRequest(prompt_ids=[1, 2], sampling={"max_new_tokens": 2}, stop_ids=[])
    try:
        sched.submit(req, loop)
        sched.submit(req, loop)  # both fit the batch's 2 free rows
        assert entered.wait(10)  # the scheduler took both off the queue; the first admission is in progress
        with pytest.raises(APIError) as err:
            sched.submit(req, loop)
        assert err.value.status == 429
    finally:
        release.set()
        deadline = time.time() + 10
        while sched.num_running < 2 and time.time() < deadline:  # both admitted: shutdown aborts both rows (the
            time.sleep(0.01)                                      # fake engine never finishes one by itself)
        sched.shutdown(drain=False, timeout=10)
        assert not sched._thread.is_alive()
        loop.close()


def test_shutdown_without_drain_ends_waiting_admitting_and_running_requests_with_503():
    """shutdown(drain=False) while one request is being admitted (a slow prefill), one runs and one waits: the
    admitted one used to join the batch after the abort list was taken and kept the thread stepping forever, and
    the aborted ones never got an event (their handlers waited forever)."""
    import asyncio
    import threading


    release, entered = threading.Event(), threading.Event()
    aborted, calls = [], []

    class SlowEngine:  # never finishes a request by itself; the second add_request blocks like a long prefill
        def add_request(self, *a, request_id=None, **k):
            calls.append(request_id)
            if len(calls) == 2:
                entered.set()
                release.wait(30)

        def step(self):
            time.sleep(0.001)
            return []

        def abort(self, rid):
            aborted.append(rid)

    sched = Scheduler(SlowEngine(), None, ServerMetrics(), max_batch_size=2, max_queue=1)
    sched.start()
    loop = asyncio.new_event_loop()
    req = GenerationRequest(prompt_ids=[1, 2], sampling={"max_new_tokens": 2}, stop_ids=[])
    first = sched.submit(req, loop)
    deadline = time.time() + 10
    while sched.num_running < 1 and time.time() < deadline:
        time.sleep(0.01)
    second = sched.submit(req, loop)
    assert entered.wait(10)  # the second is being admitted
    third = sched.submit(req, loop)  # waits: the batch is full
    stopper = threading.Thread(target=sched.shutdown, kwargs={"drain": False, "timeout": 10})
    stopper.start()
    time.sleep(0.2)
    release.set()
    stopper.join(15)
    assert not sched._thread.is_alive()
    loop.run_until_complete(asyncio.sleep(0.05))  # deliver the events sent with call_soon_threadsafe
    for live in (first, second, third):
        event = live.queue.get_nowait()
        assert event[0] == "error" and event[1].status == 503 and event[1].code == "shutting_down", event
        assert live.queue.empty()
    assert sorted(aborted) == sorted([first.request_id, second.request_id])  # the third never reached the engine
    loop.close()


def test_a_drain_past_its_timeout_ends_the_running_requests_with_503():
    import asyncio


    sched = Scheduler(EndlessEngine(), None, ServerMetrics(), max_batch_size=2, max_queue=1)
    sched.start()
    loop = asyncio.new_event_loop()
    live = sched.submit(GenerationRequest(prompt_ids=[1], sampling={}, stop_ids=[]), loop)
    deadline = time.time() + 10
    while sched.num_running < 1 and time.time() < deadline:
        time.sleep(0.01)
    sched.shutdown(drain=True, timeout=0.3)
    assert not sched._thread.is_alive()
    loop.run_until_complete(asyncio.sleep(0.05))
    event = live.queue.get_nowait()
    assert event[0] == "error" and event[1].status == 503
    loop.close()


@pytest.mark.parametrize("content,param", [
    (b'{"model": "tiny", "prompt": "w1 \\ud800", "max_tokens": 2}', "prompt"),
    (b'{"model": "tiny", "prompt": "w1", "stop": ["w2", "\\udc00"], "max_tokens": 2}', "stop"),
    (b'{"model": "tiny", "prompt": "w1", "\\ud800": 1}', None),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "w1\\ud800"}]}', "messages")])
def test_lone_surrogate_escape_is_a_400_naming_the_field(server, content, param):
    """JSON allows "\\ud800" but it is not Unicode text: the tokenizer raised a TypeError (a 500)."""
    url, _ = server
    path = "/v1/chat/completions" if b"messages" in content else "/v1/completions"
    r = post(url, content=content, path=path)
    assert_error(r, 400, "surrogate", param=param)
    assert "\\ud800" in r.json()["error"]["message"] or param is not None
    assert post(url, ok()).status_code == 200  # still serving


def test_deeply_nested_json_is_a_400():
    """json.loads raised RecursionError on [[[[...]]]] (a 500)."""
    dec, tok = tiny_pair()
    with running_server(dec, tok) as (url, _, _):  # the default 1 MiB body limit
        deep = 200_000
        assert_error(post(url, content=b"[" * deep + b"]" * deep, key=None), 400, "too deeply")
        assert_error(post(url, content=b'{"prompt": ' + b"[" * deep + b"]" * deep + b"}", key=None), 400,
                     "too deeply")
        assert post(url, ok(), key=None).status_code == 200


def test_chat_template_that_refuses_the_messages_is_a_400():
    """A template's raise_exception (many models refuse a system turn or non-alternating roles) raised jinja2's
    TemplateError out of the handler (a 500)."""
    dec, tok = tiny_pair()
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }} "
                         "{% endfor %}{% if add_generation_prompt %}w9{% endif %}")
    with running_server(dec, tok) as (url, _, _):
        bad = chat(messages=[{"role": "system", "content": "w1"}, {"role": "user", "content": "w2"}])
        assert_error(post(url, bad, key=None, path="/v1/chat/completions"), 400, "System role not supported",
                     param="messages")
        assert post(url, chat(), key=None, path="/v1/chat/completions").status_code == 200


def test_max_tokens_above_the_context_default_limit_names_the_context():
    """Without --max-tokens-limit the limit is the target's context; the message told the client about a flag."""
    dec, tok = tiny_pair()
    with running_server(dec, tok) as (url, _, _):
        r = post(url, ok(max_tokens=dec.context_length + 1), key=None)
        assert_error(r, 400, f"limit of {dec.context_length} (the target's context)", param="max_tokens")
        assert "--max-tokens-limit" not in r.json()["error"]["message"]


def test_api_key_with_surrounding_whitespace_still_matches():
    """A key read with its trailing newline (a secrets file) refused every client: tokens are stripped, the key
    was not. An empty key is refused rather than letting 'Bearer ' in."""
    dec, tok = tiny_pair()
    with running_server(dec, tok, api_key=KEY + "\n") as (url, _, _):
        assert post(url, ok()).status_code == 200
        assert_error(post(url, ok(), key=None), 401, "API key")
    with pytest.raises(ValueError, match="only whitespace"):
        create_app(dec, tok, api_key="  \n")


def test_requests_still_running_past_the_graceful_shutdown_end_with_503_not_a_bare_500():
    """Ctrl-C with requests running longer than the graceful period: uvicorn cancelled them, so a non-streaming
    client got a plain-text 'Internal Server Error' (and a traceback in the log) and a stream was cut without an
    event or [DONE]. Now both end with a 503 shutting_down in OpenAI's shape before uvicorn cancels them."""
    import json
    import threading

    dec, tok = tiny_pair()
    real_step = dec.step

    def slow_step():  # 240 tokens at γ=3 take > 3 s: longer than the 1 s grace
        time.sleep(0.05)
        return real_step()

    dec.step = slow_step
    long = {"model": MODEL, "prompt": "w5", "max_tokens": 240, "temperature": 0}
    results = {}
    with running_server(dec, tok, graceful_shutdown_s=1.0) as (url, app, server):
        def plain():
            results["plain"] = httpx.post(url + "/v1/completions", json=long, timeout=60)

        def streamed():
            with httpx.stream("POST", url + "/v1/completions", json={**long, "stream": True}, timeout=60) as r:
                results["stream"] = [line for line in r.iter_lines() if line.startswith("data: ")]

        threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
        for t in threads:
            t.start()
        deadline = time.time() + 20
        while app.state.scheduler.num_running < 2 and time.time() < deadline:
            time.sleep(0.01)
        server.should_exit = True
        for t in threads:
            t.join(timeout=60)
    assert_error(results["plain"], 503, "shut down")
    assert results["plain"].json()["error"]["code"] == "shutting_down"
    lines = results["stream"]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == "shutting_down"
    assert not dec.has_unfinished()


def test_chat_message_name_reaches_the_template():
    """messages[].name was accepted and then dropped before the chat template (accepted and ignored)."""
    dec, tok = tiny_pair()
    tok.chat_template = ("{% for m in messages %}{% if m.get('name') %}{{ m['name'] }} {% endif %}{{ m['content'] }} "
                         "{% endfor %}{% if add_generation_prompt %}w9{% endif %}")
    with running_server(dec, tok) as (url, _, _):
        named = post(url, chat(messages=[{"role": "user", "content": "w2", "name": "w7"}]), key=None,
                     path="/v1/chat/completions")
        assert named.status_code == 200 and named.json()["usage"]["prompt_tokens"] == 3  # w7 w2 w9


def test_chat_content_parts_are_joined_by_newlines_and_an_empty_list_is_refused(server):
    """Text parts were joined with "" ("a" + "b" -> "ab"; vLLM joins them with newlines), and "content": [] was
    accepted as an empty message."""
    parts = [{"type": "text", "text": "def f():"}, {"type": "text", "text": "    return 1"}]
    req = validate(ChatCompletionRequest, {"model": MODEL, "messages": [{"role": "user", "content": parts}]})
    assert req.messages[0].text() == "def f():\n    return 1"
    url, _ = server
    empty = post(url, chat(messages=[{"role": "user", "content": []}]), path="/v1/chat/completions")
    assert_error(empty, 400, "at least 1 item")
    # an image part read "unknown field 'messages.0.content.list[TextPart].0.image_url'"
    image = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    r = post(url, chat(messages=[{"role": "user", "content": image}]), path="/v1/chat/completions")
    assert_error(r, 400, "only text parts are supported (this server serves a text model), got a part of type 'image_url'")


def test_health_answers_head_and_a_max_tokens_limit_past_the_context_is_named(caplog):
    """HEAD /health (some load-balancer probes) was a 405; --max-tokens-limit above the context was silent."""
    import logging

    dec, tok = tiny_pair()
    with caplog.at_level(logging.WARNING, logger="decode.serving"):
        with running_server(dec, tok, limits=ServerLimits(max_tokens=5000)) as (url, _, _):
            assert httpx.head(url + "/health", timeout=10).status_code == 200
    assert f"--max-tokens-limit 5000 is not below the target's context ({dec.context_length} tokens)" in caplog.text


def test_every_http_error_is_counted_in_rejected_requests(server):
    """401 (answered by the auth middleware) and 404 (by Starlette) were not counted: only errors raised inside a
    handler were."""
    url, _ = server

    def rejected(status):
        return metric(url, "draftkit_rejected_requests_total", {"status": status}) or 0.0

    before = {s: rejected(s) for s in ("401", "404")}
    assert post(url, ok(), key="wrong").status_code == 401
    assert httpx.get(url + "/v1/nothing-here", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).status_code == 404
    assert rejected("401") == before["401"] + 1 and rejected("404") == before["404"] + 1


def test_a_second_ctrl_c_ends_running_requests_at_once_with_503(caplog):
    """uvicorn's force exit (a second Ctrl-C) still waited out the whole drain period (a 1000-token stream ran to
    its end, or 30 s), then logged a CancelledError traceback from the app's skipped lifespan shutdown."""
    import json
    import threading

    dec, tok = tiny_pair()
    real_step = dec.step
    dec.step = lambda: time.sleep(0.05) or real_step()  # 240 tokens at γ=3 take > 3 s
    results = {}
    with running_server(dec, tok, graceful_shutdown_s=60.0) as (url, app, server):
        def streamed():
            body = {"model": MODEL, "prompt": "w5", "max_tokens": 240, "temperature": 0, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                results["stream"] = [line for line in r.iter_lines() if line.startswith("data: ")]

        t = threading.Thread(target=streamed)
        t.start()
        deadline = time.time() + 20
        while app.state.scheduler.num_running < 1 and time.time() < deadline:
            time.sleep(0.01)
        server.should_exit = True  # the first Ctrl-C: drain
        time.sleep(0.3)
        server.force_exit = True  # the second
        t.join(timeout=60)
    lines = results["stream"]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == "shutting_down"
    assert not dec.has_unfinished()
    assert "CancelledError" not in caplog.text


def _half_sent_body(url: str):
    """A raw socket that sent a completions request's headers (Content-Length: 100) and 8 bytes of its body, then
    stalls."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"model\"")
    return sock


def _response(sock) -> tuple[int, dict]:
    import json

    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_a_body_that_stops_arriving_gets_a_408_and_the_server_keeps_serving():
    """A client that sent its headers and part of its body held its connection (and the handler) forever."""
    dec, tok = tiny_pair()
    with running_server(dec, tok, limits=ServerLimits(body_timeout_s=0.5)) as (url, _, _):
        sock = _half_sent_body(url)
        status, body = _response(sock)
        sock.close()
        assert status == 408 and body["error"]["code"] == "request_timeout", body
        assert "--body-timeout-s" in body["error"]["message"]
        assert post(url, ok(), key=None).status_code == 200


def test_a_shutdown_ends_bodies_still_arriving_with_503_at_once_not_after_the_grace_period():
    """With a half-sent body open, Ctrl-C waited out the whole --graceful-shutdown-s, then cancelled the handler
    (a CancelledError traceback in the log per connection) and the client got no answer."""
    dec, tok = tiny_pair()
    with running_server(dec, tok, graceful_shutdown_s=60.0) as (url, app, server):
        sock = _half_sent_body(url)
        time.sleep(0.3)  # the handler is reading the body
        started = time.perf_counter()
        server.should_exit = True
        status, body = _response(sock)
        sock.close()
    stopped = time.perf_counter() - started  # running_server has joined the server's thread
    assert status == 503 and body["error"]["code"] == "shutting_down", body
    assert stopped < 30, f"the server took {stopped:.1f} s to stop: it waited for the body (grace period 60 s)"
