"""scripts/measure_confidence_stop.py: the replay of greedy speculative steps with a confidence stop, by hand."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from measure_confidence_stop import replay_speedup  # noqa: E402


def test_all_agreeing_drafts_are_one_step():
    # γ = 4 over 4 positions: one step drafts 4 (cost 4 · 0.5 + v_4 = 3) and keeps 4 (the bonus is past the end)
    assert replay_speedup([[0.9] * 4], [[True] * 4], 0.5, [1.0, 1.0], 4) == pytest.approx(4 / 3)


def test_a_threshold_stops_the_step_after_its_first_unsure_draft():
    # h = 0.5: step 1 drafts 2 (the second is unsure), keeps both + the target's token (3 tokens, cost 2); step 2
    # drafts the last position alone: 1 token for 0.5 + 1
    got = replay_speedup([[0.9, 0.1, 0.9, 0.9]], [[True] * 4], 0.5, [1.0], 4, threshold=0.5)
    assert got == pytest.approx(4 / 3.5)


def test_rejected_drafts_cost_their_forwards_and_verify_widths():
    # every draft rejected at γ = 2: each step keeps only the target's token, for 2 · 0.25 + v_2 = 1.7, except the
    # last, which has one position left to draft (0.25 + v_1 = 1.35)
    got = replay_speedup([[0.5] * 3], [[False] * 3], 0.25, [1.0, 1.1, 1.2], 2)
    assert got == pytest.approx(3 / (1.7 + 1.7 + 1.35))


def test_a_folder_without_results_and_an_existing_out_exit_2(tmp_path):
    script = str(REPO / "scripts" / "measure_confidence_stop.py")
    r = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "has no results.json" in r.stderr
    (tmp_path / "out.json").write_text("{}")
    r = subprocess.run([sys.executable, script, str(tmp_path), "--out", str(tmp_path / "out.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "exists" in r.stderr and (tmp_path / "out.json").read_text() == "{}"
