"""``python -m decode generate|bench|serve|loadtest|certify|import-gguf|vllm-check``: the speculative decoder's command line."""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from decode import costs
from decode.cli_args import (DEFAULT_NUM_DRAFT_TOKENS, add_draft_tokenizer_arg, check_draft_tokenizer_arg,
                             command_gamma, fixed_gamma_cost_model, num_draft_tokens_arg, slowdown_warning)
from decode.engine import SpeculativeDecoder
from decode.gguf import import_gguf
from decode.loading import (chat_prompt_ids, check_cached, check_device, load_causal_lm, load_draft_tokenizer,
                            load_target_tokenizer, run_offline)
from decode.lookup import check_prompt_lookup
from decode.requests import check_seed
from decode.sampling import validate_sampling_args
from decode.serving import check_serve_extra
from decode.stops import stop_token_ids

def generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m decode generate",
                                description="Stream a speculative completion of one prompt and print its metrics.")
    p.add_argument("--target", required=True, help="target checkpoint: local folder, .gguf file or hub id")
    p.add_argument("--draft", default=None, help="draft checkpoint or .gguf file (omit for plain target decoding)")
    p.add_argument("--tokenizer", default=None, help="tokenizer path (default: the target's)")
    add_draft_tokenizer_arg(p)
    p.add_argument("--prompt", required=True, help="prompt text ('-' reads standard input)")
    p.add_argument("--num-draft-tokens", "-g", type=num_draft_tokens_arg, default=None,
                   help=f"γ, or 'auto' (default {DEFAULT_NUM_DRAFT_TOKENS}: measures the draft/target costs at "
                   "first use and picks γ each step, 0 where drafting does not pay; needs --draft, without which "
                   "the target decodes alone)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-lookup-ngram", type=int, default=0, metavar="N",
                   help="at --temperature 0, while the last N tokens occurred earlier, draft the tokens that followed "
                   "them instead of the draft's guesses (prompt lookup, decode.lookup; 0: off, the default)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 | auto")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to the prompt")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON instead of a table")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow checkpoints to run their own Python modeling/tokenizer code (off by default)")
    return p


def check_generate_args(args: argparse.Namespace) -> None:
    """Every check of ``generate``'s options that needs no model; raises ValueError naming the option."""
    validate_sampling_args(args.temperature, args.top_k, args.top_p,
                           names={"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p"})
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check_seed(args.seed, "--seed", none_ok=False)
    check_prompt_lookup(args.prompt_lookup_ngram, bool(args.draft), "--prompt-lookup-ngram")
    check_draft_tokenizer_arg(args.draft, args.draft_tokenizer)
    if args.prompt_lookup_ngram and (args.temperature > 0 or args.num_draft_tokens == 0):
        print(f"note: --prompt-lookup-ngram does nothing here: it drafts for greedy decoding (--temperature 0) with "
              f"γ > 0 only (this run: --temperature {args.temperature:g}, -g "
              f"{command_gamma(args.num_draft_tokens, True)})", file=sys.stderr)
    if not args.draft and args.num_draft_tokens not in (None, 0):  # the API refuses it too (--draft= is none)
        raise ValueError(f"--num-draft-tokens {args.num_draft_tokens} needs a draft: pass --draft PATH, or leave "
                         "-g out to decode with the target alone")


def load_decoder(args: argparse.Namespace, device: Any) -> tuple[SpeculativeDecoder, Any, int | str]:
    """The target (and draft) of ``args`` loaded on ``device``: ``(decoder, tokenizer, γ)``."""
    for option in ("target", "draft", "tokenizer"):  # every path before the first (slow) load (--draft-tokenizer:
        if getattr(args, option) is not None:                # check_draft_tokenizer_arg, already)
            check_cached(getattr(args, option), f"--{option}")
    trust = args.trust_remote_code
    target = load_causal_lm(args.target, "target", args.dtype, device, trust)
    tok = load_target_tokenizer(args.tokenizer, args.target, trust)
    draft = load_causal_lm(args.draft, "draft", args.dtype, device, trust) if args.draft else None
    draft_tok = load_draft_tokenizer(args.draft, tok, trust, args.draft_tokenizer) if args.draft else None
    gamma = command_gamma(args.num_draft_tokens, draft is not None)
    dec = SpeculativeDecoder(target, draft, gamma, tokenizer=tok, draft_tokenizer=draft_tok,
                             prompt_lookup_ngram=args.prompt_lookup_ngram)
    return dec, tok, gamma


def generation_metrics(stats: Any, gamma: int | str) -> dict:
    """What ``generate`` reports of one run's :class:`decode.metrics.DecodeStats`."""
    # Nothing drafted (no --draft, or 'auto' chose γ = 0 throughout): there is no acceptance rate to report, and a
    # 0.0 would read as a draft that is always rejected.
    s = stats
    return {"num_draft_tokens": gamma, "new_tokens": s.num_new_tokens,
            "acceptance_rate": s.acceptance_rate if s.num_drafted else None,
            "alpha": s.alpha if s.num_drafted else None,  # per-token acceptance (Leviathan et al.'s α)
            "mean_accepted_length": s.mean_accepted_length, "acceptance_by_position": s.acceptance_by_position,
            "ttft_s": s.ttft_s, "per_token_latency_s": s.per_token_latency_s, "tokens_per_s": s.tokens_per_s,
            "peak_memory_bytes": s.peak_memory_bytes}


def print_metrics_table(metrics: dict) -> None:
    """The metrics as a table on standard error (standard output carries the streamed text)."""
    table = Table(title="speculative decoding metrics")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in metrics.items():
        table.add_row(k, "n/a (nothing drafted)" if v is None or v == [] else
                      ", ".join(f"{x:.2f}" for x in v) if isinstance(v, list) else
                      (f"{v:.4g}" if isinstance(v, float) else str(v)))
    Console(stderr=True).print(table)


def cmd_generate(argv: list[str]) -> int:
    args = generate_parser().parse_args(argv)
    check_generate_args(args)
    device = check_device(args.device)
    dec, tok, gamma = load_decoder(args, device)
    # Auto γ's cost model is measured now, not at the first step, where its timed forwards would count in the run's
    # TTFT and latency.
    costs.warm_up(dec, 1)
    # Imported here, not at the top: `python -m decode bench` goes offline before transformers loads (main).
    from transformers import TextStreamer

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.chat:
        ids = chat_prompt_ids(tok, [{"role": "user", "content": prompt}])
    else:
        ids = tok(prompt)["input_ids"]
    # With --json, stdout carries only the JSON document (text included), so it stays machine-readable. A plain
    # prompt streams with its continuation; a chat streams the answer only (the rendered prompt holds the template's
    # markup and any system prompt it adds, which the user never wrote).
    streamer = None if args.json else TextStreamer(tok, skip_prompt=args.chat, skip_special_tokens=True)
    out = dec.generate([ids], max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, eos_token_id=stop_token_ids(tok, dec.target), streamer=streamer,
                       generator=torch.Generator(device=device).manual_seed(args.seed))
    metrics = generation_metrics(out.stats, gamma)
    if args.json:
        text = tok.decode(out.new_tokens[0].tolist(), skip_special_tokens=True)
        print(json.dumps({"prompt": prompt, "text": text, "token_ids": out.new_tokens[0].tolist(), **metrics}))
    else:
        print_metrics_table(metrics)
    warning = fixed_gamma_warning(dec, out.stats, gamma)
    if warning:
        print(warning, file=sys.stderr)
    return 0


def fixed_gamma_warning(dec: SpeculativeDecoder, stats: Any, gamma: int | str) -> str | None:
    """After a run with a fixed γ > 0 and a draft: the warning of :func:`decode.cli_args.slowdown_warning` when the
    acceptance it measured predicts a slowdown, priced with a cost model measured now; else None. Prompt lookup is
    left out: its drafts cost no draft forward, which the prediction does not model."""
    fixed = isinstance(gamma, int) and gamma > 0 and dec.draft is not None
    if not fixed or dec.prompt_lookup_ngram or not stats.num_drafted:
        return None
    return slowdown_warning(stats.alpha, stats.num_drafted, gamma, fixed_gamma_cost_model(dec),
                            "use --num-draft-tokens auto (the default) or 0, or a better draft")


def import_gguf_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m decode import-gguf",
                                description="Write a plain Hugging Face checkpoint (safetensors, config, tokenizer, "
                                "generation config, gguf_source.json) of a GGUF file; its weights are dequantized.")
    p.add_argument("gguf_file", metavar="FILE.gguf", help="the GGUF file (llama.cpp format)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="a new (or empty) folder for the checkpoint")
    p.add_argument("--dtype", default="float32", help="float32 (default) | bfloat16 | float16")
    return p


def cmd_import_gguf(argv: list[str]) -> int:
    args = import_gguf_parser().parse_args(argv)
    out = import_gguf(args.gguf_file, args.out_dir, args.dtype)
    print(f"wrote {out} (from {args.gguf_file})")
    return 0


COMMANDS = {
    "generate": ("decode.__main__", "cmd_generate", "stream a completion and print α, τ, TTFT, latency, memory"),
    "bench": ("decode.bench.cli", "main", "side-by-side benchmark: plain vs speculative vs HF assisted generation"),
    "serve": ("decode.serving.cli", "main", "OpenAI-compatible HTTP server (continuous batching, streaming)"),
    "loadtest": ("decode.serving.loadtest", "main", "N concurrent streaming clients against a local server"),
    "certify": ("decode.certify", "main", "chi-square certificate that a target/draft pair samples the target"),
    "import-gguf": ("decode.__main__", "cmd_import_gguf", "write a plain checkpoint (safetensors) of a GGUF file"),
    "vllm-check": ("decode.vllm_check", "main", "run the pair in vLLM and draftkit: served acceptance, greedy output"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m decode {{{','.join(COMMANDS)}}} [options]\n")
        for name, (_, _, help_) in COMMANDS.items():
            print(f"  {name:10s} {help_}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    try:  # before transformers and any model load: a missing extra is known at once
        check_serve_extra(name)
    except ModuleNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if name == "bench":  # bench loads local checkpoints only (decode/bench/cli.py); huggingface_hub reads this
        run_offline("decode bench")  # once, on import: before transformers, or a typo retries the hub
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-model weight-loading bars drown the command's own progress
    try:
        fn = getattr(importlib.import_module(module), func)
    except ModuleNotFoundError as err:
        print(f"error: the {name!r} command is not available ({err})", file=sys.stderr)
        return 2
    try:
        return fn(rest) or 0
    except (FileNotFoundError, FileExistsError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
