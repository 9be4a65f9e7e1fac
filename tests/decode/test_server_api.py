"""The OpenAI-compatible server end to end: a real uvicorn on loopback, the real ``openai`` client, a tiny real
pair. Greedy through the server equals offline greedy; a seeded request is the same alone and in a busy batch;
stop strings never leak; a disconnect frees its row; a full queue answers 429; shutdown drains."""
import concurrent.futures as cf
import json
import math
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from decode import SpeculativeDecoder
from decode.metrics import DecodeStats
from decode.serving.metrics import ServerMetrics
from decode.stops import stop_token_ids
from tests.decode.server_helpers import MODEL, metric, running_server, tiny_pair


@pytest.fixture(scope="module")
def server():
    dec, tok = tiny_pair(gamma=3)
    with running_server(dec, tok, max_batch_size=16, max_queue=64) as (url, app, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        yield url, client, dec, tok


def offline_greedy(dec, tok, ids, n):
    """The target's own greedy continuation (plain decoding, no draft), and its text."""
    plain = SpeculativeDecoder(dec.target, None, 0, tokenizer=tok)
    new = plain.generate([ids], max_new_tokens=n, eos_token_id=stop_token_ids(tok, dec.target)).new_tokens[0]
    return new.tolist()


@pytest.mark.parametrize("prompt", ["w5", "w7 w8", [5, 9, 11]])
def test_completion_greedy_equals_offline_greedy(server, prompt):
    url, client, dec, tok = server
    ids = tok(prompt)["input_ids"] if isinstance(prompt, str) else prompt
    new = offline_greedy(dec, tok, ids, 14)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=14, temperature=0)
    assert r.choices[0].text == tok.decode(new, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(new)
    stopped = new[-1] in stop_token_ids(tok, dec.target)
    assert r.choices[0].finish_reason == ("stop" if stopped else "length")


def test_streaming_equals_non_streaming_with_usage_last(server):
    url, client, dec, tok = server
    full = client.completions.create(model=MODEL, prompt="w7 w8", max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="w7 w8", max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_uses_the_template_and_streams(server):
    url, client, dec, tok = server
    messages = [{"role": "system", "content": "w3"}, {"role": "user", "content": "w4 w5"}]
    ids = tok("w3 w4 w5 w9")["input_ids"]  # the test template: contents, then the generation prompt w9
    new = offline_greedy(dec, tok, ids, 10)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == tok.decode(new, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids)
    stream = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == r.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == r.choices[0].finish_reason


def seeded(client, **kw):
    args = dict(model=MODEL, prompt="w5 w6", max_tokens=24, temperature=1.0, top_p=0.95, seed=1234,
                extra_body={"min_p": 0.02, "repetition_penalty": 1.2}, presence_penalty=0.3)
    args.update(kw)
    return client.completions.create(**args)


def test_seeded_sample_same_alone_and_among_eight_concurrent(server):
    url, client, dec, tok = server
    alone = seeded(client)
    assert alone.usage.completion_tokens > 1
    others = [dict(seed=s, prompt=f"w{10 + s}", max_tokens=40) for s in range(4)]
    others += [dict(seed=None, temperature=0.7, max_tokens=30, extra_body={"top_k": 5}, frequency_penalty=0.5)] * 2
    others += [dict(temperature=0.0, prompt="w2 w3", max_tokens=40, seed=None)] * 2
    with cf.ThreadPoolExecutor(9) as pool:
        busy = [pool.submit(seeded, client, **kw) for kw in others]
        again = pool.submit(seeded, client)
        assert again.result().choices[0].text == alone.choices[0].text
        assert all(f.result().usage.completion_tokens >= 1 for f in busy)
    # A different seed gives a different sample (the seed is really used).
    assert any(seeded(client, seed=s).choices[0].text != alone.choices[0].text for s in (1, 2, 3))


def test_stop_string_spanning_tokens_never_leaks(server):
    url, client, dec, tok = server
    # Each streamed chunk is one step's committed tokens; pick a step that committed >= 3 tokens (accepted drafts)
    # and a stop string inside it that ends one token and starts the next.
    steps = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt="w5", max_tokens=24,
                                                                  temperature=0, stream=True) if c.choices]
    free = "".join(steps)
    window = next(t for t in steps[1:] if len(t.split()) >= 3)
    words = window.split()
    stop = words[0][-1] + " " + words[1][:2]
    cut = free[: free.find(stop)]
    assert free.find(stop) >= free.find(window) - 1  # the first occurrence is in that window
    r = client.completions.create(model=MODEL, prompt="w5", max_tokens=24, temperature=0, stop=[stop, "zzz"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    # usage counts the tokens up to the one that completed the stop string, not the rest of that step's window
    # (found by a new user: under auto γ the count depended on the server's load)
    greedy = offline_greedy(dec, tok, tok("w5")["input_ids"], 24)
    needed = next(k for k in range(1, 25) if stop in tok.decode(greedy[:k], skip_special_tokens=True,
                                                                 clean_up_tokenization_spaces=False))
    assert r.usage.completion_tokens == needed
    chunks = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt="w5", max_tokens=24,
                                                                   temperature=0, stop=stop, stream=True)
              if c.choices]
    assert "".join(chunks) == cut
    # A stop id from the request: the text ends before it, the reason is "stop".
    ids = offline_greedy(dec, tok, tok("w5")["input_ids"], 16)
    k = next(i for i, t in enumerate(ids) if i >= 2 and t not in ids[:i])
    r = client.completions.create(model=MODEL, prompt="w5", max_tokens=16, temperature=0,
                                  extra_body={"stop_token_ids": [ids[k]]})
    assert r.choices[0].text == tok.decode(ids[:k]) and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == k + 1


def test_generation_config_eos_list_stops_the_server():
    dec, tok = tiny_pair()
    ids = tok("w5")["input_ids"]
    free = offline_greedy(dec, tok, ids, 16)
    k = next(i for i, t in enumerate(free) if i >= 2 and t not in free[:i] and t != 2)
    dec.target.generation_config.eos_token_id = [2, free[k]]
    with running_server(dec, tok) as (url, _, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        r = client.completions.create(model=MODEL, prompt="w5", max_tokens=16, temperature=0)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == k + 1
    assert r.choices[0].text == tok.decode(free[:k])


def test_disconnect_frees_its_row(server):
    url, client, dec, tok = server
    before = metric(url, "draftkit_requests_total", {"finish_reason": "abort"}) or 0.0
    # Greedy "w5" runs 240 tokens without an eos (checked offline), so only the disconnect can end it early.
    body = {"model": MODEL, "prompt": "w5", "max_tokens": 240, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["text"]
        # leaving the block closes the connection mid-stream
    deadline = time.time() + 20
    while time.time() < deadline and (dec.num_active() or httpx.get(url + "/health").json()["running"]):
        time.sleep(0.05)
    assert dec.num_active() == 0 and not dec.has_unfinished()
    assert httpx.get(url + "/health").json()["running"] == 0
    assert metric(url, "draftkit_requests_total", {"finish_reason": "abort"}) == before + 1


def test_dropped_non_streaming_request_is_aborted_while_it_decodes():
    """A client that gives up on a non-streaming request frees its row before the generation ends, although the
    row sends the handler tokens every step (each step is slowed to 20 ms here, so 240 greedy tokens of "w5", no
    eos, take over a second; the client leaves after 0.3 s)."""
    dec, tok = tiny_pair()
    step = dec.step
    dec.step = lambda: time.sleep(0.02) or step()
    with running_server(dec, tok) as (url, app, _):
        before = {r: metric(url, "draftkit_requests_total", {"finish_reason": r}) or 0.0 for r in ("abort", "length")}
        body = {"model": MODEL, "prompt": "w5", "max_tokens": 240, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
        deadline = time.time() + 20
        while time.time() < deadline and httpx.get(url + "/health").json()["running"]:
            time.sleep(0.02)
        assert metric(url, "draftkit_requests_total", {"finish_reason": "abort"}) == before["abort"] + 1
        assert (metric(url, "draftkit_requests_total", {"finish_reason": "length"}) or 0.0) == before["length"]


def test_a_request_dropped_while_queued_counts_as_aborted():
    """Found by a new user: a request whose client left while it waited in the queue left requests_total
    untouched (it was in no finish_reason), while a running one counted as abort."""
    dec, tok = tiny_pair()
    step = dec.step
    dec.step = lambda: time.sleep(0.02) or step()
    with running_server(dec, tok, max_batch_size=1, max_queue=2) as (url, app, _):
        body = {"model": MODEL, "prompt": "w5", "max_tokens": 240, "temperature": 0}
        first = threading.Thread(target=lambda: httpx.post(url + "/v1/completions", json=body, timeout=60))
        first.start()  # holds the only row for about 5 s
        deadline = time.time() + 20
        while time.time() < deadline and not httpx.get(url + "/health").json()["running"]:
            time.sleep(0.02)
        before = metric(url, "draftkit_requests_total", {"finish_reason": "abort"}) or 0.0
        with pytest.raises(httpx.ReadTimeout):  # waits in the queue behind the first, then gives up
            httpx.post(url + "/v1/completions", json={**body, "max_tokens": 4},
                       timeout=httpx.Timeout(10, read=0.5))
        deadline = time.time() + 20
        while time.time() < deadline and metric(url, "draftkit_queue_depth", {}):
            time.sleep(0.02)
        assert metric(url, "draftkit_queue_depth", {}) == 0.0
        assert metric(url, "draftkit_requests_total", {"finish_reason": "abort"}) == before + 1
        first.join(60)
        assert metric(url, "draftkit_requests_total", {"finish_reason": "abort"}) == before + 1


def test_a_slow_tokenization_does_not_hold_up_other_requests():
    """Prompts were tokenized on the event loop: a 1 MB prompt (~1.4 s to tokenize) froze every stream and
    /health meanwhile. Here the tokenizer holds one prompt until /health has answered; on the event loop /health
    could not answer (its read times out after 10 s, and the test fails)."""
    dec, tok = tiny_pair()
    entered, gate = threading.Event(), threading.Event()

    class GatedTokenizer:  # the real tokenizer, except that the prompt "w9 w9" waits at the gate
        def __getattr__(self, name):
            return getattr(tok, name)

        def __len__(self):
            return len(tok)

        def __call__(self, text, *args, **kwargs):
            if text == "w9 w9":
                entered.set()
                gate.wait(30)
            return tok(text, *args, **kwargs)

    with running_server(dec, GatedTokenizer()) as (url, app, _):
        with cf.ThreadPoolExecutor(1) as pool:
            slow = pool.submit(httpx.post, url + "/v1/completions", timeout=60,
                               json={"model": MODEL, "prompt": "w9 w9", "max_tokens": 2, "temperature": 0})
            assert entered.wait(30)
            try:
                assert httpx.get(url + "/health", timeout=10).status_code == 200
            finally:
                gate.set()
            assert slow.result().status_code == 200


def test_metrics_in_prometheus_format(server):
    url, client, dec, tok = server
    client.completions.create(model=MODEL, prompt="w6", max_tokens=8, temperature=0)
    assert metric(url, "draftkit_requests_total", {"endpoint": "completions"}) >= 1
    assert metric(url, "draftkit_generation_tokens_total") >= 8
    assert metric(url, "draftkit_drafted_tokens_total") > 0
    assert 0.0 <= metric(url, "draftkit_acceptance_rate") <= 1.0
    assert metric(url, "draftkit_mean_accepted_length") >= 1.0
    assert metric(url, "draftkit_time_to_first_token_seconds_count") >= 1
    assert metric(url, "draftkit_inter_token_latency_seconds_count") >= 1
    assert metric(url, "draftkit_queue_depth") == 0 and metric(url, "draftkit_running_requests") == 0
    assert metric(url, "process_resident_memory_bytes") > 0


def test_derived_metrics_follow_decode_stats_when_nothing_was_drafted():
    """A server without a draft reported τ = 0 and an acceptance rate of 0 (DecodeStats: τ = 1, rate undefined)."""
    def gauges(m):
        return {s.name: s.value for f in text_string_to_metric_families(m.render().decode()) for s in f.samples
                if s.name in ("draftkit_acceptance_rate", "draftkit_mean_accepted_length")}

    m = ServerMetrics()
    assert all(math.isnan(v) for v in gauges(m).values())  # nothing finished: undefined, not 0
    m.record_stats(DecodeStats(num_new_tokens=4, num_target_forwards=4))  # plain decoding
    g = gauges(m)
    assert math.isnan(g["draftkit_acceptance_rate"]) and g["draftkit_mean_accepted_length"] == 1.0
    m.record_stats(DecodeStats(num_drafted=8, num_accepted=6, num_verify_steps=2, num_new_tokens=8))
    assert gauges(m) == {"draftkit_acceptance_rate": 0.75, "draftkit_mean_accepted_length": 4.0}


def test_a_fixed_gamma_predicted_slower_than_plain_decoding_is_warned_once(caplog):
    """Found by a new user: a weak draft at γ = 4 served at about 0.6× plain decoding while /metrics showed an
    acceptance of 0.018 and nothing warned. After 200 drafted tokens the prediction at the measured α is a gauge,
    and below 1 it is logged once and shown on /health."""
    cost_model = {"cost_ratio": 0.1, "verify": [1.0, 1.1, 1.2, 1.3, 1.4]}

    def predicted(m):
        return next(s.value for f in text_string_to_metric_families(m.render().decode()) for s in f.samples
                    if s.name == "draftkit_predicted_speedup")

    m = ServerMetrics(4, cost_model)
    m.record_stats(DecodeStats(num_drafted=196, num_accepted=2, num_verify_steps=49, num_rejections=48))
    assert math.isnan(predicted(m)) and m.slowdown_warning is None  # 196 drafted: too few to judge
    with caplog.at_level("WARNING", logger="decode.serving"):
        for _ in range(3):
            m.record_stats(DecodeStats(num_drafted=4, num_accepted=0, num_verify_steps=1, num_rejections=1))
    alpha = 2 / 53  # Σaccepted / (Σaccepted + rejections)
    assert predicted(m) == pytest.approx((1 - alpha ** 5) / ((1 - alpha) * 1.8))
    warning = m.slowdown_warning  # from the first record that reached 200 drafted tokens
    assert warning.startswith(f"warning: at the measured acceptance (α = {2 / 51:.3f} over 200 drafted "
                              "tokens)") and "restart with --num-draft-tokens auto" in warning
    assert [r.getMessage() for r in caplog.records] == [m.slowdown_warning]  # once, not per request
    good = ServerMetrics(4, cost_model)
    good.record_stats(DecodeStats(num_drafted=400, num_accepted=320, num_verify_steps=100, num_rejections=60))
    assert predicted(good) > 1 and good.slowdown_warning is None
    auto = ServerMetrics(None, cost_model)  # auto γ (or no draft): no fixed γ to judge
    auto.record_stats(DecodeStats(num_drafted=400, num_accepted=0, num_verify_steps=100, num_rejections=100))
    assert math.isnan(predicted(auto)) and auto.slowdown_warning is None


def test_health_shows_the_slowdown_warning_of_a_fixed_gamma():
    dec, tok = tiny_pair(gamma=4)
    cost_model = {"cost_ratio": 1.0, "verify": [1.0, 2.0]}  # a draft as slow as its target: even α = 1 loses
    with running_server(dec, tok, cost_model=cost_model) as (url, app, server):
        assert httpx.get(url + "/health").json()["warning"] is None
        for _ in range(8):
            if metric(url, "draftkit_drafted_tokens_total") >= 200:
                break
            body = {"model": MODEL, "prompt": "w5", "max_tokens": 100, "temperature": 0}
            assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        warning = httpx.get(url + "/health").json()["warning"]
        assert warning and "γ = 4 is predicted to run at" in warning
        assert metric(url, "draftkit_predicted_speedup") < 1


def test_full_queue_is_429_with_retry_after_and_shutdown_drains():
    dec, tok = tiny_pair()
    with running_server(dec, tok, max_batch_size=1, max_queue=1) as (url, app, server):
        long = {"model": MODEL, "prompt": "w5", "max_tokens": 240, "temperature": 0}  # no eos before 240
        results = {}

        def stream_long():
            with httpx.stream("POST", url + "/v1/completions", json={**long, "stream": True}, timeout=60) as r:
                results["lines"] = [line for line in r.iter_lines() if line.startswith("data: ")]

        t = threading.Thread(target=stream_long)
        t.start()
        deadline = time.time() + 20
        while httpx.get(url + "/health").json()["running"] == 0 and time.time() < deadline:
            time.sleep(0.01)
        with cf.ThreadPoolExecutor(3) as pool:
            short = [pool.submit(httpx.post, url + "/v1/completions", json={**long, "max_tokens": 2}, timeout=60)
                     for _ in range(3)]
            codes = sorted(f.result().status_code for f in short)
        rejected = [f.result() for f in short if f.result().status_code == 429]
        assert codes == [200, 429, 429]  # one waits its turn, two find the queue full
        assert rejected[0].headers["retry-after"] == "1" and rejected[0].json()["error"]["code"] == "queue_full"
        assert rejected[0].json()["error"]["message"] == ("the server is busy: 1 of 1 batch rows taken "
                                                          "(--max-batch-size) and 1 of 1 queue places (--max-queue); "
                                                          "retry later")
        server.should_exit = True  # graceful: the running stream still finishes
        t.join(timeout=60)
    lines = results["lines"]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_the_queue_limit_counts_only_requests_beyond_the_free_batch_rows():
    """--max-queue 0 means no waiting, not no serving: requests that fit in the batch's free rows are admitted."""
    dec, tok = tiny_pair()
    with running_server(dec, tok, max_batch_size=2, max_queue=0) as (url, app, server):
        body = {"model": MODEL, "prompt": "w5", "max_tokens": 2, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        with cf.ThreadPoolExecutor(2) as pool:
            codes = [f.result().status_code for f in
                     [pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=60) for _ in range(2)]]
        assert codes == [200, 200]


def test_a_failing_step_is_a_500_and_the_server_keeps_serving():
    """Fault injection: the engine's step raises once. That batch gets a 500 in OpenAI's shape; the next works."""
    dec, tok = tiny_pair()
    real_step, calls = dec.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected fault")
        return real_step()

    dec.step = failing_step
    with running_server(dec, tok) as (url, _, _):
        body = {"model": MODEL, "prompt": "w5", "max_tokens": 4, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "server_error"
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert not dec.has_unfinished()
