"""``python -m decode loadtest``: N concurrent streaming clients against a server on this machine, for T seconds.

Each client sends ``POST /v1/completions`` with ``stream: true`` (usage in the last chunk) again and again until the
duration is over or ``--max-requests`` were sent; requests still running at the deadline finish. Reported:
errors (by kind), p50/p99 time to first token (TTFT: request sent to first text chunk), p50/p99 inter-token
latency (ITL: per request, (last chunk - first chunk) / (completion tokens - 1), so an accepted window that
arrives as one chunk counts as its tokens), aggregate tokens/s (Σ completion tokens / wall seconds), and the
server's RSS before and after (``/proc/PID/status`` with ``--server-pid``, else the server's
``process_resident_memory_bytes`` from ``/metrics``), the first reading after ``--warmup-requests`` uncounted
requests. Loopback only: it refuses any other host.
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx
from rich.console import Console
from rich.table import Table

from decode.outputs import check_output_file, write_results

MAX_CONCURRENCY, MAX_DURATION_S = 512, 3600.0


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def loopback_url(url: str) -> str:
    """``url`` without a trailing slash; raises ValueError unless its host is a loopback address."""
    parsed = urlparse(url)
    if parsed.scheme and parsed.scheme not in ("http", "https") and parsed.hostname:
        raise ValueError(f"--url {url!r}: the server speaks http (or https behind a proxy), not {parsed.scheme}; "
                         "e.g. http://127.0.0.1:8000")
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"--url {url!r} is not a full URL; give the scheme and host, e.g. http://127.0.0.1:8000")
    host = parsed.hostname
    ok = host == "localhost"
    if not ok:
        try:
            ok = ipaddress.ip_address(host).is_loopback
        except ValueError:
            ok = False
    if not ok:
        raise ValueError(f"--url host {host!r} is not a loopback address; the load test only targets this machine "
                         "(http://127.0.0.1:PORT)")
    return url.rstrip("/")


def server_rss(url: str, pid: int | None) -> int | None:
    """The server's resident memory in bytes, from ``/proc/PID/status`` or the server's ``/metrics``."""
    if pid is not None:
        rss = _proc_status(pid).get("VmRSS")
        return int(rss.split()[0]) * 1024 if rss else None
    text = httpx.get(url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("process_resident_memory_bytes "):
            return int(float(line.split()[1]))
    return None


def _proc_status(pid: int) -> dict[str, str]:
    """``/proc/PID/status`` as ``{field: value}``; ProcessLookupError for a process that has exited but is not yet
    reaped by its parent (a zombie still has the file), FileNotFoundError for none."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    if fields.get("State", "").split()[:1] in (["Z"], ["X"]):
        raise ProcessLookupError(f"process {pid} has exited (state {fields['State'].strip()})")
    return fields


def _running(pid: int) -> bool:
    """True if process ``pid`` exists and has not exited."""
    try:
        _proc_status(pid)
    except OSError:  # FileNotFoundError, ProcessLookupError
        return False
    return True


def rss_after_load(url: str, pid: int | None) -> int | None:
    """:func:`server_rss` after the load, or None with a warning when the server is gone (it crashed or was stopped
    during the run): the load's results are reported and written all the same."""
    try:
        return server_rss(url, pid)
    except (OSError, httpx.HTTPError) as err:
        print(f"warning: the server's memory could not be read after the load ({type(err).__name__}: {err}); did "
              "it stop during the run? rss_after_bytes is null", file=sys.stderr)
        return None


async def _one(client, url: str, body: dict, headers: dict) -> dict:
    t0 = time.perf_counter()
    t_first = t_last = None
    tokens, error, detail = 0, None, ""
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:  # the server's message, to say why when every request fails
                detail = (await r.aread()).decode(errors="replace")[:300]
                return {"error": f"http {r.status_code}", "detail": detail}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    error = f"stream error: {chunk['error'].get('code')}"
                    detail = str(chunk["error"].get("message", ""))[:300]  # the server's words, for the summary
                    continue
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("text") for c in chunk.get("choices", [])):
                    t_last = time.perf_counter()
                    t_first = t_first or t_last
    except Exception as err:  # a failed connection is a result here, not a crash of the tool
        return {"error": err.__class__.__name__}
    if error:
        return {"error": error, "detail": detail}
    out = {"tokens": tokens, "ttft_s": (t_first - t0) if t_first else None, "itl_s": None}
    if t_first is not None and tokens > 1:
        out["itl_s"] = (t_last - t_first) / (tokens - 1)
    return out


@dataclass
class _Run:
    """What the clients of one run share: the request to send, when to stop, and what came back."""

    url: str
    model: str
    prompts: list[str]
    max_tokens: int
    temperature: float
    headers: dict
    deadline: float
    max_requests: int
    start: float
    sent: int = 0
    gone_at: float | None = None  # seconds into the run when the server refused a connection
    results: list[dict] = field(default_factory=list)


async def _client_loop(run: _Run, worker: int, client: Any) -> None:
    """One client: send a request, wait for its whole stream, again, until the run is over."""
    while time.perf_counter() < run.deadline and run.sent < run.max_requests and run.gone_at is None:
        body = {"model": run.model, "prompt": run.prompts[(run.sent + worker) % len(run.prompts)],
                "max_tokens": run.max_tokens, "temperature": run.temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        run.sent += 1
        run.results.append(await _one(client, run.url, body, run.headers))
        if run.results[-1].get("error") == "ConnectError":  # refused: the server is gone; retrying at once made
            run.gone_at = run.gone_at or time.perf_counter() - run.start  # thousands of "requests" in a second


async def run_load(url: str, model: str, prompts: list[str], concurrency: int, duration_s: float, max_requests: int,
                   max_tokens: int, temperature: float, api_key: str | None) -> dict:
    """Run the clients; returns the raw per-request results and the wall time."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.perf_counter()
    run = _Run(url, model, prompts, max_tokens, temperature, headers, start + duration_s, max_requests, start)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        await asyncio.gather(*(_client_loop(run, i, client) for i in range(concurrency)))
    return {"results": run.results, "wall_s": time.perf_counter() - start, "server_gone_at_s": run.gone_at}


def summarize(raw: dict, concurrency: int, rss_before: int | None, rss_after: int | None) -> dict:
    """Pooled numbers of one run (see the module docstring for the definitions)."""
    results = raw["results"]
    ok = [r for r in results if "error" not in r]
    errors: dict[str, int] = {}
    for r in results:
        if "error" in r:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    itl = [r["itl_s"] for r in ok if r["itl_s"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    growth = (rss_after - rss_before) / rss_before if rss_before and rss_after else None
    return {"concurrency": concurrency, "requests": len(results), "errors": sum(errors.values()),
            "errors_by_kind": errors, "completion_tokens": tokens, "wall_s": raw["wall_s"],
            "tokens_per_s": tokens / raw["wall_s"] if raw["wall_s"] > 0 else 0.0,
            "ttft_p50_s": _percentile(ttft, 50), "ttft_p99_s": _percentile(ttft, 99),
            "itl_p50_s": _percentile(itl, 50), "itl_p99_s": _percentile(itl, 99),
            "rss_before_bytes": rss_before, "rss_after_bytes": rss_after, "rss_growth": growth,
            "server_gone_at_s": raw.get("server_gone_at_s")}


def print_table(summary: dict) -> None:
    table = Table(title=f"loadtest: {summary['concurrency']} concurrent streams")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        if key == "errors_by_kind":
            value = ", ".join(f"{k}: {v}" for k, v in value.items()) or "-"
        elif isinstance(value, float):
            value = f"{value:.4g}"
        table.add_row(key, "-" if value is None else str(value))
    Console().print(table)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m decode loadtest", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (loopback only)")
    p.add_argument("--model", default=None, help="model id (default: the first of GET /v1/models)")
    p.add_argument("--concurrency", type=int, default=16, help=f"concurrent streams, 1..{MAX_CONCURRENCY}")
    p.add_argument("--duration", type=float, default=30.0, help=f"seconds of sending, up to {MAX_DURATION_S:.0f}")
    p.add_argument("--max-requests", type=int, default=100_000, help="stop sending after this many requests")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable; default: a few code "
                   "prompts)")
    p.add_argument("--server-pid", type=int, default=None, help="read RSS from /proc/PID (default: /metrics)")
    p.add_argument("--api-key", default=os.environ.get("DRAFTKIT_API_KEY"),
                   help="the server's API key (default: $DRAFTKIT_API_KEY)")
    p.add_argument("--warmup-requests", type=int, default=None, help="requests sent (and not counted) before the "
                   "first RSS reading, so one-time allocations do not count as growth (default: --concurrency)")
    p.add_argument("--output", default=None, help="write the summary as JSON here (never overwritten)")
    return p


DEFAULT_PROMPTS = ["def fibonacci(n):\n", "import os\n\ndef list_files(path):\n", "class Stack:\n    def __init__",
                   "def parse_args(argv):\n    parser = ", "for i in range(10):\n"]


def _check_args(args: argparse.Namespace) -> None:
    """Every check that needs no server; raises ValueError naming the option and the fix."""
    if not 1 <= args.concurrency <= MAX_CONCURRENCY:
        raise ValueError(f"--concurrency must be in 1..{MAX_CONCURRENCY}, got {args.concurrency}")
    if not 0 < args.duration <= MAX_DURATION_S:
        raise ValueError(f"--duration must be in (0, {MAX_DURATION_S:.0f}] seconds, got {args.duration}")
    if args.max_requests < 1 or args.max_tokens < 1:
        raise ValueError("--max-requests and --max-tokens must be >= 1")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):  # NaN would fail every request client-side
        raise ValueError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if args.warmup_requests is not None and args.warmup_requests < 0:
        raise ValueError(f"--warmup-requests must be >= 0 (0: no warm-up), got {args.warmup_requests}")
    if args.server_pid is not None and not _running(args.server_pid):
        raise ValueError(f"--server-pid {args.server_pid}: no running process on this machine; pass the server's pid "
                         "or omit it to read the RSS from /metrics")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    url = loopback_url(args.url)
    _check_args(args)
    # Checked here, ~ expanded, before check_output_file, whose message would suggest an --overwrite loadtest lacks.
    if args.output and os.path.exists(os.path.expanduser(args.output)):
        raise FileExistsError(f"--output {args.output!r} exists; pick a new path (results are never overwritten)")
    if args.output:
        args.output = str(check_output_file(args.output, "--output"))  # folder exists, is writable; ~ expanded
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        # the key is checked here too (with --model given, every request would otherwise fail with a 401)
        answer = httpx.get(url + "/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as err:
        raise ValueError(f"no server answers at {url} ({err.__class__.__name__}); start `python -m decode serve` "
                         "first") from err
    if answer.status_code == 401:
        given = "refused the one given" if args.api_key else "none was given"
        raise ValueError(f"the server at {url} wants an API key and {given}: pass the server's key with --api-key KEY "
                         "or DRAFTKIT_API_KEY=KEY")
    try:
        served = [m["id"] for m in answer.json()["data"]]
        model = args.model or served[0]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(f"{url}/v1/models answered HTTP {answer.status_code} without a model list "
                         f"({answer.text[:200]!r}); is it a `python -m decode serve` server?") from None
    if model not in served:
        raise ValueError(f"--model {model!r} is not served at {url}; it serves {served} (omit --model for the first)")
    warmup = args.concurrency if args.warmup_requests is None else args.warmup_requests
    if warmup > 0:
        warm = asyncio.run(run_load(url, model, args.prompt or DEFAULT_PROMPTS, min(args.concurrency, warmup),
                                    MAX_DURATION_S, warmup, args.max_tokens, args.temperature, args.api_key))
        failed = [r for r in warm["results"] if "error" in r]
        if failed and len(failed) == len(warm["results"]):  # the settings are refused: do not hammer the server
            raise ValueError(f"every warm-up request failed ({failed[0]['error']}: {failed[0].get('detail', '')!r}); "
                             "check --max-tokens, --temperature and --prompt against the server's limits")
    try:
        rss_before = server_rss(url, args.server_pid)
    except (OSError, httpx.HTTPError) as err:  # stopped during or right after the warm-up
        raise ValueError(f"the server at {url} stopped answering after the warm-up ({type(err).__name__}: {err}); "
                         "no load was run and nothing was written: start it again") from None
    raw = asyncio.run(run_load(url, model, args.prompt or DEFAULT_PROMPTS, args.concurrency, args.duration,
                               args.max_requests, args.max_tokens, args.temperature, args.api_key))
    summary = summarize(raw, args.concurrency, rss_before, rss_after_load(url, args.server_pid))
    summary.update(model=model, max_tokens=args.max_tokens, temperature=args.temperature, duration_s=args.duration,
                   warmup_requests=warmup)
    if summary["server_gone_at_s"] is not None:
        print(f"warning: the server refused connections {summary['server_gone_at_s']:.1f} s into the run (it is "
              "gone): the clients stopped there; the numbers cover the run up to then", file=sys.stderr)
    print_table(summary)
    if args.output:
        write_results(json.dumps(summary, indent=2), args.output, key="--output")
    return 0 if summary["errors"] == 0 else 1
