"""cache-logits end to end on a tiny pair: Arrow shards + manifest that agree with a fresh target forward, resume,
two processes, never writing into a folder that is not a cache, and a full disk named."""
import json
import math
import shutil
import subprocess

import pytest
import torch

from distill.cache_logits import build_cache
from distill.config import SetupError
from distill.logit_cache import LogitCache, read_manifest
from distill.recipe import train
from distill_helpers import PY, REPO, cache_overrides, compose, overrides, subprocess_env


def test_cache_matches_a_fresh_target_forward_and_resumes(pair, tmp_path):
    from distill.data import collate_sequences
    from distill.losses import topk_buckets
    from transformers import AutoModelForCausalLM

    cache_dir = tmp_path / "cache"
    summary = build_cache(compose(cache_overrides(pair, tmp_path / "run", cache_dir, 8)), log=lambda *_: None)
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
        build_cache(compose(cache_overrides(pair, tmp_path / "run", cache_dir, 8, "data.logit_cache_shard_size=8")))
    build_cache(compose(cache_overrides(pair, tmp_path / "run", cache_dir, 8)), log=lambda *_: None)
    assert (cache_dir / "shards" / "00001" / "dataset_info.json").exists()
    assert (cache_dir / "shards" / "00000" / "dataset_info.json").stat().st_mtime_ns == kept
    assert torch.equal(LogitCache(cache_dir).buckets([20])[1], cache.buckets([20])[1])


def test_cache_logits_cli_under_two_processes(pair, tmp_path):
    cache_dir = tmp_path / "cache"
    cmd = ["accelerate", "launch", "--config_file", str(REPO / "conf/launcher/cpu_2proc.yaml"), "-m", "distill",
           "cache-logits", *cache_overrides(pair, tmp_path / "run", cache_dir, 4)]
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


def test_cache_logits_never_writes_into_a_folder_that_is_not_a_cache(pair, tmp_path):
    """A run folder, a model folder or a checkpoint given as data.logit_cache is refused with nothing written; a
    checkpoint's manifest.json is named as not a cache's, by cache-logits and by train (no KeyError traceback)."""
    run = tmp_path / "run"
    train(compose(overrides(pair, run, "train.max_steps=2")), log=lambda *_: None)
    for folder in (run, pair["draft"]):
        before = sorted(p.name for p in folder.iterdir())
        with pytest.raises(SetupError, match="holds other files"):
            build_cache(compose(cache_overrides(pair, tmp_path / "r", folder, 4)), log=lambda *_: None)
        assert sorted(p.name for p in folder.iterdir()) == before
    step = run / "step_000002"
    manifest = (step / "manifest.json").read_text()
    with pytest.raises(SetupError, match="is not a logit cache"):
        build_cache(compose(cache_overrides(pair, tmp_path / "r", step, 4)), log=lambda *_: None)
    with pytest.raises(SetupError, match="is not a logit cache"):
        train(compose(cache_overrides(pair, tmp_path / "r", step, 4, "data.target_logits=cached")), log=lambda *_: None)
    assert (step / "manifest.json").read_text() == manifest and not (step / "shards").exists()
    r = subprocess.run([PY, "-m", "distill", "train", *cache_overrides(pair, tmp_path / "r", step, 4,
                                                                 "data.target_logits=cached")],
                       cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "is not a logit cache" in r.stderr and "Traceback" not in r.stderr


def test_a_shard_deleted_from_a_complete_cache_is_written_again(pair, tmp_path):
    """LogitCache's message on a missing or damaged shard says to delete it and rerun cache-logits; the rerun said
    'complete; nothing to do' (the manifest is complete), so train and cache-logits sent the user in a circle."""
    cache_dir = tmp_path / "cache"
    build_cache(compose(cache_overrides(pair, tmp_path / "run", cache_dir, 4)), log=lambda *_: None)
    before = LogitCache(cache_dir).buckets([20])[1]
    kept = (cache_dir / "shards" / "00000" / "dataset_info.json").stat().st_mtime_ns
    shutil.rmtree(cache_dir / "shards" / "00001")
    with pytest.raises(SetupError, match=r"lacks shards \['00001'\]; rerun python -m distill cache-logits"):
        LogitCache(cache_dir)
    lines = []
    build_cache(compose(cache_overrides(pair, tmp_path / "run", cache_dir, 4)), log=lines.append)
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
        build_cache(compose(cache_overrides(pair, tmp_path / "run", cache_dir, 4)), log=lambda *_: None)
    assert sorted(p.name for p in (cache_dir / "shards").iterdir()) == ["00000"]
    monkeypatch.setattr(datasets.Dataset, "save_to_disk", real)
    build_cache(compose(cache_overrides(pair, tmp_path / "run", cache_dir, 4)), log=lambda *_: None)
    assert read_manifest(cache_dir)["complete"] and len(LogitCache(cache_dir).examples()) > 16
