"""Target-generated completions (sequence-level KD): resumable shards, refusals naming the changed setting, damage."""
import json
import os

import pytest
import torch

from distill.config import SetupError
from distill.data import build_examples
from distill.target_data import cache_key, generate_target_data, target_data_settings
from distill_helpers import data_config, source
from tests.conftest import full_disk_for


def test_target_generated_cache_is_resumable(pair, tok, tmp_path):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(pair["target"])).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(pair["draft"])).eval()
    ex = build_examples(source(path=str(pair["data"]), prompt_field="prompt", limit=6), tok, data_config())
    kw = dict(temperature=1.0, max_new_tokens=6, batch_size=2, shard_size=2, seed=3)
    full = generate_target_data(target, tok, ex, tmp_path / "a", "k1", **kw)
    assert len(full) == 6 and all(1 <= len(c) <= 6 for c in full["completion_ids"])
    assert full["prompt_ids"] == [e["prompt_ids"] for e in ex]
    # an interrupted run: one shard missing, the final dataset not written yet
    import shutil

    shutil.rmtree(tmp_path / "a" / "shards" / "00001")
    shutil.rmtree(tmp_path / "a" / "dataset")
    (tmp_path / "a" / "meta.json").write_text(json.dumps({"key": "k1", "complete": False}))
    calls = []
    again = generate_target_data(target, tok, ex, tmp_path / "a", "k1", progress=lambda i, n: calls.append(i), **kw)
    assert calls == [2] and again["completion_ids"] == full["completion_ids"]
    # with the draft drafting speculatively: same prompts, valid completions (lossless: same distribution)
    spec = generate_target_data(target, tok, ex, tmp_path / "b", "k1", draft=draft, **{**kw, "temperature": 0.0})
    greedy = generate_target_data(target, tok, ex, tmp_path / "c", "k1", **{**kw, "temperature": 0.0})
    assert spec["completion_ids"] == greedy["completion_ids"]  # greedy: speculative output is token-identical
    with pytest.raises(SetupError, match="made for other settings"):
        generate_target_data(target, tok, ex, tmp_path / "a", "other-key", **kw)
    assert torch.is_grad_enabled()


def test_a_target_data_cache_made_with_other_settings_is_refused_naming_them(pair, tok, tmp_path):
    """generate-data resumed with another data.target_generated.shard_size concatenated shards of both sizes (68 rows
    for 56 prompts), marked the cache complete and trained on it; a cache made by a float32 target was reused by a
    bf16 one; and every refusal said only "the target's path or weights, the prompts, ... changed"."""
    import shutil

    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(pair["target"])).eval()
    ex = build_examples(source(path=str(pair["data"]), prompt_field="prompt", limit=6), tok, data_config())
    folder = tmp_path / "cache"

    def run(shard_size=4, dtype="float32", max_new_tokens=4, name=str(pair["target"])):
        gen = {"temperature": 1.0, "max_new_tokens": max_new_tokens, "seed": 3, "shard_size": shard_size}
        settings = target_data_settings(name, dtype, ex, gen)
        return generate_target_data(target, tok, ex, folder, cache_key(settings), temperature=1.0,
                                    max_new_tokens=max_new_tokens, batch_size=2, shard_size=shard_size, seed=3,
                                    settings=settings)

    full = run()
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "complete": False}))  # interrupted after its first shard
    shutil.rmtree(folder / "shards" / "00001")
    shutil.rmtree(folder / "dataset")
    with pytest.raises(SetupError, match=r"shard_size \(cache 4, config 2; set by data.target_generated.shard_size\)"):
        run(shard_size=2)
    assert sorted(p.name for p in (folder / "shards").iterdir()) == ["00000"]  # nothing written by the refused run
    with pytest.raises(SetupError, match=r"target_dtype \(cache 'float32', config 'bfloat16'; set by target.dtype\)"):
        run(dtype="bfloat16")
    with pytest.raises(SetupError, match=r"max_new_tokens \(cache 4, config 5; set by data.max_new_tokens\)"):
        run(max_new_tokens=5)
    relative = os.path.relpath(pair["target"])  # the same target spelled relative to the working folder
    assert run(name=relative)["completion_ids"] == full["completion_ids"]
    (folder / "meta.json").write_text(json.dumps({"key": "0123", "complete": True, "num_prompts": 6}))
    with pytest.raises(SetupError, match="records no settings .* Delete it to regenerate"):  # an older cache's
        run()


def test_a_damaged_target_data_cache_is_named_not_used(pair, tok, tmp_path):
    """A finished cache from someone else or edited by hand: a truncated meta.json raised a JSONDecodeError
    traceback, ids outside the vocabulary an IndexError mid-step, and a dataset cut to fewer rows trained on those
    rows without a word."""
    import shutil

    import datasets
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(pair["target"])).eval()
    ex = build_examples(source(path=str(pair["data"]), prompt_field="prompt", limit=4), tok, data_config())
    kw = dict(temperature=1.0, max_new_tokens=4, batch_size=2, shard_size=2, seed=3)
    good = tmp_path / "good"
    full = generate_target_data(target, tok, ex, good, "k1", **kw)
    vocab = target.get_output_embeddings().weight.shape[0]

    def damaged(name, edit):
        folder = tmp_path / name
        shutil.copytree(good, folder)
        edit(folder)
        return folder

    def rewrite(rows):
        def edit(folder):
            shutil.rmtree(folder / "dataset")
            datasets.Dataset.from_dict(rows).save_to_disk(str(folder / "dataset"))
        return edit

    cases = {
        "truncated meta": (lambda f: (f / "meta.json").write_text('{"key": "k1", "comp'), "not a JSON object"),
        "fewer rows": (rewrite(full[:2]), "holds 2 rows"),
        "ids out of range": (rewrite({"prompt_ids": full["prompt_ids"],
                                      "completion_ids": [[c[0] + vocab] + c[1:] for c in full["completion_ids"]]}),
                             "outside the vocabulary"),
    }
    for name, (edit, message) in cases.items():
        with pytest.raises(SetupError, match=message):
            generate_target_data(target, tok, ex, damaged(name.replace(" ", "_"), edit), "k1", **kw)
    assert generate_target_data(target, tok, ex, good, "k1", **kw)["completion_ids"] == full["completion_ids"]


def test_a_full_disk_while_marking_the_target_data_cache_complete_keeps_its_shards(pair, tok, tmp_path, monkeypatch):
    """meta.json was rewritten in place: a full disk (or a kill) while writing it left it empty, and the rerun
    called the cache damaged and said to delete it, generated shards and all."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(pair["target"])).eval()
    ex = build_examples(source(path=str(pair["data"]), prompt_field="prompt", limit=4), tok, data_config())
    kw = dict(temperature=1.0, max_new_tokens=4, batch_size=2, shard_size=2, seed=3)
    restore = full_disk_for(monkeypatch, '"complete": true')
    with pytest.raises(OSError, match="No space left"):
        generate_target_data(target, tok, ex, tmp_path / "a", "k1", **kw)
    restore()
    shards = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "a" / "shards").iterdir()}
    assert sorted(shards) == ["00000", "00001"]
    calls = []
    full = generate_target_data(target, tok, ex, tmp_path / "a", "k1", progress=lambda i, n: calls.append(i), **kw)
    assert len(full) == 4 and calls == []  # nothing generated again
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "a" / "shards").iterdir()} == shards
    assert json.loads((tmp_path / "a" / "meta.json").read_text())["complete"]


def test_bf16_autocast_generation_is_recorded_and_a_change_of_it_named(pair, tok, tmp_path):
    """train.mixed_precision=bf16: the target generates under bf16 autocast (as the recipe trains and caches logits),
    the cache records it, and the same folder asked for with full precision is refused naming the setting."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from distill.target_data import prepare_target_data

    target = AutoModelForCausalLM.from_pretrained(str(pair["target"])).eval()
    ex = build_examples(source(path=str(pair["data"]), prompt_field="prompt", limit=4), tok, data_config())

    def cfg(precision):
        return OmegaConf.create({
            "target": {"name_or_path": str(pair["target"])}, "train": {"seed": 0, "mixed_precision": precision,
                                                                      "output_dir": str(tmp_path / "run")},
            "data": {"max_new_tokens": 4, "target_generated": {"path": str(tmp_path / "td"), "temperature": 0.0,
                                                                "batch_size": 2, "shard_size": 2, "use_draft": False}}})

    rows = prepare_target_data(cfg("bf16"), target, None, tok, ex, log=lambda *_: None)
    assert len(rows) == 4 and all(1 <= len(r["completion_ids"]) <= 4 for r in rows)
    meta = json.loads((tmp_path / "td" / "meta.json").read_text())
    assert meta["complete"] and meta["settings"]["precision"] == "bf16"
    with pytest.raises(SetupError, match="train.mixed_precision"):
        prepare_target_data(cfg("no"), target, None, tok, ex, log=lambda *_: None)
    assert not torch.is_autocast_enabled("cpu")
