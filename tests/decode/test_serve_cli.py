"""``python -m decode serve`` command line: settings checked before any model loads, the key from the environment,
the warning for a non-loopback bind without a key, and a real run stopped by SIGTERM."""
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

import decode.__main__
import decode.certify
import decode.loading
import decode.serving
import decode.serving.cli
from decode import costs
from decode.__main__ import main as decode_main
from decode.serving.cli import bind_warning, main, serve_parser, served_model_name
from tests.conftest import make_tokenizer, perturbed_copy, tiny_llama


def refuse_model_loads(monkeypatch):
    """Fail the test when a command loads a model: each command module holds its own ``load_causal_lm``."""
    for module in (decode.loading, decode.__main__, decode.serving.cli, decode.certify):
        monkeypatch.setattr(module, "load_causal_lm", lambda *a, **k: pytest.fail("a model was loaded"))


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("DRAFTKIT_API_KEY", "from-env")
    assert serve_parser().parse_args(["--target", "t"]).api_key == "from-env"
    assert serve_parser().parse_args(["--target", "t", "--api-key", "flag"]).api_key == "flag"
    monkeypatch.delenv("DRAFTKIT_API_KEY")
    assert serve_parser().parse_args(["--target", "t"]).api_key is None
    monkeypatch.setenv("DRAFTKIT_API_KEY", "from-file\n")  # a key file's newline is not part of the key
    assert serve_parser().parse_args(["--target", "t"]).api_key == "from-file"


def test_empty_api_key_in_the_environment_exits_2(monkeypatch, capsys):
    """DRAFTKIT_API_KEY set but empty used to start a server whose key nobody could match (or, stripped, one that
    accepted an empty bearer token); now it is a usage error before any model loads."""
    monkeypatch.setenv("DRAFTKIT_API_KEY", "  ")
    with pytest.raises(SystemExit) as exc:
        main(["--target", "/nonexistent"])
    assert exc.value.code == 2 and "API key is empty" in capsys.readouterr().err


def test_bind_warning_only_off_loopback_without_key():
    assert bind_warning("127.0.0.1", 8000, None) is None
    assert bind_warning("::1", 8000, None) is None and bind_warning("localhost", 8000, None) is None
    assert "without an API key" in bind_warning("0.0.0.0", 8000, None)
    assert bind_warning("0.0.0.0", 8000, "k") is None


@pytest.mark.parametrize("args,needle", [(["--port", "99999"], "--port must be in 0..65535"),
                                         (["--port", "http"], "--port must be an integer"),
                                         (["--max-batch-size", "0"], "--max-batch-size must be >= 1"),
                                         (["-g", "-1"], "num-draft-tokens"),
                                         (["--graceful-shutdown-s", "nan"], "--graceful-shutdown-s must be a finite"),
                                         (["--graceful-shutdown-s", "-5"], "--graceful-shutdown-s must be a finite"),
                                         (["--graceful-shutdown-s", "soon"], "number of seconds"),
                                         (["--body-timeout-s", "0"], "--body-timeout-s must be a finite number > 0"),
                                         # 1e10 s overflowed the thread join of the shutdown (OverflowError)
                                         (["--graceful-shutdown-s", "1e10"], "must be at most 1e+06 seconds"),
                                         (["--prompt-lookup-ngram", "-1"], "--prompt-lookup-ngram must be >= 0"),
                                         (["--api-key", " "], "API key is empty")])
def test_bad_settings_exit_2_before_loading(args, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--target", "/nonexistent", *args])
    assert exc.value.code == 2 and needle in capsys.readouterr().err


def test_prompt_lookup_without_a_draft_is_refused_before_loading():
    with pytest.raises(ValueError, match="--prompt-lookup-ngram=2 needs a draft model"):  # python -m decode: exit 2
        main(["--target", "/nonexistent", "--prompt-lookup-ngram", "2"])


def test_port_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(ValueError, match="cannot listen on 127.0.0.1"):
            main(["--target", "/nonexistent", "--port", str(s.getsockname()[1])])


@pytest.mark.parametrize("extra", [[], ["--compile", "draft", "--max-batch-size", "4"]], ids=["eager", "compiled"])
def test_serve_subprocess_with_key_then_sigterm(tmp_path, extra):
    """A real `decode serve` process on --port 0: the system picks a free port (no other test or pytest-xdist worker
    can take it between choosing and binding, as it could when the test chose one), and uvicorn's startup line
    names it. With --compile draft the graphs are compiled before uvicorn starts (the warm-up lines come first)."""
    tok = make_tokenizer()
    target = tiny_llama(seed=0).float()
    for name, model in (("target", target), ("draft", perturbed_copy(target, 0.3))):
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", DRAFTKIT_API_KEY="k1")
    proc = subprocess.Popen([sys.executable, "-m", "decode", "serve", "--target", str(tmp_path / "target"),
                             "--draft", str(tmp_path / "draft"), "-g", "3", "--port", "0", *extra], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        started = re.compile(r"Uvicorn running on (http://127\.0\.0\.1:\d+)")
        deadline, url = time.time() + (600 if extra else 120), None
        while url is None and time.time() < deadline and proc.poll() is None:
            match = next(filter(None, map(started.search, list(lines))), None)
            if match:
                url = match.group(1)
            else:
                time.sleep(0.1)
        assert url is not None and not url.endswith(":0"), "".join(lines)
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 200 and health.json()["compile"] == ("draft" if extra else False)
        assert health.json()["num_draft_tokens"] == 3 and health.json()["warning"] is None
        body = {"model": "target", "prompt": "w5", "max_tokens": 4, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 401
        r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer k1"}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        reader.join(timeout=10)
    err = "".join(lines)
    # uvicorn shuts down gracefully, then re-raises the signal so the exit status says SIGTERM.
    assert proc.returncode in (0, -signal.SIGTERM), err
    assert "Application shutdown complete" in err and "Traceback" not in err
    assert "without an API key" not in err
    costs_line = err.index("warm-up: measuring the draft/target costs that check γ = 3")  # the slowdown check's
    assert costs_line < err.index("Uvicorn running on")
    if extra:
        warm = err.index("warm-up: compiling the forwards' graphs for batch sizes up to 4")
        assert warm < err.index("warm-up done in") < err.index("Uvicorn running on")


def test_compile_draft_without_a_draft_is_refused_before_loading(tmp_path, monkeypatch):
    refuse_model_loads(monkeypatch)
    with pytest.raises(ValueError, match="--compile draft compiles the draft's forwards, but no --draft"):
        main(["--target", str(tmp_path), "--port", "0", "--compile", "draft"])


def test_compile_without_a_cpp_compiler_exits_2_before_loading(tmp_path, monkeypatch, capsys):
    from torch._inductor import config as inductor_config


    refuse_model_loads(monkeypatch)
    monkeypatch.setattr(inductor_config.cpp, "cxx", (None, str(tmp_path / "no" / "g++")))
    assert decode_main(["serve", "--target", str(tmp_path), "--draft", str(tmp_path), "--port", "0",
                        "--device", "cpu", "--compile"]) == 2
    assert "--compile: torch.compile needs a working C++ compiler" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_model_path_is_checked_before_the_target_loads(command, tmp_path, monkeypatch, capsys):
    """A missing --tokenizer used to be noticed after the target had loaded, with the hub's "Repo id must use
    alphanumeric chars" message; now every path is named before any load."""
    refuse_model_loads(monkeypatch)
    (tmp_path / "target").mkdir()
    missing = str(tmp_path / "no-tokenizer")
    extra = ["--prompt", "x"] if command == "generate" else []
    assert decode_main([command, "--target", str(tmp_path / "target"), "--tokenizer", missing, *extra]) == 2
    assert f"--tokenizer path {missing!r} does not exist" in capsys.readouterr().err


def test_served_model_name_of_a_hub_id_is_the_id():
    """Found by a new user serving a cached hub id: the default name was its last part, so an OpenAI client that
    sent model="org/name" (vLLM's default id) got 404."""
    assert served_model_name("org/name") == "org/name"
    assert served_model_name("/ckpt/runs/target/") == served_model_name("./target") == "target"
    assert served_model_name("org/name", "mine") == "mine"


@pytest.mark.parametrize("command", ["serve", "certify"])
def test_an_uncached_hub_id_offline_exits_2_before_any_load(command, hub_cache, monkeypatch, capsys):
    refuse_model_loads(monkeypatch)
    monkeypatch.setattr(decode.loading, "load_tokenizer", lambda *a, **k: pytest.fail("a tokenizer was loaded"))
    extra = ["--draft", "org/draft"] if command == "certify" else []
    assert decode_main([command, "--target", "org/not-cached", *extra]) == 2
    assert "--target 'org/not-cached' is not a local folder, and as a hub id it is not in the local Hugging Face " \
           "cache" in capsys.readouterr().err


@pytest.mark.parametrize("gamma_args,line", [
    ([], "warm-up: measuring auto γ's cost model for batch sizes up to 4"),
    (["-g", "4"], "warm-up: measuring the draft/target costs that check γ = 4 against the acceptance measured "
                  "while serving"),
], ids=["default", "fixed"])
def test_serve_defaults_to_auto_and_measures_the_costs_of_a_fixed_gamma(gamma_args, line, tmp_path, monkeypatch,
                                                                        capsys):
    """Found by a new user: serve's default γ was a fixed 4, slower than the target alone with a weak draft. With a
    draft the default is auto (its cost model measured before the server listens); a fixed γ has its costs at batch
    size 1 measured there too, for the slowdown check."""
    assert serve_parser().parse_args(["--target", "t"]).num_draft_tokens is None
    tok = make_tokenizer()
    target = tiny_llama(seed=0).float()
    for name, model in (("target", target), ("draft", perturbed_copy(target, 0.3))):
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    seen = []

    def interrupted(decoder, *args, **kwargs):  # stop at the measurement, before the server listens
        seen.append(decoder.num_draft_tokens)
        raise KeyboardInterrupt

    monkeypatch.setattr(costs, "calibrate", interrupted)
    code = decode_main(["serve", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
                        "--max-batch-size", "4", "--port", "0", *gamma_args])
    err = capsys.readouterr().err
    assert code == 130 and seen == (["auto"] if not gamma_args else [4]) and line in err


def test_ctrl_c_during_the_warm_up_exits_130_without_a_traceback(tmp_path, monkeypatch, capsys):
    """The warm-up (--compile, or -g auto) runs before the server listens, up to minutes on a CPU: Ctrl-C there
    stops the command with exit 130 and one line, as a Ctrl-C while serving stops it cleanly."""
    tok = make_tokenizer()
    target = tiny_llama(seed=0).float()
    for name, model in (("target", target), ("draft", perturbed_copy(target, 0.3))):
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    calls = []

    def interrupted(decoder, max_batch_size=16):
        calls.append(max_batch_size)
        raise KeyboardInterrupt

    monkeypatch.setattr(costs, "warm_up", interrupted)
    code = decode_main(["serve", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
                        "-g", "auto", "--max-batch-size", "4", "--port", "0"])
    err = capsys.readouterr().err
    assert code == 130 and calls == [4]
    assert "warm-up: measuring auto γ's cost model for batch sizes up to 4" in err
    assert "interrupted before the server listened" in err and "Traceback" not in err


@pytest.mark.parametrize("command,module", [("serve", "prometheus_client"), ("serve", "fastapi"),
                                            ("serve", "uvicorn"), ("loadtest", "httpx")])
def test_a_missing_serve_extra_exits_2_naming_it_before_any_load(command, module, tmp_path, monkeypatch, capsys):
    """Without the serve extra, `decode serve` died with a ModuleNotFoundError traceback."""
    assert decode.serving.missing_serve_modules(command) == []
    refuse_model_loads(monkeypatch)
    monkeypatch.setitem(sys.modules, module, None)  # what an environment without the module gives an import
    args = ["--target", str(tmp_path)] if command == "serve" else ["--url", "http://127.0.0.1:1"]
    assert decode_main([command, *args]) == 2
    err = capsys.readouterr().err
    assert f"python -m decode {command} needs the serve extra: pip install 'draftkit[serve]' (missing: {module})" \
        in err and "Traceback" not in err
