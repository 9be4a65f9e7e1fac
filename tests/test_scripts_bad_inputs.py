"""scripts/bad_inputs.py's own command line: --help and a misspelled flag run no case and write nothing."""
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import load_script

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv, code", [(["--help"], 0), (["--wirte"], 2)])
def test_help_and_unknown_flags_run_no_case(argv, code, monkeypatch, capsys):
    script = load_script("bad_inputs")
    ran, wrote = [], []
    monkeypatch.setattr(script, "run_case", lambda *a: ran.append(a))
    monkeypatch.setattr(script, "write_docs", lambda *a: wrote.append(a))
    with pytest.raises(SystemExit) as stop:
        script.main(argv)
    assert stop.value.code == code and ran == [] and wrote == []
    shown = capsys.readouterr()
    assert "--write" in (shown.out if code == 0 else shown.err)  # the usage names the one flag


def test_write_runs_the_cases_and_writes_the_table(monkeypatch, capsys):
    """--write ran every case, then crashed before writing (the loop's variable shadowed the parsed options)."""
    import subprocess

    script = load_script("bad_inputs")
    wrote = []
    monkeypatch.setattr(script, "CASES", [("a bad input", "train x=1", "named")])
    monkeypatch.setattr(script, "make_fixtures", lambda tmp: {})
    monkeypatch.setattr(script, "case_command", lambda args, fields: ("distill", ["train", "x=1"]))
    monkeypatch.setattr(script, "run_case", lambda module, argv: subprocess.CompletedProcess(
        argv, 2, "", "error: x=1 is named\n"))
    monkeypatch.setattr(script, "write_docs", lambda table: wrote.append(table))
    assert script.main(["--write"]) == 0
    assert len(wrote) == 1 and "| a bad input | `python -m distill train x=1` | 2 | error: x=1 is named |" in wrote[0]


@pytest.mark.parametrize("name", ["measure_auto_batch", "measure_few_row_linear", "measure_logit_cache",
                                  "measure_pruned_vocab"])
def test_an_out_that_is_a_file_is_refused_naming_it(tmp_path, name):
    """Found by a new user's trial: these four scripts made their --out folder with mkdir and ended in a
    FileExistsError/NotADirectoryError traceback when it was a file."""
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for d in ("target", "tokenizer", "draft-distilled"):  # the folders the scripts look for before --out
        (tmp_path / d).mkdir()
        (tmp_path / d / "config.json").write_text("{}")
    model = str(tmp_path / "target")
    pair = ["--pair", str(tmp_path)] if name in ("measure_auto_batch", "measure_few_row_linear") else (
        ["--target", model, "--draft", model] if name == "measure_logit_cache" else ["--tiny"])
    for out, message in ((afile, "is a file, not a folder; choose a folder path"),
                         (afile / "sub", "which is a file; choose a folder path")):
        r = subprocess.run([sys.executable, str(REPO / "scripts" / f"{name}.py"), *pair, "--out", str(out)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (out, r.stderr[-500:])
    assert afile.read_text() == "mine"


@pytest.mark.parametrize("extra, message", [
    (["--rounds", "0"], "--rounds 0 must be >= 1"), (["--temperatures", "a"], "--temperatures 'a': give numbers"),
    (["--baseline-rev", "no-such-rev"], "--baseline-rev 'no-such-rev': git show found no decode/sampling.py"),
    (["--pair", "/no/such/pair"], "lacks target, draft-distilled, tokenizer"),
])
def test_measure_sampling_ab_refuses_bad_arguments_before_measuring(tmp_path, extra, message):
    """Found by a new user's trial: these ended in tracebacks, --rounds 0 only after the whole measurement."""
    for d in ("target", "tokenizer", "draft-distilled"):
        (tmp_path / d).mkdir()
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "measure_sampling_ab.py"), "--pair", str(tmp_path),
                        "--baseline-rev", "HEAD", "--out", str(tmp_path / "ab.json"), *extra],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr[-500:]
    assert not (tmp_path / "ab.json").exists()
