"""Helpers of the server tests: a real uvicorn server on a free loopback port, in a thread, over a tiny pair."""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from decode import SpeculativeDecoder
from decode.serving.app import create_app, make_server
from decode.serving.parsing import ServerLimits
from tests.conftest import make_tokenizer, perturbed_copy, tiny_llama

MODEL = "tiny"
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}w9{% endif %}")


class EndlessEngine:
    """The engine's request API for scheduler tests, without a model: a request never finishes by itself (each
    step takes 1 ms and finishes nothing), aborts are accepted."""

    def add_request(self, *a, **k):
        pass

    def step(self):
        time.sleep(0.001)
        return []

    def abort(self, rid):
        pass


def metric(url, name, labels=None):
    """The value of one sample of the server's ``GET /metrics`` (None when it has no such sample)."""
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                return s.value
    return None


def tiny_pair(gamma: int = 3, chat: bool = True, eos=None):
    """(decoder, tokenizer): a 2-layer Llama target, a perturbed copy as draft, the word-level test tokenizer."""
    target = tiny_llama(seed=0)
    if eos is not None:
        target.generation_config.eos_token_id = eos
    tok = make_tokenizer()
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    return SpeculativeDecoder(target, perturbed_copy(target, 0.4), gamma, tokenizer=tok), tok


@contextlib.contextmanager
def running_server(decoder, tokenizer, graceful_shutdown_s: float = 30.0, **kw):
    """Yield ``(base_url, app, server)`` of a real uvicorn server on 127.0.0.1 (the one ``decode serve`` runs,
    :func:`decode.serving.app.make_server`); stops it (gracefully) on exit."""
    # A socket bound here and handed to uvicorn: no other test (or pytest-xdist worker) can take the port between
    # choosing it and binding it.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    kw.setdefault("limits", ServerLimits())
    app = create_app(decoder, tokenizer, MODEL, **kw)
    server = make_server(app, "127.0.0.1", port, graceful_shutdown_s, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}", app, server
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()
