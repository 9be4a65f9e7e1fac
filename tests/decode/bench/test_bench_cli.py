"""``python -m decode bench``'s settings as recorded: whether the chat template was applied, and its source."""
from __future__ import annotations

import pytest

from decode.bench.cli import _encode, build_parser, config_from_args
from decode.prompts import Prompt
from tests.conftest import tiny_llama
from tests.decode.test_prompts import char_tokenizer

TEMPLATE = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}>{% endif %}"


@pytest.mark.parametrize("template, flags, applied", [(TEMPLATE, [], True), (TEMPLATE, ["--no-chat-template"], False),
                                                      (None, [], False)])
def test_the_config_records_whether_the_chat_template_was_applied(template, flags, applied):
    args = build_parser().parse_args(["--target", "t", "--draft", "d", "--max-new-tokens", "4", *flags])
    cfg = config_from_args(args)
    tokenizer = char_tokenizer(template)
    tokenizer.name_or_path = "the/target"
    model = tiny_llama()
    ids = _encode([Prompt(id="p", text="hi", category=None)], tokenizer, model, model, cfg, args)
    assert (cfg.chat_template, cfg.chat_template_source) == (applied, "the/target" if applied else None)
    assert ids == [tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False) if applied
                   else tokenizer("hi")["input_ids"]]
