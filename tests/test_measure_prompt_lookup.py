"""scripts/measure_prompt_lookup.py: the pooled table by hand, and bad input refused before any model loads."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from measure_prompt_lookup import pool, table  # noqa: E402


def rec(method, seconds, new_tokens, steps, drafted, accepted, equal):
    return dict(method=method, seconds=seconds, new_tokens=new_tokens, steps=steps, drafted=drafted,
                accepted=accepted, equal=equal)


def test_pool_sums_over_prompts_before_dividing():
    out = pool([rec("plain", 1.0, 64, 64, 0, 0, 1), rec("plain", 3.0, 64, 64, 0, 0, 1),
                rec("spec_g4", 1.0, 64, 20, 80, 44, 1), rec("spec_g4", 1.0, 64, 16, 64, 48, 0)])
    assert out["plain"]["tokens_per_s"] == 32.0 and out["plain"]["acceptance_rate"] is None
    assert out["spec_g4"]["tokens_per_s"] == 64.0 and out["spec_g4"]["speedup"] == 2.0
    assert out["spec_g4"]["tokens_per_step"] == 128 / 36 and out["spec_g4"]["acceptance_rate"] == 92 / 144
    assert out["spec_g4"]["equal"] == 1 and out["spec_g4"]["runs"] == 2
    assert "| spec_g4 | 64.0 | 2.000 | 3.56 | 0.639 | 1/2 |" in table(out)


@pytest.mark.parametrize("args,message", [([], "has no results.json"), (["--gammas", "0"], "--gammas '0'"),
                                          (["--gammas", "x"], "--gammas 'x'"), (["--ngram", "0"], "--ngram must be"),
                                          (["--rounds", "0"], "--rounds must be >= 1, got 0"),
                                          # found by a trial: these failed after the whole measurement
                                          (["--out", "/proc/x.json"], "--out '/proc/x.json'"),
                                          (["--out", "/etc/passwd/x.json"], "is a file, not a folder")])
def test_bad_input_exits_2(tmp_path, args, message):
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "measure_prompt_lookup.py"), str(tmp_path), *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr


@pytest.mark.parametrize("out", ["dangling", "~nosuchuser_xyz/x.json"])
def test_an_out_that_cannot_be_written_as_checked_exits_2_before_loading(tmp_path, out):
    """A re-test found a dangling --out link and '~user' paths passed the check (then a traceback after the run)."""
    if out == "dangling":
        (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "x.json")
        out = str(tmp_path / "dangling")
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "measure_prompt_lookup.py"), str(tmp_path), "--out",
                        out, "--compile", "false"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--out" in r.stderr and "Traceback" not in r.stderr


def test_an_existing_out_is_refused_and_kept(tmp_path):
    (tmp_path / "out.json").write_text("{}")
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "measure_prompt_lookup.py"), str(tmp_path), "--out",
                        str(tmp_path / "out.json")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "exists" in r.stderr and (tmp_path / "out.json").read_text() == "{}"


def test_a_folder_that_is_not_a_finished_run_exits_2_naming_what_is_missing(tmp_path):
    script = str(REPO / "scripts" / "measure_prompt_lookup.py")
    (tmp_path / "results.json").write_text("{}")
    r = subprocess.run([sys.executable, script, str(tmp_path), "--compile", "false"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "holds no finished evaluation" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "results.json").write_text('{"eval": {"num_prompts": {}, "max_prompt_tokens": 8, "max_new_tokens": 8}}')
    r = subprocess.run([sys.executable, script, str(tmp_path), "--compile", "false"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "has no target, draft-distilled, tokenizer folder" in r.stderr


def test_compiling_without_a_cpp_compiler_exits_2_before_loading(tmp_path):
    env = dict(os.environ, CXX=str(tmp_path / "no" / "g++"))
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "measure_prompt_lookup.py"), str(tmp_path)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "--compile draft: torch.compile needs a working C++ compiler" in r.stderr
