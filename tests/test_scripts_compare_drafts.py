"""scripts/compare_drafts.py: what it refuses before any model loads (exit 2, the option named)."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(*args, cwd=REPO):
    return subprocess.run([sys.executable, str(REPO / "scripts" / "compare_drafts.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_draft_names_must_be_unique_non_empty_and_not_plain(tmp_path):
    pair = tmp_path / "pair"
    for name in ("target", "d"):
        (pair / name).mkdir(parents=True)
        (pair / name / "config.json").write_text("{}")
    draft = str(pair / "d")
    for drafts in ([f"={draft}"], [f"plain={draft}"], [f"a={draft}", f"a={draft}"], [draft]):
        r = run("--pair", str(pair), "--out", str(tmp_path / "r.json"), *drafts)
        assert r.returncode == 2 and ("NAME=PATH" in r.stderr or "draft names" in r.stderr), (drafts, r.stderr)
        assert "Traceback" not in r.stderr and not (tmp_path / "r.json").exists()
    r = run("--pair", str(pair), "--out", str(tmp_path / "r.json"), f"a={draft}", "--set", "eval.max_new_tokens")
    assert r.returncode == 2 and "--set needs KEY=VALUE" in r.stderr
