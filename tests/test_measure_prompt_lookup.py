"""scripts/measure_prompt_lookup.py: the pooled table by hand, and bad input refused before any model loads."""
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
                                          (["--gammas", "x"], "--gammas 'x'"), (["--ngram", "0"], "--ngram")])
def test_bad_input_exits_2(tmp_path, args, message):
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "measure_prompt_lookup.py"), str(tmp_path), *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr


def test_an_existing_out_is_refused_and_kept(tmp_path):
    (tmp_path / "out.json").write_text("{}")
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "measure_prompt_lookup.py"), str(tmp_path), "--out",
                        str(tmp_path / "out.json")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "exists" in r.stderr and (tmp_path / "out.json").read_text() == "{}"
