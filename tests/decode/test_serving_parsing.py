"""Request parsing of the server, called directly (no HTTP): body -> request model -> GenerationRequest, and the
4xx each bad input gets. The same errors through a real server are in test_server_errors.py."""
import asyncio
import json
from types import SimpleNamespace

import pytest

from decode.serving.parsing import (RequestRules, ServerLimits, check_content_encoding, check_prompt_ids,
                                    generation_request, max_new_tokens, parse_request, prompt_ids, read_body,
                                    request_rules, stop_ids)
from decode.serving.protocol import APIError
from tests.conftest import make_tokenizer

RULES = RequestRules(model_name="tiny", vocab_size=20, context=32, max_prompt_tokens=31, max_tokens=32,
                     max_tokens_flag=False, stop_ids=(2,))


def completion(**fields):
    return parse_request(json.dumps({"model": "tiny", "prompt": [5, 6, 7], **fields}).encode(), chat=False)


def chat_request(content="w4"):
    return parse_request(json.dumps({"model": "tiny", "messages": [{"role": "user", "content": content}]}).encode(),
                         chat=True)


def error_of(fn, *args) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args)
    return info.value


def assert_error(err, status, text, code=None):
    assert err.status == status and text in err.message, (err.status, err.message)
    assert code is None or err.code == code, err.code


def test_a_completion_becomes_the_schedulers_request():
    req = completion(max_tokens=5, temperature=0.5, seed=3, stop_token_ids=[9], stop=["w1"])
    gen = generation_request(req, False, make_tokenizer(), RULES)
    assert gen.prompt_ids == [5, 6, 7] and gen.stop_ids == [2, 9] and gen.stop_strings == ["w1"]
    assert gen.endpoint == "completions"
    assert gen.sampling == dict(max_new_tokens=5, temperature=0.5, top_k=None, top_p=None, min_p=None,
                                presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, seed=3)


def test_text_and_chat_prompts_are_tokenized():
    tok = make_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    assert prompt_ids(completion(prompt="w4 w5"), False, tok, RULES) == tok("w4 w5")["input_ids"]
    assert prompt_ids(chat_request(), True, tok, RULES) == tok("w4 ")["input_ids"]
    gen = generation_request(chat_request(), True, tok, RULES)
    assert gen.endpoint == "chat" and gen.sampling["max_new_tokens"] == 32 - len(gen.prompt_ids)  # fills the context


def test_a_chat_template_that_refuses_the_messages_is_a_400():
    tok = make_tokenizer()
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    assert_error(error_of(prompt_ids, chat_request(), True, tok, RULES), 400,
                 "the model's chat template refused these messages: roles must alternate", "invalid_value")


def test_the_wrong_model_is_a_404():
    assert_error(error_of(generation_request, completion(model="other"), False, make_tokenizer(), RULES), 404,
                 "the model 'other' does not exist; this server serves 'tiny'", "model_not_found")


def test_bad_prompts_are_400s():
    assert_error(error_of(check_prompt_ids, [], "prompt", RULES), 400, "prompt encodes to no tokens")
    assert_error(error_of(check_prompt_ids, [1, 20], "prompt", RULES), 400,
                 "token ids outside the vocabulary [0, 20): [20]")
    assert_error(error_of(check_prompt_ids, [1] * 32, "messages", RULES), 400,
                 "messages has 32 tokens; this server accepts at most 31", "context_length_exceeded")


def test_max_tokens_default_limit_and_room():
    assert max_new_tokens(completion(), 3, False, RULES) == 16  # OpenAI's default for completions
    assert max_new_tokens(completion(), 30, False, RULES) == 2  # as many as the context leaves
    assert max_new_tokens(completion(max_tokens=29), 3, False, RULES) == 29
    assert_error(error_of(max_new_tokens, completion(max_tokens=33), 3, False, RULES), 400,
                 "max_tokens=33 is above this server's limit of 32 (the target's context)")
    assert_error(error_of(max_new_tokens, completion(max_tokens=30), 3, False, RULES), 400,
                 "the prompt (3 tokens) plus max_tokens=30 exceeds", "context_length_exceeded")


def test_stop_token_ids_join_the_servers_and_must_be_in_the_vocabulary():
    assert stop_ids(completion(stop_token_ids=[7, 2]), RULES) == [2, 7]
    assert_error(error_of(stop_ids, completion(stop_token_ids=[25]), RULES), 400,
                 "stop_token_ids outside the vocabulary [0, 20): [25]")


def test_rules_follow_the_decoder_and_the_limits():
    tok = make_tokenizer()
    decoder = SimpleNamespace(context_length=64, vocab_size=20, target=None)
    rules = request_rules(decoder, tok, "tiny", ServerLimits())
    assert (rules.context, rules.max_prompt_tokens, rules.max_tokens, rules.max_tokens_flag) == (64, 63, 64, False)
    assert rules.stop_ids == (tok.eos_token_id,)
    rules = request_rules(decoder, tok, "tiny", ServerLimits(max_tokens=8, max_prompt_tokens=10))
    assert (rules.max_prompt_tokens, rules.max_tokens, rules.max_tokens_flag) == (10, 8, True)


def test_bad_bodies_are_400s():
    assert_error(error_of(parse_request, b"{", False), 400, "the request body is not valid JSON", "invalid_json")
    assert_error(error_of(parse_request, b'{"model": "tiny", "prompt": "w4", "temprature": 0}', False), 400,
                 "unknown field 'temprature'", "invalid_value")


def test_a_compressed_body_is_a_415():
    check_content_encoding("")
    check_content_encoding("identity")
    assert_error(error_of(check_content_encoding, "GZIP"), 415, "Content-Encoding: gzip is not supported",
                 "unsupported_content_encoding")


class FakeRequest:
    """What read_body uses of a Starlette request: its headers and its body as an async stream of chunks."""

    def __init__(self, chunks, headers=None, stall=False):
        self.chunks, self.stall = chunks, stall
        self.headers = SimpleNamespace(getlist=lambda name: [], get=lambda name: (headers or {}).get(name))

    async def stream(self):
        for chunk in self.chunks:
            yield chunk
        if self.stall:
            await asyncio.sleep(60)


def read(request, limits=ServerLimits(), draining=False):
    async def run():
        event = asyncio.Event()
        if draining:
            event.set()
        return await read_body(request, limits, event)
    return asyncio.run(run())


def test_read_body_joins_the_chunks_within_the_limits():
    assert read(FakeRequest([b'{"a":', b" 1}"])) == b'{"a": 1}'
    assert_error(error_of(read, FakeRequest([b"abc", b"de"]), ServerLimits(max_body_bytes=4)), 413,
                 "larger than 4 bytes", "request_too_large")
    # said by Content-Length, before any byte is read
    assert_error(error_of(read, FakeRequest([], {"content-length": "5"}), ServerLimits(max_body_bytes=4)), 413,
                 "larger than 4 bytes")
    assert_error(error_of(read, FakeRequest([b"{"], stall=True), ServerLimits(body_timeout_s=0.05)), 408,
                 "did not arrive within 0.05 s", "request_timeout")
    assert_error(error_of(read, FakeRequest([b"{"], stall=True), ServerLimits(), True), 503, "shutting down",
                 "shutting_down")
