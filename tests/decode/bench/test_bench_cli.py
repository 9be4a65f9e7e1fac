"""``python -m decode bench``'s settings: the defaults of a first try, and whether the chat template was applied (and
whose), as recorded."""
from __future__ import annotations

import pytest

from decode.bench.cli import _encode, build_parser, config_from_args
from decode.bench.runs import planned_calls
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


def test_the_defaults_are_sized_for_a_first_try():
    """A first run on a ~100M target on a CPU takes minutes, not ten: few prompts, short outputs, greedy only, no
    batch pass beyond the main pass's rows; docs/bench.md lists the same defaults."""
    cfg = config_from_args(build_parser().parse_args(["--target", "t", "--draft", "d"]))
    assert (cfg.limit, cfg.max_new_tokens, cfg.gammas, cfg.auto, cfg.temperatures, cfg.batch_sizes, cfg.hf_gammas,
            cfg.repeats, cfg.cost_repeats) == (4, 32, [1, 2, 4], True, [0.0], [1], [], 1, 11)
    assert planned_calls(cfg, 4) == {"main": 28, "batch": 0, "warmup": 7}  # plain, 3 γ, auto, HF target, assisted
