"""Data sources, field mapping, text windows, chat template, masks, deterministic order."""
import gzip
import json

import pytest
from omegaconf import OmegaConf

from distill.checks import preflight_source
from distill.config import SetupError
from distill.data import (build_examples, check_lengths, collate_prompts, collate_sequences, epoch_order,
                          micro_batch_indices, resolve_path)
from distill_helpers import data_config, source


def test_jsonl_fields_and_eos(pair, tok):
    ex = build_examples(source(path=str(pair["data"]), prompt_field="prompt", completion_field="completion"), tok,
                        data_config(max_new_tokens=100))
    first = json.loads(open(pair["data"]).readline())
    assert ex[0]["prompt_ids"] == tok(first["prompt"])["input_ids"]
    assert ex[0]["completion_ids"] == tok(first["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert len(ex) == 80
    short = build_examples(source(path=str(pair["data"]), prompt_field="prompt", completion_field="completion"), tok,
                           data_config(max_new_tokens=3))
    assert all(len(e["completion_ids"]) <= 3 for e in short)


def test_gz_parquet_and_list_fields(tmp_path, tok):
    import datasets

    gz = tmp_path / "p.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        for i in range(3):
            f.write(json.dumps({"turns": [f"the draft {i}", "second turn"], "x": i}) + "\n")
    ex = build_examples(source(path=str(gz), prompt_field="turns"), tok, data_config())
    assert [e["prompt_ids"] for e in ex] == [tok(f"the draft {i}")["input_ids"] for i in range(3)]
    assert all(e["completion_ids"] == [] for e in ex)
    pq = tmp_path / "p.parquet"
    datasets.Dataset.from_dict({"q": ["a b", "c d"], "a": [" x", " y"]}).to_parquet(str(pq))
    ex = build_examples(source(path=str(pq), prompt_field="q", completion_field="a"), tok, data_config())
    assert len(ex) == 2 and ex[1]["completion_ids"][-1] == tok.eos_token_id


def test_text_windows(pair, tok):
    src = source(path=str(pair["text"]), kind="auto", text_field="text", sample_by="paragraph", prompt_tokens=6,
               completion_tokens=4, windows_per_doc=None, add_bos=True)
    ex = build_examples(src, tok, data_config(max_new_tokens=4))
    assert len(ex) > 10
    for e in ex:
        assert e["prompt_ids"][0] == tok.bos_token_id and len(e["prompt_ids"]) == 7 and len(e["completion_ids"]) == 4
    # consecutive windows of one document continue each other
    doc = open(pair["text"]).read().split("\n\n")[0]
    ids = tok(doc, add_special_tokens=False)["input_ids"]
    assert ex[0]["prompt_ids"][1:] + ex[0]["completion_ids"] + ex[1]["prompt_ids"][1:] == ids[:16]
    capped = build_examples(OmegaConf.merge(src, {"windows_per_doc": 1}), tok, data_config(max_new_tokens=4))
    assert len(capped) == 10
    with pytest.raises(SetupError, match="prompt_tokens"):
        build_examples(OmegaConf.merge(src, {"prompt_tokens": 5000}), tok, data_config())


def test_corpus_source_calls_load_corpus(monkeypatch, tok):
    import datasets

    import distill.corpus

    seen = {}

    def fake(name, split, **kw):
        seen.update(name=name, split=split, **kw)
        return datasets.Dataset.from_dict({"text": ["the draft proposes tokens and the target verifies them " * 3]})

    monkeypatch.setattr(distill.corpus, "load_corpus", fake)
    src = source(corpus="stdlib", split="validation", corpus_kwargs={"max_items": 5}, prompt_tokens=4,
               completion_tokens=4, text_field="text")
    ex = build_examples(src, tok, data_config(max_new_tokens=4))
    assert seen == {"name": "stdlib", "split": "validation", "max_items": 5} and len(ex) >= 2


def test_chat_template_is_applied(pair, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(pair["tokenizer"]))
    tok.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<s>{% endif %}"
    ex = build_examples(source(path=str(pair["data"]), prompt_field="prompt"), tok, data_config())
    first = json.loads(open(pair["data"]).readline())["prompt"]
    assert ex[0]["prompt_ids"] == tok.apply_chat_template([{"role": "user", "content": first}],
                                                         add_generation_prompt=True, tokenize=True,
                                                         return_dict=False)
    plain = build_examples(source(path=str(pair["data"]), prompt_field="prompt"), tok, data_config(chat_template=False))
    assert plain[0]["prompt_ids"] != ex[0]["prompt_ids"]


def test_bad_sources(pair, tok, tmp_path):
    with pytest.raises(SetupError, match="does not exist"):
        build_examples(source(path=str(tmp_path / "nope.jsonl")), tok, data_config())
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SetupError, match="is empty"):
        build_examples(source(path=str(empty)), tok, data_config())
    with pytest.raises(SetupError, match="field 'question' not found.*completion"):
        build_examples(source(path=str(pair["data"]), prompt_field="question"), tok, data_config())
    (tmp_path / "x.xml").write_text("<a/>")
    with pytest.raises(SetupError, match="unknown format"):
        build_examples(source(path=str(tmp_path / "x.xml")), tok, data_config())
    header_only = tmp_path / "rows.jsonl"
    header_only.write_text("\n")
    with pytest.raises(SetupError, match="empty|cannot read"):
        build_examples(source(path=str(header_only)), tok, data_config())


def test_shared_data_path(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTKIT_SHARED_DATA", str(tmp_path))
    assert resolve_path("../shared/data/humaneval/HumanEval.jsonl.gz") == tmp_path / "humaneval/HumanEval.jsonl.gz"
    monkeypatch.delenv("DRAFTKIT_SHARED_DATA")
    real = resolve_path("../shared/data/humaneval/HumanEval.jsonl.gz")
    assert real.name == "HumanEval.jsonl.gz" and real.parent.parent.name == "data"


def test_humaneval_prompt_set_by_path(tok):
    path = resolve_path("../shared/data/humaneval/HumanEval.jsonl.gz")
    if not path.exists():
        pytest.skip("shared data folder not present beside the repository")
    ex = build_examples(source(path="../shared/data/humaneval/HumanEval.jsonl.gz", prompt_field="prompt", limit=5),
                        tok, data_config())
    assert len(ex) == 5 and all(len(e["prompt_ids"]) > 10 for e in ex)


def test_length_checks():
    ex = [{"prompt_ids": list(range(1, 30)), "completion_ids": [5]}, {"prompt_ids": [1, 2], "completion_ids": [5]}]
    cfg = data_config(max_new_tokens=8, max_prompt_tokens=100)
    with pytest.raises(SetupError, match=r"1 of 2 prompts .* longer than 24 tokens.*truncate_prompts=true"):
        check_lengths(ex, 32, cfg)
    out = check_lengths(ex, 32, data_config(max_new_tokens=8, max_prompt_tokens=100, truncate_prompts=True))
    assert out[0]["prompt_ids"] == list(range(6, 30)) and out[1] == ex[1]
    with pytest.raises(SetupError, match="no room"):
        check_lengths(ex, 8, cfg)
    # the eval's own setting is named (it said data.max_new_tokens, a setting that was fine)
    with pytest.raises(SetupError, match=r"eval.max_new_tokens=8 leaves no room .* lower eval.max_new_tokens$"):
        check_lengths(ex, 8, cfg, "eval prompts", "eval.max_new_tokens")


def test_an_empty_prompt_is_refused_not_silently_left_out_of_training(tmp_path):
    """With a tokenizer that adds no bos token an empty prompt has no ids: the row's completion trained nothing
    (all-empty data trained nothing and exited 0), and an empty eval or on-policy prompt crashed after loading."""
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "c": 3}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    nobos = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="[UNK]")
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "completion": " b c"}) + "\n" for p in ("a", "", "a b", "")))
    with pytest.raises(SetupError, match=r"p.jsonl: 2 of 4 prompts have no tokens \(rows 2, 4: an empty"):
        build_examples(source(path=str(path), prompt_field="prompt", completion_field="completion"), nobos,
                       data_config(chat_template=False))


def test_collate_masks_prompt_and_padding():
    ex = [{"prompt_ids": [1, 5, 6], "completion_ids": [7, 8]}, {"prompt_ids": [1, 9], "completion_ids": [3]}]
    b = collate_sequences(ex, pad_id=0)
    assert b["input_ids"].tolist() == [[1, 5, 6, 7, 8], [1, 9, 3, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    # position t predicts token t+1: only positions whose next token is a completion token count
    assert b["loss_mask"].tolist() == [[0, 0, 1, 1, 0], [0, 1, 0, 0, 0]]
    assert b["labels"][b["loss_mask"].bool()].tolist() == [7, 8, 3]
    ids, att = collate_prompts([[1, 2, 3], [4]], pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]] and att.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_order_is_a_function_of_seed_epoch_and_step():
    assert epoch_order(10, 0, 1) == epoch_order(10, 0, 1) != epoch_order(10, 1, 1)
    assert sorted(epoch_order(10, 3, 1)) == list(range(10))
    seen = [i for m in range(5) for i in micro_batch_indices(10, m, 2, seed=0)]
    assert sorted(seen) == list(range(10))  # one epoch covers every example once
    assert micro_batch_indices(10, 5, 2, seed=0) == epoch_order(10, 1, 0)[:2]  # then a fresh order


def test_json_lines_may_hold_line_separators_and_a_byte_order_mark(tmp_path, tok):
    """U+2028 inside a string (json.dumps(..., ensure_ascii=False) writes it raw) split the line in the start-up
    check ("not valid JSON ... line 1"), and a UTF-8 byte-order mark made line 1 invalid; both are valid data."""
    rows = [{"prompt": "a\u2028b\u2029c\x85d\x0ce", "completion": " x"}, {"prompt": "second", "completion": " y"}]
    path = tmp_path / "u.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8-sig")
    src = source(path=str(path), kind="prompts", prompt_field="prompt", completion_field="completion")
    preflight_source(src, "data.source")
    ex = build_examples(src, tok, data_config())
    assert [e["prompt_ids"] for e in ex] == [tok(r["prompt"])["input_ids"] for r in rows]


@pytest.mark.parametrize("value,said", [([{"role": "user", "content": "hi"}], "holds a list of dict, not text .a chat"),
                                        ({"text": "hi"}, "holds dict, not text"), (True, "holds bool, not text"),
                                        ([1, 2], "holds a list of int, not text")])
def test_a_field_that_is_not_text_is_refused_not_trained_as_its_repr(tmp_path, tok, value, said):
    """A chat messages list trained on "{'role': 'user', 'content': ...}" (the first item's repr); refused before
    loading (JSON) and when the rows are read (every format). Numbers stay text (a csv column of digits)."""
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"prompt": "fine", "completion": " ok"}) + "\n"
                    + json.dumps({"prompt": value, "completion": " ok"}) + "\n")
    src = source(path=str(path), kind="prompts", prompt_field="prompt", completion_field="completion")
    with pytest.raises(SetupError, match=f"m.jsonl:2: \"prompt\" {said}"):
        preflight_source(src, "data.source")
    pq = tmp_path / "m.parquet"
    import datasets

    datasets.Dataset.from_dict({"q": ["a", "b"], "a": [{"x": 1}, {"x": 2}]}).to_parquet(str(pq))
    with pytest.raises(SetupError, match="row 1: field 'a' holds dict, not text"):
        build_examples(source(path=str(pq), prompt_field="q", completion_field="a"), tok, data_config())
    datasets.Dataset.from_dict({"q": ["a", "b"], "a": [7, 8]}).to_parquet(str(pq))
    ex = build_examples(source(path=str(pq), prompt_field="q", completion_field="a"), tok, data_config())
    assert ex[0]["completion_ids"][:-1] == tok("7", add_special_tokens=False)["input_ids"]


def test_csv_cells_are_text_as_written_and_nan_is_not_text(tmp_path, tok):
    """CSV columns went through pandas' type and missing-value guessing: "0070" trained as "70", "1.50" as "1.5",
    and a cell "None" or "NA" was refused as null. A NaN (JSON's bare NaN, a parquet float column) passed the
    start-up check and trained as "nan" (parquet) or failed after loading (JSON)."""
    import datasets

    csv = tmp_path / "c.csv"
    csv.write_text("q,a\nx,0070\ny,None\nz,NA\nv,1.50\n")
    src = source(path=str(csv), kind="prompts", prompt_field="q", completion_field="a")
    preflight_source(src, "data.source")
    ex = build_examples(src, tok, data_config(append_eos=False))
    assert [e["completion_ids"] for e in ex] == [tok(t, add_special_tokens=False)["input_ids"]
                                                 for t in ("0070", "None", "NA", "1.50")]
    js = tmp_path / "n.jsonl"
    js.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion": NaN}\n')
    with pytest.raises(SetupError, match=r'n.jsonl:2: "completion" holds nan \(a missing number\).*delete line 2'):
        preflight_source(source(path=str(js), kind="prompts", prompt_field="prompt", completion_field="completion"),
                         "data.source")
    pq = tmp_path / "n.parquet"
    datasets.Dataset.from_dict({"q": ["a", "b"], "a": [1.5, float("nan")]}).to_parquet(str(pq))
    with pytest.raises(SetupError, match=r'n.parquet, row 2: "a" holds nan \(a missing number\)'):
        preflight_source(source(path=str(pq), kind="prompts", prompt_field="q", completion_field="a"), "data.source")
