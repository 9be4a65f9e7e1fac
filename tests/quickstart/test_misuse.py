"""A user's mistakes with the quickstart stop before any work with exit 2 and a message naming the setting and the
fix (no traceback), and what is already under --out is reused only by the configuration that made it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from quickstart import pretrain as pt
from quickstart import run as quickstart


def _no_phase(*args, **kwargs):
    raise AssertionError("a phase started although the run should have been refused")


@pytest.fixture(autouse=True)
def _phases_must_not_start(monkeypatch):
    monkeypatch.setattr(quickstart, "run_phase", _no_phase)
    monkeypatch.setattr(quickstart, "evaluate", _no_phase)


def _refused(args, capsys) -> str:
    assert quickstart.main(args) == 2, args
    return " ".join(capsys.readouterr().err.split())


def test_an_out_that_is_a_file_or_cannot_be_made_is_refused(tmp_path, capsys):
    (tmp_path / "afile").write_text("mine")
    assert "is a file, not a folder" in _refused(["--smoke", "--out", str(tmp_path / "afile")], capsys)
    assert (tmp_path / "afile").read_text() == "mine"
    assert "cannot be used" in _refused(["--smoke", "--out", str(tmp_path / "afile" / "sub")], capsys)


def test_a_relative_out_is_taken_from_where_the_command_was_typed(tmp_path, monkeypatch, capsys):
    (tmp_path / "afile").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("QUICKSTART_CWD", raising=False)
    assert str(tmp_path / "afile") in _refused(["--smoke", "--out", "afile"], capsys)
    other = tmp_path / "sub"  # scripts/quickstart.sh runs from the repository and passes the caller's folder
    other.mkdir()
    (other / "afile").write_text("")
    monkeypatch.setenv("QUICKSTART_CWD", str(other))
    assert str(other / "afile") in _refused(["--smoke", "--out", "afile"], capsys)


def test_settings_may_follow_out(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    err = _refused(["--smoke", "threads=1", "--out", str(tmp_path / "afile"), "eval.seed=1"], capsys)
    assert "is a file" in err  # parsed: not "unrecognized arguments: eval.seed=1"


def test_more_prompts_than_the_set_holds_is_refused(tmp_path, capsys):
    from distill.corpus import load_prompts

    have = len(load_prompts("stdlib"))
    err = _refused(["--smoke", "--out", str(tmp_path / "qs"), f"eval.prompt_sets.stdlib={have}"], capsys)
    assert f"quickstart.eval.prompt_sets.stdlib={have}" in err and f"use at most {have - 1}" in err
    assert not (tmp_path / "qs").exists()


def _write(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def test_a_model_made_with_other_settings_is_not_reused(tmp_path, capsys):
    """A full run's folder given to --smoke (or the reverse) was reused as if this run had made it."""
    out = tmp_path / "qs"
    _write(out / "tokenizer" / "tokenizer.json", {})
    _write(out / "target" / "pretrain.json",
           {"config": {"size": "target", "corpus": "stdlib", "seq_len": 256, "vocab_size": 8192}})
    err = _refused(["--smoke", "--out", str(out)], capsys)
    assert "target.size='target'" in err and "vocab_size=8192" in err and "target.size='smoke_target'" in err
    assert (out / "target" / "pretrain.json").is_file()


def test_a_tokenizer_trained_with_another_vocabulary_is_not_reused(tmp_path, capsys):
    """A folder holding only a 512-id tokenizer, given vocab_size=1024, reused it, and the target trained with it
    recorded vocab_size 1024, so every later check passed on a false record."""
    from quickstart.pretrain import TOKENIZER_RECORD

    out = tmp_path / "qs"
    _write(out / "tokenizer" / "tokenizer.json", {})
    _write(out / "tokenizer" / TOKENIZER_RECORD, {"vocab_size": 512, "corpus": "stdlib"})
    err = _refused(["--smoke", "--out", str(out), "vocab_size=1024"], capsys)
    assert f"{out / 'tokenizer'} holds a tokenizer made with vocab_size=512" in err and "vocab_size=1024" in err
    assert (out / "tokenizer" / "tokenizer.json").is_file()  # nothing deleted


def test_a_deleted_phase_with_later_artifacts_left_is_refused(tmp_path, capsys):
    """Deleting target/ retrained the target and then reused the draft distilled against the old one."""
    out = tmp_path / "qs"
    _write(out / "tokenizer" / "tokenizer.json", {})
    _write(out / "draft-baseline" / "pretrain.json", {})
    _write(out / "draft-distilled" / "config.json", {})
    err = _refused(["--smoke", "--out", str(out)], capsys)
    assert f"{out / 'target'} holds no finished target" in err and "draft-distilled/" in err
    assert (out / "draft-distilled" / "config.json").is_file()  # nothing deleted


def test_a_cache_made_with_other_settings_is_refused_before_any_phase(tmp_path, capsys):
    out = tmp_path / "qs"
    _write(out / "logit_cache" / "manifest.json", {"k": 4, "tail_samples": 4, "complete": True})
    assert "holds a logit cache made with" in _refused(["--smoke", "--out", str(out)], capsys)


@pytest.mark.parametrize("name", ["it's", "a,b", "x=y", "[x]", "a b", "back\\slash\\"])
def test_an_out_with_characters_hydra_parses_reaches_the_recipe(tmp_path, name):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    qs = quickstart.load_settings("quickstart_smoke")
    out = tmp_path / name
    quickstart.check_distill_settings(qs, "quickstart_smoke", out, [])  # was: LexerNoViableAltException, ...
    parser = OverridesParser.create()
    values = {o.key_or_group: o.value() for o in
              (parser.parse_override(x) for x in quickstart._distill_cmd(qs, "quickstart_smoke", out, [])[4:])}
    assert values["train.output_dir"] == str(out / "distill")
    assert values["data.logit_cache"] == str(out / "logit_cache")


# ------------------------------------------------------------------------------------ python -m quickstart pretrain

@pytest.mark.parametrize("args, message", [
    (["--threads", "-1"], "--threads -1"), (["--vocab-size", "10"], "--vocab-size 10"),
    (["--batch-size", "0"], "--batch-size 0"), (["--seq-len", "0"], "--seq-len 0"), (["--lr", "0"], "--lr 0"),
    (["--budget-s", "nan"], "budget_s=nan"), (["--val-tokens", "0"], "--val-tokens 0"),
    (["--warmup-frac", "1"], "--warmup-frac 1"), (["--out", "AFILE"], "is a file, not a folder"),
    (["--tokenizer", "AFILE"], "is a file, not a folder")])
def test_pretrain_cli_refuses_bad_settings_before_work(tmp_path, capsys, args, message):
    (tmp_path / "afile").write_text("")
    args = [str(tmp_path / "afile") if a == "AFILE" else a for a in args]
    base = {"--tokenizer": str(tmp_path / "tok"), "--out": str(tmp_path / "m"), "--size": "smoke_draft",
            "--budget-s": "1"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    with pytest.raises(SystemExit) as exc:
        pt.main([x for kv in base.items() for x in kv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "tok").exists()  # before the tokenizer is trained


def _cfg(tmp_path, **kw):
    base = dict(out=str(tmp_path / "model"), tokenizer=str(tmp_path / "tok"), size="smoke_draft",
                corpus="tinyshakespeare", vocab_size=300, seq_len=32, batch_size=4, budget_s=0, max_steps=4,
                lr=3e-3, val_tokens=256, device="cpu", save_every_s=0.0)
    base.update(kw)
    return pt.PretrainConfig(**base)


def test_a_resume_snapshot_of_other_settings_is_named_not_continued(tmp_path, monkeypatch, capsys):
    from tests.quickstart.test_pretrain import crash_pretrain_at

    crash_pretrain_at(_cfg(tmp_path), 3, monkeypatch)
    snap = tmp_path / "model" / pt.RESUME_DIR
    state = json.loads((snap / "state.json").read_text())
    # same shapes, another window: it was continued silently
    with pytest.raises(ValueError, match="resume snapshot of a run with other settings"):
        pt.pretrain(_cfg(tmp_path, seq_len=16), log=lambda *_: None)
    # another size: it was a RuntimeError traceback from load_state_dict (a snapshot without its settings too)
    del state["identity"]
    (snap / "state.json").write_text(json.dumps(state))
    from distill.checkpoint import write_manifest

    write_manifest(snap, int(state["step"]))
    with pytest.raises(SystemExit) as exc:
        pt.main(["--tokenizer", str(tmp_path / "tok"), "--out", str(tmp_path / "model"), "--size", "smoke_target",
                 "--corpus", "tinyshakespeare", "--seq-len", "32", "--budget-s", "0", "--max-steps", "4"])
    assert exc.value.code == 2 and "resume snapshot of a model of another shape" in capsys.readouterr().err
    assert snap.is_dir()  # kept: it may be continued with its own settings
    assert pt.pretrain(_cfg(tmp_path), log=lambda *_: None)["steps"] == 4


def test_a_corpus_whose_file_is_missing_is_refused_before_the_out_folder_is_made(tmp_path, monkeypatch, capsys):
    """corpus=tinystories without its file made --out, ran the tokenizer phase into a usage text and an empty
    results table, and exited 1."""
    monkeypatch.setenv("DRAFTKIT_SHARED_DATA", str(tmp_path / "shared"))
    err = _refused(["--smoke", "corpus=tinystories", "--out", str(tmp_path / "o")], capsys)
    assert "quickstart.corpus=tinystories: corpus 'tinystories' reads" in err and "DRAFTKIT_SHARED_DATA" in err
    assert not (tmp_path / "o").exists()
