"""The answers built from a request's events (decode.serving.handlers), called directly on a fake request queue: the
SSE chunks of a stream, the one body of a non-streaming request, and the abort when the client is gone. The same
paths through a real server are in test_server_api.py and test_server_errors.py."""
import asyncio
import json

import pytest

from decode.serving.handlers import collect_response, sse, stream_events
from decode.serving.protocol import APIError


class FakeLive:
    def __init__(self, events):
        self.request_id = "req-1"
        self.queue = asyncio.Queue()
        for event in events:
            self.queue.put_nowait(event)


class FakeScheduler:
    def __init__(self):
        self.aborted = []

    def abort(self, request_id):
        self.aborted.append(request_id)


class FakeRequest:
    def __init__(self, gone=False):
        self.gone = gone

    async def is_disconnected(self):
        return self.gone


USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def stream(events, chat, usage_wanted):
    async def run():
        scheduler = FakeScheduler()
        chunks = [c async for c in stream_events(FakeLive(events), scheduler, "id", "tiny", chat, usage_wanted)]
        return chunks, scheduler.aborted
    return asyncio.run(run())


def test_sse_is_one_data_line():
    assert sse({"a": 1}) == 'data: {"a": 1}\n\n'


def test_a_chat_stream_opens_with_the_role_and_ends_with_usage_and_done():
    chunks, aborted = stream([("delta", "w4 "), ("delta", "w5"), ("done", "stop", USAGE)], True, True)
    assert chunks[-1] == "data: [DONE]\n\n" and not aborted
    bodies = [json.loads(c[len("data: "):]) for c in chunks[:-1]]
    assert bodies[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [b["choices"][0]["delta"].get("content") for b in bodies[1:3]] == ["w4 ", "w5"]
    assert bodies[3]["choices"][0]["finish_reason"] == "stop"
    assert bodies[4]["choices"] == [] and bodies[4]["usage"] == USAGE  # include_usage: the last chunk


def test_a_failed_request_streams_its_error_then_done():
    err = APIError(503, "the server shut down", code="shutting_down")
    chunks, _ = stream([("delta", "w4"), ("error", err)], False, False)
    assert json.loads(chunks[-2][len("data: "):]) == err.body() and chunks[-1] == "data: [DONE]\n\n"


def test_a_stream_closed_early_aborts_its_request():
    async def run():
        scheduler = FakeScheduler()
        events = stream_events(FakeLive([("delta", "w4")]), scheduler, "id", "tiny", False, False)
        await events.__anext__()
        await events.aclose()  # what the server does when the client goes away
        return scheduler.aborted
    assert asyncio.run(run()) == ["req-1"]


def collect(events, gone=False):
    async def run():
        scheduler = FakeScheduler()
        body = await collect_response(FakeRequest(gone), FakeLive(events), scheduler, "id", "tiny", False)
        return body, scheduler.aborted
    return asyncio.run(run())


def test_a_non_streaming_request_gets_its_text_in_one_body():
    body, aborted = collect([("delta", "w4 "), ("delta", "w5"), ("done", "length", USAGE)])
    assert body["choices"][0]["text"] == "w4 w5" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == USAGE and body["object"] == "text_completion" and not aborted


def test_a_non_streaming_error_is_raised_and_a_gone_client_aborts():
    with pytest.raises(APIError, match="queue"):
        collect([("error", APIError(429, "queue full"))])
    response, aborted = collect([], gone=True)  # nothing arrives: the disconnect check runs after 0.2 s
    assert response.status_code == 499 and aborted == ["req-1"]
