"""The HTTP server on loopback: a real uvicorn server in a thread, real HTTP requests."""
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from decode import SpeculativeDecoder
from decode.server import create_app
from tests.conftest import make_tokenizer, perturbed_copy, tiny_llama


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    target = tiny_llama(seed=0)
    tok = make_tokenizer()
    dec = SpeculativeDecoder(target, perturbed_copy(target, 0.4), 3, tokenizer=tok)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(dec, tok, {"target": "tiny"}), host="127.0.0.1", port=port,
                                        log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    assert srv.started
    yield f"http://127.0.0.1:{port}", dec
    srv.should_exit = True
    thread.join(timeout=10)


def test_health(server):
    url, _ = server
    r = httpx.get(url + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["num_draft_tokens"] == 3


def test_generate_greedy_equals_library_call(server):
    url, dec = server
    r = httpx.post(url + "/generate", json={"prompt": "w1 w2 w3", "max_new_tokens": 10}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    direct = dec.generate([[5, 6, 7]], max_new_tokens=10, eos_token_id=2).new_tokens[0].tolist()
    assert body["token_ids"] == direct
    assert body["stats"]["num_new_tokens"] == len(direct)
    assert body["finish_reason"] in ("stop", "length")


def test_sampling_seeded_and_metrics_pooled(server):
    url, _ = server
    req = {"input_ids": [5, 9], "max_new_tokens": 8, "temperature": 1.0, "top_p": 0.9, "seed": 3}
    a = httpx.post(url + "/generate", json=req, timeout=60).json()
    b = httpx.post(url + "/generate", json=req, timeout=60).json()
    assert a["token_ids"] == b["token_ids"]
    m = httpx.get(url + "/metrics", timeout=10).json()
    assert m["num_sequences"] >= 2 and 0.0 <= m["acceptance_rate"] <= 1.0


@pytest.mark.parametrize("payload,status,needle", [
    ({"max_new_tokens": 4}, 422, "exactly one of"),
    ({"prompt": "w1", "temperature": -1}, 422, "temperature"),
    ({"prompt": "w1", "top_p": 3}, 422, "top_p"),
    ({"input_ids": [5, 100000]}, 400, "outside the vocabulary"),
    ({"prompt": "w1", "num_draft_tokens": "lots"}, 400, "num_draft_tokens"),
])
def test_bad_requests_get_clear_errors(server, payload, status, needle):
    url, _ = server
    r = httpx.post(url + "/generate", json=payload, timeout=30)
    assert r.status_code == status
    assert needle in r.text


def test_malformed_json(server):
    url, _ = server
    r = httpx.post(url + "/generate", content=b"{not json", headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 422
    assert httpx.get(url + "/health", timeout=10).status_code == 200  # still serving
