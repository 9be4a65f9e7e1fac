"""The target-logit cache end to end on a tiny pair: cache-logits writes Arrow shards + manifest that agree with
a fresh target forward, resumes, refuses a cache made for another setup (naming the field), and `train` with
data.target_logits=cached trains without loading the target and matches the online run at k = V."""
import json
import math
import shutil
import subprocess
from types import SimpleNamespace

import pytest
import torch

from distill.cache_logits import build_cache
from distill.logit_cache import LogitCache, read_manifest
from distill.config import SetupError
from distill.recipe import train
from distill_helpers import PY, REPO, compose, overrides, subprocess_env


def _cache_ov(pair, out, cache, k=8, *extra):
    return overrides(pair, out, f"data.logit_cache={cache}", f"data.logit_cache_k={k}",
                     "data.logit_cache_shard_size=16", *extra)


def test_cache_matches_a_fresh_target_forward_and_resumes(pair, tmp_path):
    from distill.data import collate_sequences
    from distill.losses import topk_buckets
    from transformers import AutoModelForCausalLM

    cache_dir = tmp_path / "cache"
    summary = build_cache(compose(_cache_ov(pair, tmp_path / "run", cache_dir, 8)), log=lambda *_: None)
    manifest = read_manifest(cache_dir)
    assert manifest["k"] == 8 and manifest["complete"] and manifest["num_shards"] == len(
        list((cache_dir / "shards").iterdir()))
    assert manifest["target_revision"] is None  # a local folder; a hub id's snapshot commit (decode.loading)
    assert summary["tokens"] > 0 and summary["bytes_per_token"] > 0
    cache = LogitCache(cache_dir)
    examples = cache.examples()
    target = AutoModelForCausalLM.from_pretrained(str(pair["target"])).eval()
    rows = examples[3:6]
    batch = collate_sequences(rows, 0)
    with torch.no_grad():
        logits = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    top, ids, tail = topk_buckets(logits[batch["loss_mask"].bool()][..., :pair["vocab"]], 8)
    log_p, got_ids, tail_ids = cache.buckets([3, 4, 5])
    assert tail_ids is None  # built without tail samples
    assert torch.equal(got_ids, ids)
    assert torch.allclose(log_p[:, :8], top, atol=1e-2)  # fp16 storage
    assert torch.allclose(log_p[:, 8], tail, rtol=1e-5, atol=1e-5)
    # resume: a removed shard is rebuilt, the others are kept as they are
    kept = (cache_dir / "shards" / "00000" / "dataset_info.json").stat().st_mtime_ns
    shutil.rmtree(cache_dir / "shards" / "00001")
    m = json.loads((cache_dir / "manifest.json").read_text())
    m["complete"] = False
    (cache_dir / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SetupError, match=rf"incomplete \({m['num_shards'] - 1} of {m['num_shards']} shards\)"):
        LogitCache(cache_dir)  # (it said "? of N")
    with pytest.raises(SetupError, match="data.logit_cache_shard_size=16"):
        build_cache(compose(_cache_ov(pair, tmp_path / "run", cache_dir, 8, "data.logit_cache_shard_size=8")))
    build_cache(compose(_cache_ov(pair, tmp_path / "run", cache_dir, 8)), log=lambda *_: None)
    assert (cache_dir / "shards" / "00001" / "dataset_info.json").exists()
    assert (cache_dir / "shards" / "00000" / "dataset_info.json").stat().st_mtime_ns == kept
    assert torch.equal(LogitCache(cache_dir).buckets([20])[1], cache.buckets([20])[1])


def test_cached_training_without_target_equals_online_at_full_k(pair, tmp_path, monkeypatch):
    cache_dir = tmp_path / "cache"
    V = pair["vocab"]
    build_cache(compose(_cache_ov(pair, tmp_path / "c", cache_dir, V, "loss=fkl")), log=lambda *_: None)
    online = train(compose(overrides(pair, tmp_path / "online", "loss=fkl", "train.max_steps=3")),
                   log=lambda *_: None)
    import distill.recipe as recipe

    def no_target(*a, **k):
        raise AssertionError("cached mode loaded the target")

    monkeypatch.setattr(recipe, "load_target", no_target)
    lines = []
    cached = train(compose(_cache_ov(pair, tmp_path / "cached", cache_dir, V, "loss=fkl", "train.max_steps=3",
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

    train(compose(_cache_ov(pair, tmp_path / "no_c", cache_dir, V, "loss=fkl", "train.max_steps=1",
                            "data.target_logits=cached", "eval.cost_ratio=null")), log=lambda *_: None)
    state = json.loads((tmp_path / "no_c" / "step_000001" / "trainer_state.json").read_text(),
                       parse_constant=no_constants)  # no target was timed: c is null, not NaN
    assert state["cost_ratio"] is None


def test_cached_mode_bad_input_names_the_setting(pair, tmp_path):
    cache_dir = tmp_path / "cache"
    build_cache(compose(_cache_ov(pair, tmp_path / "c", cache_dir, 4)), log=lambda *_: None)
    base = ["data.target_logits=cached"]
    with pytest.raises(SetupError, match="data.on_policy_fraction"):
        train(compose(_cache_ov(pair, tmp_path / "r1", cache_dir, 4, *base, "data.on_policy_fraction=0.5")))
    with pytest.raises(SetupError, match="loss.temperature"):
        train(compose(_cache_ov(pair, tmp_path / "r2", cache_dir, 4, *base, "loss.temperature=0.5")))
    with pytest.raises(SetupError, match="data.logit_cache_k"):
        train(compose(_cache_ov(pair, tmp_path / "r3", cache_dir, 8, *base)))
    with pytest.raises(SetupError, match="data_fingerprint"):
        train(compose(_cache_ov(pair, tmp_path / "r4", cache_dir, 4, *base, "data.max_new_tokens=10")))
    with pytest.raises(SetupError, match="cache-logits"):
        train(compose(_cache_ov(pair, tmp_path / "r5", tmp_path / "nothing", 4, *base)))
    with pytest.raises(SetupError, match="data.target_logits"):
        train(compose(_cache_ov(pair, tmp_path / "r6", cache_dir, 4, "data.target_logits=maybe")))
    # cache-logits never reuses a folder made for another setup
    with pytest.raises(SetupError, match="temperature"):
        build_cache(compose(_cache_ov(pair, tmp_path / "c", cache_dir, 4, "loss.temperature=2.0")))


def test_a_copy_of_the_target_at_another_path_uses_the_cache(pair, tmp_path):
    """Found by a new user's trial: the cache records a hash of every byte of the target, yet a byte-identical copy
    at another path was refused for its path alone. A changed copy is still refused."""
    import shutil

    cache_dir = tmp_path / "cache"
    build_cache(compose(_cache_ov(pair, tmp_path / "c", cache_dir, 4)), log=lambda *_: None)
    copy = tmp_path / "copied_target"
    shutil.copytree(pair["target"], copy)
    moved = {**pair, "target": str(copy)}
    cached = ("data.target_logits=cached", "train.max_steps=1")
    assert train(compose(_cache_ov(moved, tmp_path / "r1", cache_dir, 4, *cached)), log=lambda *_: None)["steps"] == 1
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    with pytest.raises(SetupError, match=r"target \(cache .*target_hash \(cache"):
        train(compose(_cache_ov(moved, tmp_path / "r2", cache_dir, 4, *cached)), log=lambda *_: None)


def test_cache_logits_cli_under_two_processes(pair, tmp_path):
    cache_dir = tmp_path / "cache"
    cmd = ["accelerate", "launch", "--config_file", str(REPO / "conf/launcher/cpu_2proc.yaml"), "-m", "distill",
           "cache-logits", *_cache_ov(pair, tmp_path / "run", cache_dir, 4)]
    r = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout[r.stdout.index("{"):])
    manifest = read_manifest(cache_dir)
    assert manifest["num_shards"] >= 2 and summary["rows"] == manifest["num_examples"]
    cache = LogitCache(cache_dir)
    assert len(cache.examples()) == manifest["num_examples"]
    assert math.isfinite(float(cache.buckets([0, manifest["num_examples"] - 1])[0].sum()))
    bad = subprocess.run([PY, "-m", "distill", "cache-logits", *overrides(pair, tmp_path / "r")], cwd=REPO,
                         env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "data.logit_cache" in bad.stderr


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


def test_bench_step_cli_writes_json_and_never_overwrites(pair, tmp_path):
    out = tmp_path / "bench.json"
    cmd = [PY, "-m", "distill", "bench-step", "--steps", "1", "--warmup", "0", "--out", str(out),
           *overrides(pair, tmp_path / "run")]
    r = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"recipe_step", "target_forward", "draft_forward_backward_optimizer", "collate",
            "divergence_forward_backward", "recipe_step_full_logits", "recipe_step_other_loss_form"} <= set(
        result["median_ms"])
    assert result["loss_form"] == "fused" and result["other_loss_form"] == "autograd"
    assert result["efficiency_other_loss_form"] > 0 and "with the autograd loss" in r.stdout
    assert result["bound_ms"] == pytest.approx(result["median_ms"]["target_forward"] +
                                               result["median_ms"]["draft_forward_backward_optimizer"])
    assert "bound / recipe step" in r.stdout
    again = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "exists" in again.stderr


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


def test_cache_logits_never_writes_into_a_folder_that_is_not_a_cache(pair, tmp_path):
    """A run folder, a model folder or a checkpoint given as data.logit_cache is refused with nothing written; a
    checkpoint's manifest.json is named as not a cache's, by cache-logits and by train (no KeyError traceback)."""
    run = tmp_path / "run"
    train(compose(overrides(pair, run, "train.max_steps=2")), log=lambda *_: None)
    for folder in (run, pair["draft"]):
        before = sorted(p.name for p in folder.iterdir())
        with pytest.raises(SetupError, match="holds other files"):
            build_cache(compose(_cache_ov(pair, tmp_path / "r", folder, 4)), log=lambda *_: None)
        assert sorted(p.name for p in folder.iterdir()) == before
    step = run / "step_000002"
    manifest = (step / "manifest.json").read_text()
    with pytest.raises(SetupError, match="is not a logit cache"):
        build_cache(compose(_cache_ov(pair, tmp_path / "r", step, 4)), log=lambda *_: None)
    with pytest.raises(SetupError, match="is not a logit cache"):
        train(compose(_cache_ov(pair, tmp_path / "r", step, 4, "data.target_logits=cached")), log=lambda *_: None)
    assert (step / "manifest.json").read_text() == manifest and not (step / "shards").exists()
    r = subprocess.run([PY, "-m", "distill", "train", *_cache_ov(pair, tmp_path / "r", step, 4,
                                                                 "data.target_logits=cached")],
                       cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "is not a logit cache" in r.stderr and "Traceback" not in r.stderr


def test_bench_step_writes_nothing_into_the_run_folder(pair, tmp_path):
    """bench-step of a LoRA run on a built draft (whose base setup saves) leaves train.output_dir alone, so the
    train that follows with the same overrides is not refused."""
    from distill.bench_step import bench_step

    run = tmp_path / "run"
    ov = overrides(pair, run, "draft.name_or_path=null", "draft.num_hidden_layers=1", "train.lora.enabled=true",
                   "train.lora.target_modules=[q_proj,v_proj]")
    bench_step(compose(ov), steps=1, warmup=0, log=lambda *_: None)
    assert not run.exists()
    assert train(compose(ov), log=lambda *_: None)["steps"] == 4


def test_a_damaged_or_edited_cache_is_named_before_training(pair, tmp_path):
    """A cache received from someone else whose shard or manifest was edited or damaged (ids outside the vocabulary,
    rows shorter than k per token, a non-integer manifest field) is refused naming the column or field, before
    any step (these gave an index error mid-step, a traceback)."""
    import datasets

    cache_dir = tmp_path / "cache"
    build_cache(compose(_cache_ov(pair, tmp_path / "run", cache_dir, 4)), log=lambda *_: None)
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


def test_a_shard_deleted_from_a_complete_cache_is_written_again(pair, tmp_path):
    """LogitCache's message on a missing or damaged shard says to delete it and rerun cache-logits; the rerun said
    'complete; nothing to do' (the manifest is complete), so train and cache-logits sent the user in a circle."""
    cache_dir = tmp_path / "cache"
    build_cache(compose(_cache_ov(pair, tmp_path / "run", cache_dir, 4)), log=lambda *_: None)
    before = LogitCache(cache_dir).buckets([20])[1]
    kept = (cache_dir / "shards" / "00000" / "dataset_info.json").stat().st_mtime_ns
    shutil.rmtree(cache_dir / "shards" / "00001")
    with pytest.raises(SetupError, match=r"lacks shards \['00001'\]; rerun python -m distill cache-logits"):
        LogitCache(cache_dir)
    lines = []
    build_cache(compose(_cache_ov(pair, tmp_path / "run", cache_dir, 4)), log=lines.append)
    assert any("lacks shards ['00001']; writing them again" in line for line in lines)
    assert (cache_dir / "shards" / "00000" / "dataset_info.json").stat().st_mtime_ns == kept
    assert read_manifest(cache_dir)["complete"] and torch.equal(LogitCache(cache_dir).buckets([20])[1], before)


def test_a_full_disk_while_writing_a_shard_is_named_and_the_rerun_finishes(pair, tmp_path, monkeypatch):
    """A full disk mid-shard was a traceback that left the partial NNNNN.tmp holding the space the rerun needed."""
    import errno

    import datasets

    cache_dir = tmp_path / "cache"
    real = datasets.Dataset.save_to_disk

    def disk_full(self, path, *a, **k):
        if path.endswith("00001.tmp"):
            real(self.select(range(1)), path, *a, **k)  # what fitted before the disk filled
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, path, *a, **k)

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", disk_full)
    with pytest.raises(SetupError, match=r"could not write logit cache shard .*00001 .*No space left on device.*"
                                         r"shards finished before it are kept.*rerun python -m distill cache-logits"):
        build_cache(compose(_cache_ov(pair, tmp_path / "run", cache_dir, 4)), log=lambda *_: None)
    assert sorted(p.name for p in (cache_dir / "shards").iterdir()) == ["00000"]
    monkeypatch.setattr(datasets.Dataset, "save_to_disk", real)
    build_cache(compose(_cache_ov(pair, tmp_path / "run", cache_dir, 4)), log=lambda *_: None)
    assert read_manifest(cache_dir)["complete"] and len(LogitCache(cache_dir).examples()) > 16
