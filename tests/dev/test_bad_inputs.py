"""dev/bad_inputs.py's own command line: --help and a misspelled flag run no case and write nothing; --write runs
every case and writes the table."""
import subprocess

import pytest

from dev import bad_inputs as script


@pytest.mark.parametrize("argv, code", [(["--help"], 0), (["--wirte"], 2)])
def test_help_and_unknown_flags_run_no_case(argv, code, monkeypatch, capsys):
    ran, wrote = [], []
    monkeypatch.setattr(script, "run_case", lambda *a: ran.append(a))
    monkeypatch.setattr(script, "write_docs", lambda *a: wrote.append(a))
    with pytest.raises(SystemExit) as stop:
        script.main(argv)
    assert stop.value.code == code and ran == [] and wrote == []
    shown = capsys.readouterr()
    assert "--write" in (shown.out if code == 0 else shown.err)  # the usage names the one flag


def test_write_runs_the_cases_and_writes_the_table(monkeypatch, capsys):
    """The loop's variables must not shadow the parsed options, or --write runs every case and then crashes."""
    wrote = []
    monkeypatch.setattr(script, "CASES", [("a bad input", "train x=1", "named")])
    monkeypatch.setattr(script, "make_fixtures", lambda tmp: {})
    monkeypatch.setattr(script, "case_command", lambda args, fields: ("distill", ["train", "x=1"]))
    monkeypatch.setattr(script, "run_case", lambda module, argv: subprocess.CompletedProcess(
        argv, 2, "", "error: x=1 is named\n"))
    monkeypatch.setattr(script, "write_docs", lambda table: wrote.append(table))
    assert script.main(["--write"]) == 0
    assert len(wrote) == 1 and "| a bad input | `python -m distill train x=1` | 2 | error: x=1 is named |" in wrote[0]
