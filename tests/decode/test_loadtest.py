"""``python -m decode loadtest`` against a real server on loopback: bounded, counts errors, reports latencies,
tokens/s and the server's RSS, writes JSON without overwriting."""
import asyncio
import json
import os
import time

import pytest

from decode.serving import loadtest
from decode.serving.parsing import ServerLimits
from tests.decode.server_helpers import MODEL, running_server, tiny_pair


def test_loadtest_reports_and_writes_json(tmp_path, capsys):
    dec, tok = tiny_pair()
    out = tmp_path / "load.json"
    with running_server(dec, tok, max_batch_size=4) as (url, _, _):
        rc = loadtest.main(["--url", url, "--concurrency", "4", "--duration", "1.0", "--max-tokens", "8",
                            "--prompt", "w5", "--prompt", "w7 w8", "--server-pid", str(os.getpid()),
                            "--output", str(out)])
        assert rc == 0
        with pytest.raises(FileExistsError, match="never overwritten"):
            loadtest.main(["--url", url, "--duration", "1", "--output", str(out)])
        capped = asyncio.run(loadtest.run_load(url, MODEL, ["w5"], 2, 30.0, 3, 4, 0.0, None))
    summary = json.loads(out.read_text())
    assert summary["errors"] == 0 and summary["requests"] >= 4 and summary["model"] == MODEL
    assert summary["completion_tokens"] > 0 and summary["tokens_per_s"] > 0
    assert 0 < summary["ttft_p50_s"] <= summary["ttft_p99_s"]
    assert summary["itl_p50_s"] is not None and summary["rss_before_bytes"] > 0 and summary["rss_after_bytes"] > 0
    assert "tokens_per_s" in capsys.readouterr().out  # the table
    assert len(capped["results"]) == 3 and all("error" not in r for r in capped["results"])  # bounded count


def test_loadtest_refuses_other_hosts_and_bad_bounds():
    with pytest.raises(ValueError, match="loopback"):
        loadtest.main(["--url", "http://example.com:8000"])
    with pytest.raises(ValueError, match="concurrency"):
        loadtest.main(["--url", "http://127.0.0.1:1", "--concurrency", "0"])
    with pytest.raises(ValueError, match="no server answers"):
        loadtest.main(["--url", "http://127.0.0.1:1", "--duration", "1"])


def test_loadtest_without_the_server_s_key_is_a_clear_error(monkeypatch):
    """README starts the server with DRAFTKIT_API_KEY; a loadtest without the key crashed with KeyError: 'data'."""
    monkeypatch.delenv("DRAFTKIT_API_KEY", raising=False)
    dec, tok = tiny_pair()
    with running_server(dec, tok, api_key="sk-right") as (url, _, _):
        with pytest.raises(ValueError, match="wants an API key and none was given: pass the server's key"):
            loadtest.main(["--url", url, "--duration", "1"])
        with pytest.raises(ValueError, match="refused the one given"):
            loadtest.main(["--url", url, "--duration", "1", "--api-key", "sk-wrong"])
        monkeypatch.setenv("DRAFTKIT_API_KEY", "sk-right")  # the documented default of --api-key
        assert loadtest.main(["--url", url, "--duration", "0.5", "--concurrency", "1", "--max-tokens", "2"]) == 0


def test_summary_counts_errors_by_kind():
    raw = {"results": [{"error": "http 429"}, {"error": "http 429"}, {"tokens": 5, "ttft_s": 0.1, "itl_s": 0.01}],
           "wall_s": 2.0}
    s = loadtest.summarize(raw, 3, 100, 110)
    assert s["errors"] == 2 and s["errors_by_kind"] == {"http 429": 2}
    assert s["tokens_per_s"] == 2.5 and s["rss_growth"] == pytest.approx(0.1) and s["ttft_p50_s"] == 0.1


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "nan"], "--temperature must be a finite number"),  # was: every request failed, NaN in the JSON
    (["--temperature", "-1"], "--temperature must be a finite number"),
    (["--warmup-requests", "-3"], "--warmup-requests must be >= 0"),
    (["--server-pid", "999999999"], "--server-pid 999999999: no running process"),  # was: an OSError after warm-up
])
def test_loadtest_refuses_bad_settings_before_contacting_the_server(argv, message):
    """Port 1 has no server: a check made after contacting it would say 'no server answers' instead."""
    with pytest.raises(ValueError, match=message):
        loadtest.main(["--url", "http://127.0.0.1:1", "--duration", "1", *argv])
    with pytest.raises(ValueError, match="not a full URL.*http://127.0.0.1:8000"):  # was: "host '' is not loopback"
        loadtest.main(["--url", "127.0.0.1:8000"])
    with pytest.raises(ValueError, match="speaks http .*not ftp"):  # was: "is not a full URL"
        loadtest.main(["--url", "ftp://127.0.0.1:8000"])


def test_an_exited_server_pid_not_yet_reaped_is_not_running():
    """Found by the re-test trial: a server that had exited but was not yet reaped (a zombie) still has
    /proc/PID/status, so it passed as running and its memory read as null."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.time() + 30
    while time.time() < deadline and "Z" not in open(f"/proc/{child.pid}/status").read().split("State:")[1][:4]:
        time.sleep(0.05)
    try:
        with pytest.raises(ValueError, match=f"--server-pid {child.pid}: no running process"):
            loadtest.main(["--url", "http://127.0.0.1:1", "--duration", "1", "--server-pid", str(child.pid)])
        with pytest.raises(ProcessLookupError, match="has exited"):
            loadtest.server_rss("", child.pid)
    finally:
        child.wait()
    assert loadtest.server_rss("", os.getpid()) > 0


def test_loadtest_stops_when_the_server_refuses_the_settings():
    """An unknown --model or a --max-tokens above the server's limit failed every request for the whole duration
    (hundreds per second) and exited 1 with only 'http 400' to go on."""
    dec, tok = tiny_pair()
    with running_server(dec, tok, limits=ServerLimits(max_tokens=8)) as (url, _, _):
        with pytest.raises(ValueError, match=f"--model 'nosuch' is not served.*'{MODEL}'"):
            loadtest.main(["--url", url, "--duration", "1", "--model", "nosuch"])
        with pytest.raises(ValueError, match="every warm-up request failed \\(http 400: .*max_tokens=9"):
            loadtest.main(["--url", url, "--duration", "1", "--concurrency", "1", "--max-tokens", "9"])


def test_loadtest_output_that_appears_during_the_run_is_kept_with_the_results_beside_it(tmp_path, monkeypatch,
                                                                                      capsys):
    """The output was opened with mode 'x' at the end: a file made meanwhile made the finished run exit 2 with no
    results written."""
    out = tmp_path / "load.json"
    monkeypatch.setattr(loadtest, "print_table", lambda summary: out.write_text("theirs"))
    dec, tok = tiny_pair()
    with running_server(dec, tok) as (url, _, _):
        rc = loadtest.main(["--url", url, "--duration", "0.5", "--concurrency", "1", "--max-tokens", "2",
                            "--output", str(out)])
    assert rc == 0 and out.read_text() == "theirs"
    err = capsys.readouterr().err
    assert "appeared during the run and was kept" in err
    beside = [p for p in tmp_path.iterdir() if p != out]
    assert len(beside) == 1 and json.loads(beside[0].read_text())["errors"] == 0 and str(beside[0]) in err


@pytest.mark.parametrize("pid", [False, True])
def test_loadtest_keeps_its_results_when_the_server_is_gone_after_the_load(tmp_path, monkeypatch, capsys, pid):
    """A server that stopped during the run made the final memory reading raise (a ConnectError traceback, or with
    --server-pid a missing /proc file, exit 2): no table and no JSON for the requests that ran."""
    import httpx

    real, calls = loadtest.server_rss, []

    def gone_after_the_load(url, server_pid):
        calls.append(url)
        if len(calls) == 1:
            return real(url, server_pid)
        raise FileNotFoundError(f"/proc/{server_pid}/status") if pid else httpx.ConnectError("Connection refused")

    monkeypatch.setattr(loadtest, "server_rss", gone_after_the_load)
    out = tmp_path / "load.json"
    dec, tok = tiny_pair()
    with running_server(dec, tok) as (url, _, _):
        rc = loadtest.main(["--url", url, "--duration", "0.5", "--concurrency", "1", "--max-tokens", "2",
                            "--output", str(out), *(["--server-pid", str(os.getpid())] if pid else [])])
    summary = json.loads(out.read_text())
    assert rc == 0 and summary["requests"] >= 1 and summary["rss_after_bytes"] is None and len(calls) == 2
    assert "could not be read after the load" in capsys.readouterr().err


@pytest.mark.parametrize("pid", [False, True])
def test_a_server_gone_after_the_warm_up_is_a_clear_error(tmp_path, monkeypatch, pid):
    """Found by a new user: a server stopped during the warm-up made the first memory reading raise (a ConnectError
    traceback, exit 1)."""
    import httpx

    def gone(url, server_pid):
        raise FileNotFoundError(f"/proc/{server_pid}/status") if pid else httpx.ConnectError("Connection refused")

    monkeypatch.setattr(loadtest, "server_rss", gone)
    out = tmp_path / "load.json"
    dec, tok = tiny_pair()
    with running_server(dec, tok) as (url, _, _):
        with pytest.raises(ValueError, match=r"stopped answering after the warm-up \((FileNotFoundError|ConnectError)"
                                             r".*no load was run and nothing was written"):
            loadtest.main(["--url", url, "--duration", "0.5", "--concurrency", "1", "--max-tokens", "2",
                           "--output", str(out), *(["--server-pid", str(os.getpid())] if pid else [])])
    assert not out.exists()


def test_a_stream_error_keeps_the_server_s_message():
    """'every warm-up request failed (stream error: internal_error: '')': the message of the error event was lost."""
    import httpx

    event = {"error": {"message": "internal error while decoding: RuntimeError: boom", "code": "internal_error"}}
    sse = f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n"
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=sse))

    async def one():
        async with httpx.AsyncClient(transport=transport) as client:
            return await loadtest._one(client, "http://127.0.0.1:1", {}, {})

    assert asyncio.run(one()) == {"error": "stream error: internal_error",
                                  "detail": "internal error while decoding: RuntimeError: boom"}


def test_the_clients_stop_when_the_server_is_gone_instead_of_counting_refusals():
    """A server killed during the run: every client retried at once, 9149 "requests" (9136 ConnectError) in 2 s."""
    raw = asyncio.run(loadtest.run_load("http://127.0.0.1:1", MODEL, ["w5"], 4, 5.0, 100_000, 4, 0.0, None))
    assert 1 <= len(raw["results"]) <= 4 and all(r["error"] == "ConnectError" for r in raw["results"])
    assert raw["server_gone_at_s"] is not None and raw["wall_s"] < 5.0
    summary = loadtest.summarize(raw, 4, None, None)
    assert summary["server_gone_at_s"] == raw["server_gone_at_s"] and summary["requests"] == len(raw["results"])


def test_loadtest_output_under_home_is_written_there(tmp_path, monkeypatch):
    """--output '~/load.json' (quoted, so the shell leaves ~) was checked in the expanded folder but written to a
    literal '~' folder: the finished run failed on its last line."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    dec, tok = tiny_pair()
    with running_server(dec, tok) as (url, _, _):
        assert loadtest.main(["--url", url, "--duration", "0.5", "--concurrency", "1", "--max-tokens", "2",
                              "--output", "~/load.json"]) == 0
    assert json.loads((tmp_path / "load.json").read_text())["errors"] == 0 and not (tmp_path / "~").exists()


def test_an_existing_output_under_home_is_refused_without_naming_a_flag_loadtest_lacks(tmp_path, monkeypatch):
    """A quoted '~/load.json' that exists got check_output_file's "pass --overwrite", a flag loadtest has not."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "load.json").write_text("mine")
    with pytest.raises(FileExistsError, match="never overwritten"):
        loadtest.main(["--url", "http://127.0.0.1:1", "--duration", "1", "--output", "~/load.json"])
    assert (tmp_path / "load.json").read_text() == "mine"
