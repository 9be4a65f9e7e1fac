"""The target-logit cache read for training on a tiny pair: a cache made for another setup is refused (naming the
field), a damaged one is named, and `train` with data.target_logits=cached trains without loading the target and
matches the online run at k = V."""
import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from distill.cache_logits import build_cache
from distill.config import SetupError
from distill.logit_cache import LogitCache
from distill.recipe import train
from distill_helpers import cache_overrides, compose, overrides


def test_cached_training_without_target_equals_online_at_full_k(pair, tmp_path, monkeypatch):
    cache_dir = tmp_path / "cache"
    V = pair["vocab"]
    build_cache(compose(cache_overrides(pair, tmp_path / "c", cache_dir, V, "loss=fkl")), log=lambda *_: None)
    online = train(compose(overrides(pair, tmp_path / "online", "loss=fkl", "train.max_steps=3")),
                   log=lambda *_: None)
    import distill.recipe as recipe

    def no_target(*a, **k):
        raise AssertionError("cached mode loaded the target")

    monkeypatch.setattr(recipe, "load_target", no_target)
    lines = []
    cached = train(compose(cache_overrides(pair, tmp_path / "cached", cache_dir, V, "loss=fkl", "train.max_steps=3",
                                     "data.target_logits=cached")), log=lines.append)
    start = next(line for line in lines if line.startswith("distill: "))
    assert "no eval (cached mode)" in start and "eval prompts" not in start  # it used to count prompts never used
    assert cached["steps"] == 3 and cached["last_eval"] is None and cached["target_logits"] == "cached"
    assert cached["peak_memory_mb"] > 0
    # fp16 top-k storage is the only difference from the online fp32 loss
    assert cached["final_loss"] == pytest.approx(online["final_loss"], rel=2e-2)
    assert (tmp_path / "cached" / "step_000003" / "draft" / "config.json").exists()
    import json

    def no_constants(name):
        raise AssertionError(f"{name} is not JSON")

    train(compose(cache_overrides(pair, tmp_path / "no_c", cache_dir, V, "loss=fkl", "train.max_steps=1",
                            "data.target_logits=cached", "eval.cost_ratio=null")), log=lambda *_: None)
    state = json.loads((tmp_path / "no_c" / "step_000001" / "trainer_state.json").read_text(),
                       parse_constant=no_constants)  # no target was timed: c is null, not NaN
    assert state["cost_ratio"] is None


def test_cached_mode_bad_input_names_the_setting(pair, tmp_path):
    cache_dir = tmp_path / "cache"
    build_cache(compose(cache_overrides(pair, tmp_path / "c", cache_dir, 4)), log=lambda *_: None)
    base = ["data.target_logits=cached"]
    with pytest.raises(SetupError, match="data.on_policy_fraction"):
        train(compose(cache_overrides(pair, tmp_path / "r1", cache_dir, 4, *base, "data.on_policy_fraction=0.5")))
    with pytest.raises(SetupError, match="loss.temperature"):
        train(compose(cache_overrides(pair, tmp_path / "r2", cache_dir, 4, *base, "loss.temperature=0.5")))
    with pytest.raises(SetupError, match="data.logit_cache_k"):
        train(compose(cache_overrides(pair, tmp_path / "r3", cache_dir, 8, *base)))
    with pytest.raises(SetupError, match="data_fingerprint"):
        train(compose(cache_overrides(pair, tmp_path / "r4", cache_dir, 4, *base, "data.max_new_tokens=10")))
    with pytest.raises(SetupError, match="cache-logits"):
        train(compose(cache_overrides(pair, tmp_path / "r5", tmp_path / "nothing", 4, *base)))
    with pytest.raises(SetupError, match="data.target_logits"):
        train(compose(cache_overrides(pair, tmp_path / "r6", cache_dir, 4, "data.target_logits=maybe")))
    # cache-logits never reuses a folder made for another setup
    with pytest.raises(SetupError, match="temperature"):
        build_cache(compose(cache_overrides(pair, tmp_path / "c", cache_dir, 4, "loss.temperature=2.0")))


def test_a_copy_of_the_target_at_another_path_uses_the_cache(pair, tmp_path):
    """Found by a new user's trial: the cache records a hash of every byte of the target, yet a byte-identical copy
    at another path was refused for its path alone. A changed copy is still refused."""
    import shutil

    cache_dir = tmp_path / "cache"
    build_cache(compose(cache_overrides(pair, tmp_path / "c", cache_dir, 4)), log=lambda *_: None)
    copy = tmp_path / "copied_target"
    shutil.copytree(pair["target"], copy)
    moved = {**pair, "target": str(copy)}
    cached = ("data.target_logits=cached", "train.max_steps=1")
    assert train(compose(cache_overrides(moved, tmp_path / "r1", cache_dir, 4, *cached)), log=lambda *_: None)["steps"] == 1
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    with pytest.raises(SetupError, match=r"target \(cache .*target_hash \(cache"):
        train(compose(cache_overrides(moved, tmp_path / "r2", cache_dir, 4, *cached)), log=lambda *_: None)


def test_max_time_s_stops_with_a_checkpoint_and_the_lr_follows_time(pair, tmp_path):
    from distill.recipe import lr_lambda

    # the decay follows elapsed time when it is ahead of the step count
    assert lr_lambda(10, 2, 1000, "cosine", 0.1, time_progress=1.0) == pytest.approx(0.1)
    assert lr_lambda(10, 2, 1000, "cosine", 0.1, time_progress=0.5) == pytest.approx(0.55)
    assert lr_lambda(10, 2, 1000, "cosine", 0.1) > 0.99
    out = tmp_path / "run"
    summary = train(compose(overrides(pair, out, "train.max_steps=1000", "train.max_time_s=0.001",
                                      "train.save_every=0")), log=lambda *_: None)
    assert summary["steps"] == 1 and summary["elapsed_s"] > 0
    assert (out / "step_000001" / "trainer_state.json").exists() and summary["last_eval"] is not None
    with pytest.raises(SetupError, match="train.max_time_s"):
        train(compose(overrides(pair, tmp_path / "bad", "train.max_time_s=-1")))


def test_kept_positions_select_the_loss_mask_positions_with_logits_to_keep(pair):
    from transformers import AutoModelForCausalLM

    from distill.data import kept_positions
    from distill.recipe import kept_logits

    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 0]])
    cols, flat = kept_positions(mask)
    assert cols.tolist() == [2, 3, 4] and len(flat) == int(mask.sum())
    model = AutoModelForCausalLM.from_pretrained(str(pair["target"])).eval()
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        full = model(**batch).logits[mask.bool()]
        kept = kept_logits(SimpleNamespace(target=model, logits_to_keep={}), "target", batch, (cols, flat))
        assert torch.allclose(kept, full, atol=1e-5)
        run = SimpleNamespace(target=model, logits_to_keep={"target": False})  # a model without logits_to_keep
        assert torch.allclose(kept_logits(run, "target", batch, (cols, flat)), full, atol=1e-5)
    all_cols, all_flat = kept_positions(torch.ones(2, 3, dtype=torch.long))
    assert all_cols is None and all_flat.tolist() == list(range(6))


def test_a_damaged_or_edited_cache_is_named_before_training(pair, tmp_path):
    """A cache received from someone else whose shard or manifest was edited or damaged (ids outside the vocabulary,
    rows shorter than k per token, a non-integer manifest field) is refused naming the column or field, before
    any step (these gave an index error mid-step, a traceback)."""
    import datasets

    cache_dir = tmp_path / "cache"
    build_cache(compose(cache_overrides(pair, tmp_path / "run", cache_dir, 4)), log=lambda *_: None)
    shard = cache_dir / "shards" / "00000"
    good = tmp_path / "good_shard"
    shutil.copytree(shard, good)

    def edit_shard(change):
        ds = datasets.load_from_disk(str(good)).map(change)
        shutil.rmtree(shard)
        ds.save_to_disk(str(shard))

    edit_shard(lambda r: {"top_ids": [i + pair["vocab"] for i in r["top_ids"]]})
    with pytest.raises(SetupError, match="'top_ids' holds ids .* outside the vocabulary"):
        LogitCache(cache_dir)
    edit_shard(lambda r: {"top_log_probs": r["top_log_probs"][:-4]})
    with pytest.raises(SetupError, match="'top_log_probs' do not hold 4 values per completion token"):
        LogitCache(cache_dir)
    edit_shard(lambda r: r)
    LogitCache(cache_dir)  # the unedited shard is fine
    m = json.loads((cache_dir / "manifest.json").read_text())
    (cache_dir / "manifest.json").write_text(json.dumps({**m, "num_shards": "2"}))
    with pytest.raises(SetupError, match="num_shards='2'"):
        LogitCache(cache_dir)


