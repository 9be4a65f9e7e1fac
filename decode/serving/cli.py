"""``python -m decode serve``: load the pair and run the OpenAI-compatible server with uvicorn."""
from __future__ import annotations

import argparse
import ipaddress
import math
import os
import socket
import sys
from typing import Any

from decode import costs
from decode.cli_args import (DEFAULT_NUM_DRAFT_TOKENS, add_draft_tokenizer_arg, check_draft_tokenizer_arg,
                             command_gamma, fixed_gamma_cost_model, num_draft_tokens_arg)
from decode.compiling import check_cpu_compiler, compile_setting
from decode.engine import SpeculativeDecoder
from decode.loading import (check_cached, check_device, load_causal_lm, load_draft_tokenizer, load_target_tokenizer,
                            looks_local)
from decode.lookup import check_prompt_lookup
from decode.serving.app import create_app, make_server
from decode.serving.parsing import ServerLimits

API_KEY_ENV = "DRAFTKIT_API_KEY"


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--port must be an integer in 0..65535, got {value!r}")
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"--port must be in 0..65535 (0: any free port), got {port}")
    return port


def _positive(name: str, allow_zero: bool = False):
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {value!r}")
        if n < (0 if allow_zero else 1):
            raise argparse.ArgumentTypeError(f"{name} must be >= {0 if allow_zero else 1}, got {n}")
        return n
    return parse


MAX_SECONDS = 1e6  # about 11.6 days: any longer wait is a typo


def _seconds(name: str, zero: bool = True):
    def parse(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number of seconds, got {value!r}")
        if not math.isfinite(x) or x < 0 or (x == 0 and not zero):
            raise argparse.ArgumentTypeError(f"{name} must be a finite number {'>=' if zero else '>'} 0, got {value!r}")
        if x > MAX_SECONDS:  # beyond threading.TIMEOUT_MAX, a thread join overflows
            raise argparse.ArgumentTypeError(f"{name} must be at most {MAX_SECONDS:g} seconds, got {value!r}")
        return x
    return parse


def _api_key(value: str) -> str:
    # Also applied to the default (the environment variable). Surrounding whitespace (a key file's newline) is not
    # part of the key; an empty key is refused rather than read as "no key".
    key = value.strip()
    if not key:
        raise argparse.ArgumentTypeError(f"the API key is empty; give a key, or unset {API_KEY_ENV} and leave out "
                                         "--api-key to serve without one")
    return key


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m decode serve",
                                description="Serve the speculative decoder with an OpenAI-compatible HTTP API.")
    p.add_argument("--target", required=True, help="target checkpoint: local path or hub id")
    p.add_argument("--draft", default=None, help="draft checkpoint (omit for plain target decoding)")
    p.add_argument("--tokenizer", default=None, help="tokenizer path (default: the target's)")
    add_draft_tokenizer_arg(p)
    p.add_argument("--num-draft-tokens", "-g", type=num_draft_tokens_arg, default=None,
                   help=f"γ, or 'auto' (default with --draft: {DEFAULT_NUM_DRAFT_TOKENS}, the cost model measured "
                   "before the server listens, γ chosen each step, 0 where drafting does not pay); a fixed γ > 0 is "
                   "checked against the acceptance measured while serving (a warning when it predicts a slowdown)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 | auto")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the target "
                   "folder's name, or the hub id as given)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1, this machine only)")
    p.add_argument("--port", type=_port, default=8000,
                   help="TCP port (default 8000; 0: a free port chosen by the system, printed at startup as "
                   "'Uvicorn running on http://HOST:PORT')")
    p.add_argument("--api-key", type=_api_key, default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}; prefer the "
                   "variable: command lines are visible to other users)")
    p.add_argument("--max-batch-size", type=_positive("--max-batch-size"), default=16,
                   help="requests decoded together; later ones wait (default 16)")
    p.add_argument("--max-queue", type=_positive("--max-queue", True), default=64,
                   help="waiting requests before answering 429 (default 64)")
    p.add_argument("--max-body-bytes", type=_positive("--max-body-bytes"), default=1 << 20)
    p.add_argument("--body-timeout-s", type=_seconds("--body-timeout-s", zero=False), default=30.0,
                   help="seconds from a request's headers to its body's last byte; 408 after (default 30)")
    p.add_argument("--max-tokens-limit", type=_positive("--max-tokens-limit"), default=None,
                   help="largest max_tokens a request may ask for (default: the target's context)")
    p.add_argument("--max-prompt-tokens", type=_positive("--max-prompt-tokens"), default=None,
                   help="longest prompt in tokens (default: the target's context - 1)")
    p.add_argument("--compile", nargs="?", const="both", choices=["both", "draft"], default=None,
                   help="run the forwards through torch.compile: --compile draft (the draft's only, the fastest "
                   "measured setting on CPU) or --compile / --compile both (both models); the graphs are compiled "
                   "before the server listens (about a minute per model on a CPU)")
    p.add_argument("--prompt-lookup-ngram", type=_positive("--prompt-lookup-ngram", True), default=0, metavar="N",
                   help="for greedy requests (temperature 0), while the last N tokens occurred earlier, draft the "
                   "tokens that followed them instead of the draft's guesses (prompt lookup, decode.lookup; 0: off, "
                   "the default)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow checkpoints to run their own Python modeling/tokenizer code (off by default; read it first)")
    p.add_argument("--graceful-shutdown-s", type=_seconds("--graceful-shutdown-s"), default=30.0,
                   help="on Ctrl-C/SIGTERM, wait this long for running requests to finish")
    return p


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_bind(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            raise ValueError(f"cannot listen on {host}:{port} ({err.strerror}); pick another --port or --host")


def bind_warning(host: str, port: int, api_key: str | None) -> str | None:
    """The warning printed when the server listens beyond this machine without a key (else None)."""
    if _is_loopback(host) or api_key:
        return None
    return (f"warning: binding {host}:{port} without an API key: anyone who can reach this address can use the "
            f"models. Set {API_KEY_ENV} (or --api-key) to require a key.")


def served_model_name(target: str, override: str | None = None) -> str:
    """The model id clients send: ``override`` (``--served-model-name``) if given, else a local target folder's name,
    or a hub id as given (``org/name``, as vLLM serves it; its last part alone was answered 404)."""
    if override:
        return override
    return os.path.basename(os.path.normpath(target)) if looks_local(target) else str(target)


def _load_and_warm_up(args: argparse.Namespace, device: Any, compile_: bool | str) -> tuple[Any, Any, dict | None]:
    """Load the pair and tokenizer, build the decoder and warm it up (compiled graphs, auto γ's cost model) before
    the server listens, so no request waits for either. Returns ``(decoder, tokenizer, cost_model)``: with a fixed
    γ > 0 and a draft (no prompt lookup), the cost model at batch size 1 that prices the slowdown check
    (:func:`decode.cli_args.fixed_gamma_cost_model`), else None."""
    trust = args.trust_remote_code
    target = load_causal_lm(args.target, "target", args.dtype, device, trust_remote_code=trust)
    tok = load_target_tokenizer(args.tokenizer, args.target, trust)
    draft = load_causal_lm(args.draft, "draft", args.dtype, device, trust_remote_code=trust) if args.draft else None
    draft_tok = load_draft_tokenizer(args.draft, tok, trust, args.draft_tokenizer) if args.draft else None
    gamma = command_gamma(args.num_draft_tokens, draft is not None)
    dec = SpeculativeDecoder(target, draft, gamma, tokenizer=tok, draft_tokenizer=draft_tok, compile=compile_,
                             prompt_lookup_ngram=args.prompt_lookup_ngram)
    if compile_ or gamma == "auto":
        work = " and ".join(w for w, on in (("compiling the forwards' graphs", compile_),
                                            ("measuring auto γ's cost model", gamma == "auto")) if on)
        print(f"warm-up: {work} for batch sizes up to {args.max_batch_size} ...", file=sys.stderr, flush=True)
        print(f"warm-up done in {costs.warm_up(dec, args.max_batch_size):.1f} s", file=sys.stderr, flush=True)
    cost_model = None
    if isinstance(gamma, int) and gamma > 0 and not args.prompt_lookup_ngram:
        print(f"warm-up: measuring the draft/target costs that check γ = {gamma} against the acceptance measured "
              "while serving ...", file=sys.stderr, flush=True)
        cost_model = fixed_gamma_cost_model(dec)
    return dec, tok, cost_model


def main(argv: list[str] | None = None) -> int:
    """Parse, check the address (before any model loads), load the pair, serve until Ctrl-C/SIGTERM."""
    args = serve_parser().parse_args(argv)
    _check_bind(args.host, args.port)
    warning = bind_warning(args.host, args.port, args.api_key)
    if warning:
        print(warning, file=sys.stderr)
    device = check_device(args.device)
    compile_ = compile_setting(args.compile)
    if compile_ == "draft" and args.draft is None:
        raise ValueError("--compile draft compiles the draft's forwards, but no --draft was given; add --draft, or "
                         "use --compile both to compile the target")
    if compile_ and str(device).startswith("cpu"):
        check_cpu_compiler("--compile", "drop --compile")
    check_prompt_lookup(args.prompt_lookup_ngram, bool(args.draft), "--prompt-lookup-ngram")
    check_draft_tokenizer_arg(args.draft, args.draft_tokenizer)
    for option in ("target", "draft", "tokenizer"):  # every path before the first (slow) load (--draft-tokenizer:
        if getattr(args, option) is not None:                # check_draft_tokenizer_arg, already)
            check_cached(getattr(args, option), f"--{option}")
    try:
        dec, tok, cost_model = _load_and_warm_up(args, device, compile_)
    except KeyboardInterrupt:  # Ctrl-C while loading or compiling: nothing served yet, nothing to save
        print("interrupted before the server listened (loading or warm-up); nothing was served", file=sys.stderr)
        return 130
    name = served_model_name(args.target, args.served_model_name)
    limits = ServerLimits(args.max_body_bytes, args.max_tokens_limit, args.max_prompt_tokens, args.body_timeout_s)
    app = create_app(dec, tok, name, args.api_key, limits, args.max_batch_size, args.max_queue,
                     info={"target": args.target, "draft": args.draft, "compile": args.compile or False,
                           "prompt_lookup_ngram": args.prompt_lookup_ngram,
                           # a draft of another vocabulary: how many tokens it shares with the target's
                           "vocab_intersection": dec.intersection.summary() if dec.intersection is not None else None},
                     cost_model=cost_model)
    server = make_server(app, args.host, args.port, args.graceful_shutdown_s)
    try:
        server.run()
    except KeyboardInterrupt:  # a second Ctrl-C during the shutdown (uvicorn's force quit)
        pass
    return 0 if server.started else 1
