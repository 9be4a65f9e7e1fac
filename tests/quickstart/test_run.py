"""The quickstart end to end (``python -m quickstart --smoke``): every phase runs and hands over to the next,
the results JSON holds measured numbers for both drafts, and a second run reuses the artifacts. Not slow: CI runs it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quickstart import run as quickstart
from tests.conftest import full_disk_for

REPO = Path(__file__).resolve().parents[2]


def _run(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", "quickstart", "--smoke", "--out", str(out), *overrides], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=400)


@pytest.mark.timeout(600)
def test_smoke_quickstart_end_to_end(tmp_path):
    out = tmp_path / "qs"
    proc = _run(out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "ok"
    assert [res["phases"][p]["status"] for p in ("tokenizer", "target", "draft", "cache-logits", "distill", "export",
                                                 "eval")] == ["ok"] * 7
    assert "python -m distill train +experiment=quickstart_smoke" in res["phases"]["distill"]["command"]
    # quickstart.distill.target_logits=cached: the target scored the data once, the recipe trained on that cache
    assert "python -m distill cache-logits +experiment=quickstart_smoke" in res["phases"]["cache-logits"]["command"]
    assert "data.target_logits=cached" in res["phases"]["distill"]["command"]
    manifest = json.loads((out / "logit_cache" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["k"] == 8 and manifest["tail_samples"] == 4
    assert res["phases"]["target"]["command"].startswith("python -m quickstart pretrain --tokenizer")
    for d in ("target", "draft-baseline", "draft-distilled"):
        assert (out / d / "model.safetensors").is_file() and (out / d / "tokenizer.json").is_file()
    target, draft = res["target"], res["baseline_draft"]
    assert target["params"] > draft["params"] > 0 and target["tokens_seen"] > 0 and target["val_loss"] > 0

    ev = res["eval"]
    sets = {"humaneval", "mbpp_code", "stdlib", "all"}
    assert {(r["temperature"], r["set"]) for r in ev["rows"]} == {(t, s) for t in (0.0, 1.0) for s in sets}
    # γ was chosen per draft and temperature (eval.num_draft_tokens=best) on prompts the timed runs do not use:
    # the verify-aware best of the calibration's own α and measured costs, within 1..max_draft_tokens
    from decode.speedup import best_gamma, predicted_speedup, verify_cost_at

    assert ev["num_draft_tokens"] == "best"
    for d in ("baseline", "distilled"):
        cal = ev["calibration"][d]
        assert cal["verify_costs"][0] == 1.0 and len(cal["verify_costs"]) == 4 + 1 and cal["cost_ratio"] > 0
        # one cost measurement per draft serves the γ choice and the table's verify-aware prediction
        assert ev["cost_ratio"][d] == cal["cost_ratio"] and ev["verify_costs"][d] == cal["verify_costs"]
        for t in ("0.0", "1.0"):
            g = cal["per_temperature"][t]["num_draft_tokens"]
            assert g == ev["gammas"][d][t] == best_gamma(cal["per_temperature"][t]["alpha"], cal["cost_ratio"],
                                                         max_gamma=4, min_gamma=1, verify_costs=cal["verify_costs"])
    for r in ev["rows"]:
        assert r["plain_tokens_per_s"] > 0
        for d in ("baseline", "distilled"):
            m = r[d]
            gamma = m["num_draft_tokens"]
            assert gamma == ev["gammas"][d][str(r["temperature"])]
            assert 0.0 <= m["acceptance_rate"] <= 1.0
            assert m["acceptance_rate"] <= m["alpha"] + 1e-12 <= 1.0 + 1e-12
            assert m["predicted_speedup"] == pytest.approx(predicted_speedup(
                m["alpha"], gamma, ev["cost_ratio"][d], verify_cost_at(ev["verify_costs"][d], gamma)))
            assert 1.0 <= m["mean_accepted_length"] <= gamma + 1
            assert m["speedup"] == pytest.approx(m["tokens_per_s"] / r["plain_tokens_per_s"])
            assert sum(m["accepted_length_histogram"]) == m["num_verify_steps"] > 0
    # greedy speculative decoding is lossless: every greedy run equals plain greedy decoding
    assert ev["greedy_lossless"]["equal"] == ev["greedy_lossless"]["total"] == 2 * 3
    assert "speculative decoding vs plain target decoding" in proc.stdout
    # the drafts ran compiled (the default, as in the full quickstart); the rerun measures the eager engine
    assert ev["compile"] == "draft" and "drafts compiled" in " ".join(proc.stdout.split())  # the title may wrap
    assert ev["prompt_lookup_ngram"] == 3 and "prompt lookup (n = 3)" in " ".join(proc.stdout.split())

    again = _run(out, "eval.compile=false", "eval.prompt_lookup_ngram=0")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    res2 = json.loads((out / "results.json").read_text())
    kept = list(out.glob("results-*.json"))  # the first run's results are renamed, not overwritten
    assert len(kept) == 1 and json.loads(kept[0].read_text()) == res
    assert all(res2["phases"][p]["status"].startswith("cached") for p in ("tokenizer", "target", "draft",
                                                                            "distill+export"))
    assert res2["target"]["val_loss"] == target["val_loss"]
    assert res2["eval"]["compile"] is False and res2["eval"]["greedy_lossless"]["equal"] == 6
    assert res2["eval"]["prompt_lookup_ngram"] == 0


def test_settings_load_with_overrides_and_fail_clearly():
    qs = quickstart.load_settings("quickstart", ["target.budget_s=5", "eval.prompt_sets.mbpp_code=3"])
    assert qs.target.budget_s == 5 and qs.eval.prompt_sets.mbpp_code == 3 and qs.draft.size == "draft"
    with pytest.raises(FileNotFoundError, match=r"conf/experiment with a 'quickstart:' section: quickstart, "
                                                 r"quickstart_real, quickstart_real_smoke, quickstart_smoke$"):  # the choices (it named only the folder)
        quickstart.load_settings("no_such_experiment")
    with pytest.raises(KeyError, match="quickstart"):
        quickstart.load_settings("distillspec_qwen")


@pytest.mark.parametrize("experiment", ["quickstart", "quickstart_smoke"])
def test_experiments_compose_for_the_recipe(experiment):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import distill.config  # noqa: F401  registers distill_schema, which conf/config.yaml starts from

    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf"), job_name="test"):
        cfg = compose(config_name="config", overrides=[f"+experiment={experiment}", "++target.name_or_path=/t"])
    assert cfg.target.name_or_path == "/t" and cfg.data.source.corpus == "stdlib"
    assert cfg.draft.name_or_path.endswith("draft-baseline") and cfg.quickstart.target.size
    assert 0.0 <= cfg.data.on_policy_fraction <= 1.0 and cfg.loss.name in ("fkl", "rkl", "jsd", "tvd")



def test_misspelled_setting_is_an_error(capsys):
    assert quickstart.main(["--smoke", "eval.max_new_token=5"]) == 2
    err = capsys.readouterr().err
    assert "unknown quickstart setting" in err and "max_new_token" in err
    qs = quickstart.load_settings("quickstart_smoke", ["eval.max_new_tokens=5"])
    assert qs.eval.max_new_tokens == 5
    for bad in ("0", "fast", "2.5"):  # γ: a positive int or `best`, refused before any phase runs
        assert quickstart.main(["--smoke", f"eval.num_draft_tokens={bad}"]) == 2
        assert "eval.num_draft_tokens" in capsys.readouterr().err
    for bad, key in [("eval.max_draft_tokens=0", "eval.max_draft_tokens"),
                     ("eval.calibration_prompts=0", "eval.calibration_prompts"),
                     ("eval.temperatures=[-1]", "eval.temperatures"), ("eval.max_new_tokens=0", "eval.max_new_tokens"),
                     ("eval.prompt_sets.humaneval=0", "eval.prompt_sets")]:  # every eval setting, up front
        assert quickstart.main(["--smoke", bad]) == 2, bad
        assert key in capsys.readouterr().err


def test_a_map_of_prompt_sets_replaces_the_default_sets():
    """eval.prompt_sets={humaneval:2} merged into the defaults, so the other two sets still ran."""
    assert dict(quickstart.load_settings("quickstart_smoke", ["eval.prompt_sets={humaneval:2}"]).eval.prompt_sets) == {
        "humaneval": 2}
    qs = quickstart.load_settings("quickstart_smoke", ["eval.prompt_sets.humaneval=3"])  # one key: the others stay
    assert len(qs.eval.prompt_sets) == 3 and qs.eval.prompt_sets.humaneval == 3


def test_pretrain_and_distill_settings_are_refused_before_any_phase(tmp_path, capsys):
    """These failed only after the tokenizer/target/draft phases (about 10 minutes), some with exit 1."""
    out = tmp_path / "qs"
    cases = [(["distill.cache_k=0"], "quickstart.distill.cache_k=0 must be an integer >= 1"),
             (["target.budget_s=-5"], "quickstart.target.budget_s=-5"), (["threads=abc"], "quickstart.threads"),
             (["target.size=huge"], "quickstart.target.size='huge'"),
             (["--distill-overrides", "loss=kld"], "loss=kld: no such option"),
             (["--distill-overrides", "train.max_step=5"], "did you mean train.max_steps"),
             (["--distill-overrides", "loss='fkl"], "No closing quotation"),
             (["distill.cache_k=null"], "quickstart.distill.cache_k=None"),
             (["distill.tail_samples=2.7"], "quickstart.distill.tail_samples=2.7"),
             # the cached recipe cannot take these; they failed only in the distill phase, then blamed the experiment
             (["--distill-overrides", "data.on_policy_fraction=0.5"], "on-policy batches are draft samples"),
             (["--distill-overrides", "loss=tvd"], "data.logit_cache_tail_samples=4 (sampled tail ids) give"),
             (["eval.compile=both"], "quickstart.eval.compile='both': use false, draft"),
             (["eval.compile=1"], "quickstart.eval.compile=1: use false, draft"),
             (["eval.prompt_lookup_ngram=-1"], "quickstart.eval.prompt_lookup_ngram must be an integer >= 0"),
             (["eval.prompt_lookup_ngram=two"], "quickstart.eval.prompt_lookup_ngram must be an integer >= 0"),
             # found by a new user's trial: a section given a value was a traceback (AttributeError, exit 1) ...
             (["target=5"], "target is a section (dir, size,"), (["eval"], "eval is a section"),
             (["distill=null"], "distill is a section"),
             # ... an empty map of prompt sets kept the default sets, and a run folder of the recipe's own trained
             # all phases into it and then failed with no error shown (the export found no checkpoint)
             (["eval.prompt_sets={}"], "quickstart.eval.prompt_sets={}: use {set: number of prompts >= 1}"),
             (["eval.prompt_sets=5"], "eval.prompt_sets takes {name: number}"),
             (["--distill-overrides", f"train.output_dir={tmp_path}/elsewhere"],
              "the quickstart sets train.output_dir"),
             (["--distill-overrides", "train.resume=true"], "the quickstart sets train.resume itself"),
             (["--distill-overrides", "++target.name_or_path=/x"], "the quickstart sets target.name_or_path")]
    for args, message in cases:
        assert quickstart.main(["--smoke", "--out", str(out), *args]) == 2, args
        assert message in capsys.readouterr().err, args
    assert not out.exists()  # refused before the output folder was made
    # a recipe key given in --distill-overrides is not blamed on the quickstart setting that sets it otherwise
    assert quickstart.main(["--smoke", "--out", str(out), "--distill-overrides", "data.logit_cache_k=0"]) == 2
    assert "set by quickstart" not in capsys.readouterr().err


def test_compiling_without_a_cpp_compiler_is_refused_before_any_phase(tmp_path, monkeypatch, capsys):
    """eval.compile needs inductor's C++ compiler (the one inductor picks: $CXX, else g++, which a first version of
    this check did not follow: a $CXX naming no compiler passed it); without one the evaluation would fail after
    all the training."""
    from omegaconf import OmegaConf
    from torch._inductor import config as inductor_config

    out = tmp_path / "qs"
    assert quickstart.eval_compile(OmegaConf.create({"compile": "draft"})) == "draft"  # this machine has one
    monkeypatch.setattr(inductor_config.cpp, "cxx", (None, str(tmp_path / "no" / "g++")))  # as CXX=/that/path
    assert quickstart.main(["--smoke", "--out", str(out), "eval.compile=draft"]) == 2
    err = capsys.readouterr().err
    assert "quickstart.eval.compile=draft: torch.compile needs a working C++ compiler" in err
    assert "InvalidCxxCompiler" in err and "eval.compile=false" in err
    assert not out.exists()
    assert quickstart.eval_compile(OmegaConf.create({"compile": False})) is False  # no compiler needed


def test_a_second_quickstart_into_the_same_folder_is_refused_while_the_first_runs(tmp_path, monkeypatch, capsys):
    """Two runs into one --out trained over each other: the second's target replaced the first's (whose results
    then described a model it did not train), and an overwrite deleted the first's running distillation files."""
    out = tmp_path / "qs"
    out.mkdir()
    held = quickstart.lock_out_dir(out)  # the first run, still going
    monkeypatch.setattr(quickstart, "_run_phases", lambda *a, **k: pytest.fail("a phase ran"))
    assert quickstart.main(["--smoke", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"another quickstart is running into {out} (pid {os.getpid()} on " in err and "give another --out" in err
    held.close()  # the first run ended (also what kill -9 does): the lock goes with it
    monkeypatch.setattr(quickstart, "_run_phases", lambda *a, **k: 0)
    assert quickstart.main(["--smoke", "--out", str(out)]) == 0


def test_a_cache_made_with_other_settings_is_named_not_reused(tmp_path):
    from quickstart.run import _cache_complete

    qs = quickstart.load_settings("quickstart_smoke", ["distill.cache_k=4"])
    assert _cache_complete(qs, tmp_path) is False  # none yet: the phase builds it
    (tmp_path / "logit_cache").mkdir()
    manifest = tmp_path / "logit_cache" / "manifest.json"
    manifest.write_text(json.dumps({"k": 8, "tail_samples": 4, "complete": True}))
    with pytest.raises(ValueError, match="delete that folder"):
        _cache_complete(qs, tmp_path)
    manifest.write_text(json.dumps({"k": 4, "tail_samples": 4, "complete": True}))
    assert _cache_complete(qs, tmp_path) is True
    manifest.write_text(json.dumps({"k": 4, "tail_samples": 4, "complete": False}))
    assert _cache_complete(qs, tmp_path) is False  # unfinished: cache-logits resumes it


def test_a_rerun_keeps_earlier_results(tmp_path):
    from quickstart.run import keep_previous_results

    path = tmp_path / "results.json"
    assert keep_previous_results(path) is None  # nothing to keep
    path.write_text(json.dumps({"started": "2026-12-01T20:44:19+0000", "total_s": 1.0}))
    first = keep_previous_results(path)
    assert first.name == "results-20261201T204419.json" and not path.exists()
    path.write_text(json.dumps({"started": "2026-12-01T20:44:19+0000", "total_s": 2.0}))
    second = keep_previous_results(path)  # same start time: a new name, the first one untouched
    assert second.name == "results-20261201T204419-2.json"
    assert json.loads(first.read_text())["total_s"] == 1.0 and json.loads(second.read_text())["total_s"] == 2.0
    path.write_text("not json")
    third = keep_previous_results(path)
    assert third.read_text() == "not json" and third.name.startswith("results-")


def test_a_failed_evaluation_still_writes_results_and_keeps_the_models(tmp_path, monkeypatch, capsys):
    out = tmp_path / "qs"
    for marker in ("tokenizer/tokenizer.json", "target/pretrain.json", "draft-baseline/pretrain.json",
                   "draft-distilled/config.json"):  # every phase already done: only the evaluation runs
        (out / marker).parent.mkdir(parents=True, exist_ok=True)
        (out / marker).write_text("{}")

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(quickstart, "evaluate", broken)
    assert quickstart.main(["--smoke", "--out", str(out)]) == 1
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "failed" and res["phases"]["eval"]["status"] == "failed: RuntimeError: disk full"
    assert res["phases"]["target"]["status"].startswith("cached") and (out / "target" / "pretrain.json").is_file()
    assert res["target"] == {} and res["baseline_draft"] == {}  # the models' records are kept too
    assert "rerun the same command" in " ".join(capsys.readouterr().out.split())  # rich wraps long lines


def test_distill_overrides_on_a_reused_distillation_are_named_and_recorded(tmp_path, monkeypatch, capsys):
    """A rerun with other --distill-overrides reused the finished distilled draft without a word, and results.json
    did not record the overrides asked for."""
    out = tmp_path / "qs"
    for marker in ("tokenizer/tokenizer.json", "target/pretrain.json", "draft-baseline/pretrain.json",
                   "draft-distilled/config.json"):  # every phase already done: only the evaluation runs
        (out / marker).parent.mkdir(parents=True, exist_ok=True)
        (out / marker).write_text("{}")
    monkeypatch.setattr(quickstart, "evaluate", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("not needed")))
    quickstart.main(["--smoke", "--out", str(out), "--distill-overrides", "train.max_steps=12 optim.lr=1e-2"])
    said = " ".join(capsys.readouterr().out.split())
    assert "--distill-overrides train.max_steps=12 optim.lr=1e-2 apply when the distillation runs" in said
    assert f"delete {out / 'draft-distilled'}" in said
    assert json.loads((out / "results.json").read_text())["distill_overrides"] == ["train.max_steps=12",
                                                                                   "optim.lr=1e-2"]


def test_an_interrupted_phase_ends_the_run_with_a_resume_hint(tmp_path, monkeypatch, capsys):
    """A phase stopped by Ctrl-C (exit 130 after saving) used to be reported as failed ("Nothing to evaluate");
    the run now stops with 130 and says that rerunning continues, writing no results.json."""
    real_main = quickstart.pretrain_main  # the pretraining phases run in this process

    def interrupted(argv):
        if "--tokenizer-only" not in argv:
            print("python -m quickstart pretrain: interrupted at step 3", file=sys.stderr)
            raise SystemExit(130)
        return real_main(argv)

    monkeypatch.setattr(quickstart, "pretrain_main", interrupted)
    out = tmp_path / "qs"
    assert quickstart.main(["--smoke", "--out", str(out)]) == 130
    said = " ".join(capsys.readouterr().out.split())
    assert "interrupted; nothing is lost: run the same command again to continue" in said
    assert (out / "tokenizer" / "tokenizer.json").is_file() and not (out / "results.json").exists()


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_reaches_a_subprocess_phase_once_and_waits_for_it_to_save(tmp_path, signame):
    """subprocess.run kills its child 0.25 s after a Ctrl-C, so a distill phase lost the steps since its last
    checkpoint; the phase now gets the time its own handler needs to save and exit. The phase has its own process
    group and this process passes the signal on: a SIGTERM to this process killed it at once and left the phase
    running on its own, and a Ctrl-C sent to this process alone never reached the phase (it ran to its end)."""
    import signal
    import threading
    import time as time_

    from rich.console import Console

    saved = tmp_path / "saved"
    child = ("import signal, sys, time, pathlib\n"
             "got = []\n"
             "def stop(signum, frame):\n"
             "    got.append(signal.Signals(signum).name)\n"
             "    if len(got) > 1: return\n"
             "    time.sleep(1.5)  # a checkpoint save\n"
             f"    pathlib.Path({str(saved)!r}).write_text(' '.join(got))\n"
             "    sys.exit(130)\n"
             "signal.signal(signal.SIGINT, stop)\n"
             "signal.signal(signal.SIGTERM, stop)\n"
             f"pathlib.Path({str(tmp_path / 'ready')!r}).write_text('')\n"
             "time.sleep(60)\n")
    procs = []
    real_popen = quickstart.subprocess.Popen

    def popen(cmd, *a, **k):
        proc = real_popen(cmd, *a, **k)
        if cmd[:2] == [sys.executable, "-c"]:  # the phase (not another subprocess made on the way)
            procs.append(proc)
        return proc

    sig = getattr(signal, signame)

    def send():  # a terminal's Ctrl-C (the foreground group: this process, not the phase's group), or kill PID
        signal.pthread_sigmask(signal.SIG_BLOCK, {sig})  # so the main thread gets it (EINTR in waitpid)
        deadline = time_.time() + 30
        while not (tmp_path / "ready").exists() and time_.time() < deadline:
            time_.sleep(0.05)
        os.kill(os.getpid(), sig)

    from distill.logging import sigterm_raises

    quickstart.subprocess.Popen, phases = popen, {}
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as main() has them
    try:
        threading.Thread(target=send, daemon=True).start()
        with pytest.raises(KeyboardInterrupt) as stop, sigterm_raises(quickstart.Terminated):
            quickstart.run_phase("distill", [sys.executable, "-c", child], phases, Console(file=open(os.devnull, "w")))
    finally:
        quickstart.subprocess.Popen = real_popen
        signal.signal(signal.SIGINT, previous)
    assert stop.value.args == ()  # this process's own signal, not the phase's exit status 130
    assert saved.read_text() == signame and procs[0].returncode == 130  # the phase got it once, saved, exited


def test_a_phase_outlives_a_killed_quickstart_only_to_save_and_holds_the_lock_until_it_exits(tmp_path):
    """kill -9 of the quickstart left its distill phase training on (its own process group) and freed the --out lock,
    so a rerun resumed into the same folder beside it (two trainers; the rerun failed on a pruned step folder). The
    phase now gets SIGTERM when the quickstart dies (it saves and stops) and holds the lock until it has exited."""
    import signal
    import subprocess
    import time as time_

    out, marker, pid_file = tmp_path / "qs", tmp_path / "saved", tmp_path / "child.pid"
    out.mkdir()
    child = ("import os, signal, sys, time, pathlib\n"
             "def stop(signum, frame):\n"
             "    time.sleep(1.5)  # a checkpoint save\n"
             f"    pathlib.Path({str(marker)!r}).write_text(signal.Signals(signum).name)\n"
             "    sys.exit(130)\n"
             "signal.signal(signal.SIGTERM, stop)\n"
             f"pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))\n"
             "time.sleep(60)\n")
    parent = ("import os, sys\n"
              "from pathlib import Path\n"
              "from rich.console import Console\n"
              "import quickstart.run as q\n"
              "q._held_lock = q.lock_out_dir(Path(sys.argv[1]))\n"
              "q._run_child([sys.executable, '-c', sys.argv[2]], q._env(), Console(file=open(os.devnull, 'w')))\n")
    proc = subprocess.Popen([sys.executable, "-c", parent, str(out), child], cwd=quickstart.REPO,
                            env={**os.environ, "PYTHONPATH": str(quickstart.REPO)})
    deadline = time_.time() + 60
    while not pid_file.exists() and time_.time() < deadline:
        time_.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with pytest.raises(ValueError, match="another quickstart is running into"):  # the phase still holds it
        quickstart.lock_out_dir(out).close()
    while not marker.exists() and time_.time() < deadline:
        time_.sleep(0.05)
    assert marker.read_text() == "SIGTERM"  # the phase was told to stop, and saved
    while time_.time() < deadline:
        try:
            quickstart.lock_out_dir(out).close()  # free once the phase has exited
            break
        except ValueError:
            time_.sleep(0.05)
    else:
        pytest.fail("the lock was never released")


def test_a_full_disk_while_writing_results_prints_them_and_leaves_no_cut_file(tmp_path, monkeypatch, capsys):
    """results.json was written in place: a full disk left an empty results.json (which the next run kept as an
    earlier result) and a traceback, and the run's measurements were gone."""
    out = tmp_path / "qs"
    for marker in ("tokenizer/tokenizer.json", "target/pretrain.json", "draft-baseline/pretrain.json",
                   "draft-distilled/config.json"):  # every phase already done: only the evaluation runs
        (out / marker).parent.mkdir(parents=True, exist_ok=True)
        (out / marker).write_text("{}")
    (out / "results.json").write_text(json.dumps({"started": "2026-12-01T20:44:19+0000", "total_s": 1.0}))
    monkeypatch.setattr(quickstart, "evaluate", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    restore = full_disk_for(monkeypatch, '"phases"')
    assert quickstart.main(["--smoke", "--out", str(out)]) == 1
    restore()
    printed = " ".join(capsys.readouterr().out.split())
    assert '"status": "failed"' in printed and "could not write" in printed and "No space left" in printed
    assert not (out / "results.json").exists() and not (out / "results.json.tmp").exists()
    assert json.loads((out / "results-20261201T204419.json").read_text())["total_s"] == 1.0  # the earlier one
