"""quickstart.pretrain: tokenizer, budgeted LR schedule, training, caching and exact resume on a tiny model."""
from __future__ import annotations

import json
import math

import pytest
import torch

from quickstart import pretrain as pt
from quickstart.pretrain import PretrainConfig, lr_at, train_tokenizer
from tests.conftest import full_disk_for

TEXTS = ["def add(a, b):\n    return a + b\n", "class A:\n    def m(self):\n        return self.x\n"] * 50


def test_tokenizer_roundtrips_through_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    train_tokenizer(TEXTS, 300, tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert 259 < len(tok) <= 300  # merges stop early when pairs run out on this tiny text
    text = "def add(a, b):\n    return a + b  # ünïcode never seen"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    with pytest.raises(ValueError, match="259"):
        train_tokenizer(TEXTS, 100, tmp_path / "bad")


def test_lr_follows_the_budget_fraction():
    cfg = PretrainConfig(out="", tokenizer="", lr=1.0, warmup_frac=0.1, min_lr_ratio=0.1)
    assert lr_at(0.05, cfg) == pytest.approx(0.5)
    assert lr_at(0.1, cfg) == pytest.approx(1.0)
    assert lr_at(1.0, cfg) == pytest.approx(0.1)
    after = [lr_at(p / 100, cfg) for p in range(10, 101)]
    assert all(a >= b for a, b in zip(after, after[1:]))
    assert lr_at(0.55, cfg) == pytest.approx(0.55)  # cosine midpoint: (1 + 0.1) / 2


def _cfg(tmp_path, **kw):
    base = dict(out=str(tmp_path / "model"), tokenizer=str(tmp_path / "tok"), size="smoke_draft",
                corpus="tinyshakespeare", vocab_size=300, seq_len=32, batch_size=4, budget_s=0, max_steps=30,
                lr=3e-3, val_tokens=2048, device="cpu")
    base.update(kw)
    return PretrainConfig(**base)


def test_pretrain_learns_saves_and_is_reused(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logs = []
    result = pt.pretrain(_cfg(tmp_path), log=logs.append)
    out = tmp_path / "model"
    saved = json.loads((out / "pretrain.json").read_text())
    assert saved["val_loss"] == pytest.approx(result["val_loss"])
    assert saved["steps"] == 30 and saved["tokens_seen"] == 30 * 4 * 32
    # an untrained model scores ~ln(300) = 5.7 nats; 30 steps must learn character statistics
    assert result["val_loss"] < math.log(300) - 1.0
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert sum(p.numel() for p in model.parameters()) == result["params"]
    assert model.config.eos_token_id == AutoTokenizer.from_pretrained(str(out)).eos_token_id
    assert not (out / pt.RESUME_DIR).exists()

    mtime = (out / "model.safetensors").stat().st_mtime_ns
    again = pt.pretrain(_cfg(tmp_path), log=logs.append)
    assert again["val_loss"] == result["val_loss"] and (out / "model.safetensors").stat().st_mtime_ns == mtime
    assert "reusing" in logs[-1]
    with pytest.raises(ValueError, match="--force"):
        pt.pretrain(_cfg(tmp_path, size="smoke_target"))


def crash_pretrain_at(cfg, call: int, monkeypatch) -> None:
    """Run ``pt.pretrain(cfg)`` until its ``call``-th batch raises KeyboardInterrupt (a kill mid-run)."""
    real, calls = pt.sample_batch, {"n": 0}

    def crash(*a, **k):
        calls["n"] += 1
        if calls["n"] == call:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(pt, "sample_batch", crash)
    with pytest.raises(KeyboardInterrupt):
        pt.pretrain(cfg, log=lambda *_: None)
    monkeypatch.setattr(pt, "sample_batch", real)


def test_interrupted_run_resumes_exactly(tmp_path, monkeypatch):
    straight = pt.pretrain(_cfg(tmp_path / "a", max_steps=6, save_every_s=0.0), log=lambda *_: None)

    cfg = _cfg(tmp_path / "b", max_steps=6, save_every_s=0.0)
    crash_pretrain_at(cfg, 4, monkeypatch)
    assert json.loads((tmp_path / "b" / "model" / pt.RESUME_DIR / "state.json").read_text())["step"] == 3
    resumed = pt.pretrain(cfg, log=lambda *_: None)
    assert resumed["steps"] == 6 and resumed["val_loss"] == straight["val_loss"]

    from safetensors.torch import load_file
    a = load_file(str(tmp_path / "a" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "model" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bad_settings_fail_before_training(tmp_path):
    with pytest.raises(ValueError, match="unknown size"):
        pt.pretrain(_cfg(tmp_path, size="huge"))
    with pytest.raises(ValueError, match="unknown corpus"):
        pt.pretrain(_cfg(tmp_path, corpus="wiki"))
    with pytest.raises(ValueError, match="--budget-s"):
        pt.pretrain(_cfg(tmp_path, max_steps=None, budget_s=0))


def test_a_tokenizer_save_cut_short_leaves_nothing_that_reads_as_done(tmp_path, monkeypatch):
    """save_pretrained wrote straight into the folder whose tokenizer.json marks the phase done: a full disk left a
    truncated one that every rerun reused ("tokenizer: reusing") and then failed on with a bare JSON error."""
    import errno

    from transformers import PreTrainedTokenizerFast

    real = PreTrainedTokenizerFast.save_pretrained

    def full_disk(self, save_directory, *a, **k):
        real(self, save_directory, *a, **k)
        path = pt.Path(save_directory) / "tokenizer.json"
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", full_disk)
    out = tmp_path / "tok"
    out.mkdir()  # an empty folder made beforehand is fine
    with pytest.raises(OSError, match="No space"):
        train_tokenizer(TEXTS, 300, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"] and not any(out.iterdir())
    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", real)
    assert len(train_tokenizer(TEXTS, 300, out)) > 259
    # a truncated tokenizer.json left by an earlier version is named, with the fix
    cut = out / "tokenizer.json"
    cut.write_bytes(cut.read_bytes()[:500])
    cfg = PretrainConfig(out="", tokenizer=str(out), corpus="tinyshakespeare", vocab_size=300)
    with pytest.raises(ValueError, match="holds a tokenizer that does not load .*delete that folder"):
        pt.load_or_train_tokenizer(cfg)


def test_cli_tokenizer_only(tmp_path, capsys):
    pt.main(["--tokenizer", str(tmp_path / "tok"), "--corpus", "tinyshakespeare", "--vocab-size", "280",
             "--tokenizer-only"])
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    assert pt.tokenizer_record(tmp_path / "tok") == {"vocab_size": 280, "corpus": "tinyshakespeare"}
    with pytest.raises(SystemExit):
        pt.main(["--tokenizer", str(tmp_path / "tok")])  # --out missing


def test_a_corpus_file_that_is_missing_exits_2_before_the_out_folder_is_made(tmp_path, monkeypatch, capsys):
    """It was a traceback (exit 1) that left an empty --out folder."""
    monkeypatch.setenv("DRAFTKIT_SHARED_DATA", str(tmp_path / "nothing"))
    with pytest.raises(SystemExit) as exit_:
        pt.main(["--tokenizer", str(tmp_path / "tok"), "--corpus", "tinystories", "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    assert "--corpus tinystories: corpus 'tinystories' reads" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "tok").exists()


def test_python_m_quickstart_pretrain_dispatches(monkeypatch):
    """``python -m quickstart pretrain ARGS`` runs quickstart.pretrain.main(ARGS); anything else is the quickstart."""
    from quickstart.__main__ import main

    seen = []
    monkeypatch.setattr(pt, "main", lambda argv: seen.append(("pretrain", argv)))
    monkeypatch.setattr("quickstart.run.main", lambda argv: seen.append(("run", argv)) or 0)
    assert main(["pretrain", "--budget-s", "1"]) == 0 and main(["--smoke", "eval.seed=1"]) == 0
    assert seen == [("pretrain", ["--budget-s", "1"]), ("run", ["--smoke", "eval.seed=1"])]


def test_ctrl_c_saves_the_step_it_finished_and_resumes_exactly(tmp_path, monkeypatch, capsys):
    """Ctrl-C (SIGINT) used to end pretrain with a KeyboardInterrupt traceback, losing the steps since the last
    periodic snapshot; now the step finishes, the snapshot is saved, and the CLI says how to resume (exit 130)."""
    import os
    import signal

    straight = pt.pretrain(_cfg(tmp_path / "a", max_steps=6), log=lambda *_: None)
    real_sample, calls = pt.sample_batch, {"n": 0}

    def ctrl_c_on_fourth(*a, **k):
        calls["n"] += 1
        if calls["n"] == 4:
            os.kill(os.getpid(), signal.SIGINT)  # arrives in the middle of step 4
        return real_sample(*a, **k)

    cfg = _cfg(tmp_path / "b", max_steps=6, save_every_s=1e9)  # no periodic snapshot: only the one at Ctrl-C
    monkeypatch.setattr(pt, "sample_batch", ctrl_c_on_fourth)
    args = ["--out", cfg.out, "--tokenizer", cfg.tokenizer, "--size", cfg.size, "--corpus", cfg.corpus,
            "--vocab-size", str(cfg.vocab_size), "--seq-len", str(cfg.seq_len), "--batch-size", str(cfg.batch_size),
            "--budget-s", "0", "--max-steps", "6", "--lr", str(cfg.lr), "--val-tokens", str(cfg.val_tokens),
            "--device", "cpu", "--save-every-s", "1e9"]
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a background job
    try:                                                                  # ignores SIGINT)
        with pytest.raises(SystemExit) as exit_:
            pt.main(args)
    except KeyboardInterrupt:  # not handled: fail this test instead of stopping the whole session
        pytest.fail("Ctrl-C reached the caller as KeyboardInterrupt")
    finally:
        handler = signal.signal(signal.SIGINT, previous)
    assert exit_.value.code == 130
    err = capsys.readouterr().err
    assert "interrupted at step 4" in err and "run the same command again to resume" in err and "Traceback" not in err
    assert handler is signal.default_int_handler  # the loop's handler was put back
    monkeypatch.setattr(pt, "sample_batch", real_sample)
    assert json.loads((tmp_path / "b" / "model" / pt.RESUME_DIR / "state.json").read_text())["step"] == 4
    resumed = pt.pretrain(cfg, log=lambda *_: None)
    assert resumed["steps"] == 6 and resumed["val_loss"] == straight["val_loss"]


@pytest.mark.parametrize("left", ["resume.old", "resume.tmp"])
def test_a_crash_inside_the_snapshot_swap_resumes_instead_of_restarting(tmp_path, monkeypatch, left):
    """replace_dir moves resume/ aside, then renames resume.tmp into place: a crash in between left no resume/, so
    the rerun started over silently (and its first save deleted both copies)."""
    import shutil

    cfg = _cfg(tmp_path, max_steps=6, save_every_s=0.0)
    crash_pretrain_at(cfg, 4, monkeypatch)
    resume = tmp_path / "model" / pt.RESUME_DIR
    shutil.move(str(resume), str(resume.with_name(left)))  # the state between the two renames
    logs = []
    result = pt.pretrain(cfg, log=logs.append)
    assert any(f"restored it from {resume.with_name(left)}" in str(line) for line in logs)
    assert any("resuming smoke_draft at step 3" in str(line) for line in logs) and result["steps"] == 6


def test_a_finished_model_of_another_tokenizer_is_not_reused(tmp_path):
    """The finished-run check compared size, corpus and window only: a model trained with another tokenizer was
    reused for the given one."""
    pt.pretrain(_cfg(tmp_path, max_steps=2), log=lambda *_: None)
    assert pt.cached_result(_cfg(tmp_path, max_steps=2)) is not None  # the same tokenizer: reused
    train_tokenizer(TEXTS, 300, tmp_path / "other_tok")
    with pytest.raises(ValueError, match="trained with another tokenizer than --tokenizer"):
        pt.pretrain(_cfg(tmp_path, max_steps=2, tokenizer=str(tmp_path / "other_tok")), log=lambda *_: None)


def test_a_failure_after_the_last_step_keeps_the_trained_steps(tmp_path, monkeypatch):
    """The snapshot was saved only every --save-every-s: an error in the final evaluation (or a kill while saving
    the model) lost every step since, and with no snapshot yet the rerun started over without a word."""
    cfg = _cfg(tmp_path, max_steps=6, save_every_s=1e9)
    real = pt.evaluate_loss
    monkeypatch.setattr(pt, "evaluate_loss", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("out of memory")))
    with pytest.raises(RuntimeError, match="out of memory"):
        pt.pretrain(cfg, log=lambda *_: None)
    monkeypatch.setattr(pt, "evaluate_loss", real)
    monkeypatch.setattr(pt, "sample_batch", lambda *a, **k: pytest.fail("a step was trained again"))
    logs = []
    result = pt.pretrain(cfg, log=logs.append)
    assert any("resuming smoke_draft at step 6" in str(line) for line in logs) and result["steps"] == 6


def test_a_full_disk_while_writing_pretrain_json_is_resumed_not_read_as_finished(tmp_path, monkeypatch):
    """pretrain.json was written in place: a full disk (or a kill) mid-write left a cut file beside config.json,
    and every rerun failed reading it as a finished run ('Expecting value: line 1 column 1')."""
    cfg = _cfg(tmp_path, max_steps=4, save_every_s=0.0)
    restore = full_disk_for(monkeypatch, '"val_loss"')
    with pytest.raises(ValueError, match=r"could not save the model to .*No space left.*trained steps are kept in "
                                         r".*resume.*run the same command again"):
        pt.pretrain(cfg, log=lambda *_: None)
    restore()
    logs = []
    result = pt.pretrain(cfg, log=logs.append)
    assert any("resuming smoke_draft at step 4" in str(line) for line in logs) and result["steps"] == 4
    assert json.loads((tmp_path / "model" / pt.RESULT_FILE).read_text())["steps"] == 4


def test_a_full_disk_while_saving_the_snapshot_exits_2_and_keeps_the_previous_one(tmp_path, monkeypatch, capsys):
    """A full disk mid-snapshot was a traceback (safetensors' own error type) that left resume.tmp behind."""
    import errno

    argv = ["--out", str(tmp_path / "model"), "--tokenizer", str(tmp_path / "tok"), "--size", "smoke_draft",
            "--corpus", "tinyshakespeare", "--vocab-size", "300", "--seq-len", "32", "--batch-size", "4",
            "--budget-s", "0", "--max-steps", "4", "--save-every-s", "0", "--val-tokens", "2048", "--device", "cpu"]
    real, calls = pt.save_tensors, {"n": 0}  # bound in quickstart.pretrain

    def disk_full(tensors, path):
        if path.name == "optimizer.safetensors":
            calls["n"] += 1
            if calls["n"] == 3:  # the third snapshot (step 3)
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(tensors, path)

    monkeypatch.setattr(pt, "save_tensors", disk_full)
    with pytest.raises(SystemExit) as exit_info:
        pt.main(argv)
    assert exit_info.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "could not save the resume snapshot" in err and "No space left" in err and "is intact" in err
    resume = tmp_path / "model" / pt.RESUME_DIR
    assert not resume.with_name(resume.name + ".tmp").exists()
    assert json.loads((resume / "state.json").read_text())["step"] == 2
    monkeypatch.setattr(pt, "save_tensors", real)
    assert pt.main(argv)["steps"] == 4
