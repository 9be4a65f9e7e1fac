"""Prompt loaders on the real files in ../shared/data, local jsonl, limits, chat templates and bad input."""
from __future__ import annotations

import gzip
import json
from collections import Counter

import pytest

from decode.prompts import PROMPT_SETS, Prompt, encode_prompts, load_prompts, shared_data_dir

EXPECTED_ROWS = {"humaneval": 164, "mbpp": 974, "spec_bench": 480, "mt_bench": 80, "gsm8k": 1319}


def char_tokenizer(chat_template: str | None = None):
    """A real fast tokenizer over 92 characters (ids 0..95), matching the tiny models' vocabulary of 96."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "\n": 4}
    for c in range(32, 127):
        if len(vocab) < 96:
            vocab[chr(c)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                 unk_token="<unk>")
    hf.chat_template = chat_template
    return hf


def test_shared_data_dir_points_beside_repo():
    assert (shared_data_dir() / "SOURCES.md").exists()


@pytest.mark.parametrize("name", sorted(PROMPT_SETS))
def test_named_sets_load_every_row(name):
    prompts = load_prompts(name)
    assert len(prompts) == EXPECTED_ROWS[name]
    assert all(isinstance(p.text, str) and p.text.strip() for p in prompts)
    assert len({p.id for p in prompts}) == len(prompts), "ids must be unique within a set"


def test_field_contents_match_the_files():
    he = load_prompts("humaneval", limit=1)[0]
    assert he.id == "HumanEval/0" and "def has_close_elements" in he.text
    assert load_prompts("mbpp", limit=1)[0].text.startswith("Write a function to find the minimum cost path")
    assert load_prompts("gsm8k", limit=1)[0].text.startswith("Janet")
    mt = load_prompts("mt_bench", limit=1)[0]
    # First turn only, not the follow-up.
    assert mt.text.startswith("Compose an engaging travel blog") and mt.category == "writing"


def test_spec_bench_categories_and_balanced_limit():
    all_prompts = load_prompts("spec_bench")
    counts = Counter(p.category for p in all_prompts)
    assert counts["translation"] == 80 and counts["writing"] == 10 and len(counts) == 13
    limited = load_prompts("spec_bench", limit=26)
    assert Counter(p.category for p in limited) == Counter({c: 2 for c in counts})
    # Without balancing the file order wins: the first 26 are MT-Bench categories only.
    first = load_prompts("spec_bench", limit=26, balanced=False)
    assert "translation" not in {p.category for p in first}
    assert [p.id for p in first] == [p.id for p in all_prompts[:26]]


def test_limit_without_categories_keeps_file_order():
    assert [p.id for p in load_prompts("humaneval", limit=3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]


def test_local_jsonl_with_configurable_field(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"id": "a", "body": "hello", "category": "x"}, {"id": "b", "body": "world", "category": "y"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prompts = load_prompts(path, field="body")
    assert prompts == [Prompt("a", "hello", "x"), Prompt("b", "world", "y")]
    with pytest.raises(ValueError, match="fields present"):
        load_prompts(path)  # no default field present
    gz = tmp_path / "p.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write(json.dumps({"prompt": "zipped"}) + "\n")
    assert load_prompts(gz)[0].text == "zipped"


def test_bad_input_gives_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown prompt set 'humaneva'.*humaneval"):
        load_prompts("humaneva")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="limit must be >= 1"):
        load_prompts("gsm8k", limit=0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_prompts(bad)


def test_a_broken_gzip_or_non_utf8_file_names_itself(tmp_path):
    """These were tracebacks from gzip (exit 1 in decode bench) or a bare codec message without the file."""
    import gzip

    whole = gzip.compress("".join(f'{{"prompt": "{i} {"ab" * (i % 37)}"}}\n' for i in range(400)).encode())
    cases = {"truncated.jsonl.gz": whole[: len(whole) // 2], "plain.jsonl.gz": b'{"prompt": "a"}\n',
             "latin1.jsonl": b'{"prompt": "caf\xe9"}\n'}
    for name, raw in cases.items():
        (tmp_path / name).write_bytes(raw)
        why = "not UTF-8 text" if name.startswith("latin1") else "not a whole gzip file"
        with pytest.raises(ValueError, match=f"{name}: {why}"):
            load_prompts(tmp_path / name)


def test_missing_shared_data_names_the_env_var(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTKIT_SHARED_DATA", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="DRAFTKIT_SHARED_DATA"):
        load_prompts("gsm8k")


def test_encode_plain_and_truncation():
    tok = char_tokenizer()
    prompts = [Prompt("0", "abc"), Prompt("1", "hello world")]
    ids = encode_prompts(prompts, tok)
    assert tok.decode(ids[0]) == "abc"
    trunc = encode_prompts(prompts, tok, max_prompt_tokens=5)
    assert tok.decode(trunc[1]) == "world"  # the end of the prompt is kept
    assert trunc[0] == ids[0]


def test_encode_applies_chat_template_when_present():
    template = "{% for m in messages %}<s>U:{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    tok = char_tokenizer(chat_template=template)
    ids = encode_prompts([Prompt("0", "hi")], tok)[0]
    assert tok.decode(ids) == "<s>U:hi\nA:"
    plain = encode_prompts([Prompt("0", "hi")], tok, chat_template=False)[0]
    assert tok.decode(plain) == "hi"
