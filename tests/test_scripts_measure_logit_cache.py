"""scripts/measure_logit_cache.py's own logic, with its `python -m distill ...` calls replaced by a stand-in that
writes what each would write (no model runs): bad flags are refused, and a rerun after Ctrl-C reuses the finished
work and continues the interrupted run instead of failing on its folder."""
import json
import sys
from pathlib import Path

import pytest

from tests.conftest import load_script


def value(cmd: list[str], key: str) -> str:
    return next(a.split("=", 1)[1] for a in cmd if a.startswith(key + "="))


class FakeDistill:
    """Stands in for ``sh``: records each command and writes its outputs; ``stop_at`` raises KeyboardInterrupt in
    the first command that contains it, after the command has started writing (as Ctrl-C would)."""

    def __init__(self, steps: int, stop_at: str | None = None):
        self.steps, self.stop_at, self.calls = steps, stop_at, []

    def __call__(self, cmd: list[str], log: Path) -> float:
        self.calls.append(cmd)
        sub = cmd[3]
        if sub == "eval":
            Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps(
                {"per_temperature": {"0.0": {"acceptance_rate": 0.5, "alpha": 0.6}}}))
        elif sub == "cache-logits":
            cache = Path(value(cmd, "data.logit_cache"))
            cache.mkdir(parents=True, exist_ok=True)
            (cache / "manifest.json").write_text("{}")
        elif sub == "train":
            run = Path(value(cmd, "train.output_dir"))
            run.mkdir(parents=True, exist_ok=True)
            (run / "metrics.jsonl").write_text("".join(json.dumps(
                {"train/tokens_per_s": 100.0, "train/tokens_seen": 10 * s}) + "\n" for s in (1, 2)))
            if self.stop_at and any(self.stop_at in a for a in cmd):
                self.stop_at = None
                raise KeyboardInterrupt
            (run / "summary.json").write_text(json.dumps({"steps": self.steps, "final_loss": 1.0}))
            (run / f"step_{self.steps:06d}").mkdir()
        return 1.0


@pytest.fixture
def script(monkeypatch, tmp_path):
    import distill.checkpoint
    import distill.logit_cache

    script = load_script("measure_logit_cache")
    monkeypatch.setattr(distill.logit_cache, "summarize", lambda cache, manifest: {"bytes_per_token": 1.0})
    monkeypatch.setattr(distill.checkpoint, "is_complete", lambda path: Path(path).is_dir())
    for name in ("target", "draft"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    return script


def main(script, monkeypatch, tmp_path, *args):
    monkeypatch.setattr(sys, "argv", ["measure_logit_cache.py", "--target", str(tmp_path / "target"), "--draft",
                                      str(tmp_path / "draft"), "--out", str(tmp_path / "out"), *args])
    script.main()


def test_a_rerun_after_ctrl_c_reuses_finished_work_and_continues(script, monkeypatch, tmp_path):
    first = FakeDistill(2, stop_at="online")  # stopped while the online run trains, before its checkpoint
    monkeypatch.setattr(script, "sh", first)
    with pytest.raises(KeyboardInterrupt):
        main(script, monkeypatch, tmp_path, "--steps", "2", "--ks", "8")
    again = FakeDistill(2)
    monkeypatch.setattr(script, "sh", again)
    main(script, monkeypatch, tmp_path, "--steps", "2", "--ks", "8")
    subs = [c[3] for c in again.calls]
    assert subs == ["train", "eval", "train", "eval"]  # the initial eval and the cache are reused
    assert "train.overwrite=true" in again.calls[0]  # the stopped run starts over in its own folder
    assert "train.overwrite=true" not in again.calls[2] and "train.resume=true" not in again.calls[2]
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(res["runs"]) == {"initial", "online", "cached_k8"}
    assert res["runs"]["cached_k8"]["cache_build_s"] == 1.0


def test_bad_flags_are_refused_before_anything_runs(script, monkeypatch, tmp_path, capsys):
    fake = FakeDistill(2)
    monkeypatch.setattr(script, "sh", fake)
    for args in (["--steps", "0"], ["--ks", "0"], ["--tail-samples", "-1"]):
        with pytest.raises(SystemExit) as stop:
            main(script, monkeypatch, tmp_path, *args)
        assert stop.value.code == 2 and args[0] in capsys.readouterr().err, args
    (tmp_path / "target" / "config.json").unlink()
    with pytest.raises(SystemExit) as stop:
        main(script, monkeypatch, tmp_path)
    assert stop.value.code == 2 and "--target" in capsys.readouterr().err
    assert fake.calls == [] and not (tmp_path / "out").exists()
