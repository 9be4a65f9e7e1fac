"""The pretrain resume snapshot and token cache are data: a crafted pickle in any file the loader reads is refused
with an error naming the file, and its payload never runs (a marker file it would create stays absent); a snapshot
of the earlier pickle layout is refused unread."""
import shutil

import pytest
import torch

from tests.pickle_payload import fix_manifest as _fix_manifest, plant as _plant


def test_the_payload_runs_when_unpickled(tmp_path):
    """The test pickle is live: loading it with pickle enabled creates the marker (so the tests below can fail)."""
    marker = tmp_path / "marker"
    _plant(tmp_path / "x.pt", marker)
    torch.load(tmp_path / "x.pt", weights_only=False)
    assert marker.exists()


def _pretrain_cfg(tmp_path, **kw):
    from quickstart.pretrain import PretrainConfig

    base = dict(out=str(tmp_path / "model"), tokenizer=str(tmp_path / "tok"), size="smoke_draft",
                corpus="tinyshakespeare", vocab_size=300, seq_len=32, batch_size=4, budget_s=0, max_steps=2,
                lr=3e-3, val_tokens=256, device="cpu")
    base.update(kw)
    return PretrainConfig(**base)


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    """A pretrain resume snapshot (and the tokenizer it needs)."""
    import quickstart.pretrain as pt

    root = tmp_path_factory.mktemp("pre")
    cfg = _pretrain_cfg(root)
    tok = pt.load_or_train_tokenizer(cfg, log=lambda *_: None)
    model = pt.build_model(cfg.size, tok, cfg.max_position_embeddings)
    opt = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.ndim >= 2]},  # pretrain's groups
                             {"params": [p for p in model.parameters() if p.ndim < 2]}], lr=1e-3)
    model(input_ids=torch.tensor([[1, 5, 6]])).logits.sum().backward()
    opt.step()
    pt.save_resume(root / "snap", model, opt, torch.Generator().manual_seed(0), {"step": 1, "elapsed_s": 0.5,
                                                                                  "tokens_seen": 128})
    return root


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors", "optimizer.json",
                                  "generator.safetensors", "state.json", "manifest.json"])
def test_pretrain_resume_snapshot_refuses_a_pickle(snapshot, tmp_path, name):
    import quickstart.pretrain as pt

    cfg = _pretrain_cfg(tmp_path, tokenizer=str(snapshot / "tok"))
    shutil.copytree(snapshot / "snap", tmp_path / "model" / pt.RESUME_DIR)
    marker = tmp_path / "marker"
    _plant(tmp_path / "model" / pt.RESUME_DIR / name, marker)
    _fix_manifest(tmp_path / "model" / pt.RESUME_DIR)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        pt.pretrain(cfg, log=lambda *_: None)
    assert not marker.exists()


def test_pretrain_resumes_from_a_clean_snapshot(snapshot, tmp_path):
    import quickstart.pretrain as pt

    cfg = _pretrain_cfg(tmp_path, tokenizer=str(snapshot / "tok"))
    shutil.copytree(snapshot / "snap", tmp_path / "model" / pt.RESUME_DIR)
    logs = []
    result = pt.pretrain(cfg, log=logs.append)
    assert any("resuming" in m and "step 1" in m for m in logs) and result["steps"] == 2


def test_pretrain_earlier_resume_pickle_is_refused_unread(snapshot, tmp_path):
    import quickstart.pretrain as pt

    cfg = _pretrain_cfg(tmp_path, tokenizer=str(snapshot / "tok"))
    (tmp_path / "model").mkdir()
    marker = tmp_path / "marker"
    _plant(tmp_path / "model" / pt.LEGACY_RESUME_FILE, marker)
    with pytest.raises(ValueError, match="resume.pt is not a resume snapshot of this draftkit version.*never "
                                         "unpickled"):
        pt.pretrain(cfg, log=lambda *_: None)
    assert not marker.exists()


def test_pretrain_token_cache_is_safetensors_and_a_pickle_is_never_loaded(snapshot, tmp_path):
    import quickstart.pretrain as pt

    tok = pt.load_or_train_tokenizer(_pretrain_cfg(snapshot))
    cache = tmp_path / "cache"
    cache.mkdir()
    marker = tmp_path / "marker"
    _plant(cache / "tokens-tinyshakespeare-validation.pt", marker)  # the earlier cache name: ignored
    ids = pt.token_stream(tok, "tinyshakespeare", "validation", cache)
    assert (cache / "tokens-tinyshakespeare-validation.safetensors").is_file() and not marker.exists()
    assert torch.equal(pt.token_stream(tok, "tinyshakespeare", "validation", cache), ids)  # read back from cache
    _plant(cache / "tokens-tinyshakespeare-validation.safetensors", marker)
    with pytest.raises(ValueError, match="token cache .* is not a safetensors file"):
        pt.token_stream(tok, "tinyshakespeare", "validation", cache)
    assert not marker.exists()
