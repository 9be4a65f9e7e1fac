"""``python -m decode bench``: parse and check every setting and the output path, load the pair, run, write, print.

    python -m decode bench --target PATH --draft PATH --prompts humaneval --limit 8 --max-new-tokens 64 \
        --ignore-eos --gammas 2,4,auto --hf-gammas 4 --temperatures 0,1 --batch-sizes 1,4,8 --out bench.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from transformers.utils import logging as hf_logging

from decode import loading
from decode.bench.config import BenchConfig, parse_gammas, parse_list
from decode.bench.report import OutputPaths, render_tables, write_outputs
from decode.bench.runs import compile_supported, plan_line, run_benchmark
from decode.cache import context_length
from decode.cli_args import add_draft_tokenizer_arg, check_draft_tokenizer_arg
from decode.compat import check_compatibility, input_vocab_size, output_vocab_size, shares_vocabulary
from decode.compiling import check_cpu_compiler, compile_setting
from decode.prompts import encode_prompts, load_prompts
from decode.requests import check_seed
from decode.stops import stop_token_ids
from decode.vocab_map import pruned_size


def build_parser() -> argparse.ArgumentParser:
    """The ``bench`` command line (see docs/bench.md for every option)."""
    p = argparse.ArgumentParser(prog="python -m decode bench",
                                description="Side-by-side benchmark: plain vs speculative vs HF assisted generation, "
                                            "measured and predicted speedup.",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target checkpoint: local path or HF id (loaded offline)")
    p.add_argument("--draft", required=True, help="draft checkpoint: local path or HF id")
    p.add_argument("--tokenizer", help="tokenizer path (default: the target's, else the draft's)")
    add_draft_tokenizer_arg(p)
    p.add_argument("--prompts", default="humaneval",
                   help="humaneval | mbpp | mbpp_code | spec_bench | mt_bench | gsm8k | path/to/file.jsonl[.gz]")
    p.add_argument("--prompt-field", help="text field of a local jsonl (default: prompt, text, question, turns or "
                   "instruction), or another field of a named set")
    p.add_argument("--limit", type=int, default=4,
                   help="number of prompts (category-balanced for Spec-Bench; default 4: a first try of a few "
                        "minutes on a ~100M target on a CPU, 20 or more for numbers to report)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="new tokens per prompt (default 32)")
    p.add_argument("--gammas", default="1,2,4",
                   help="comma-separated γ list (sorted, duplicates dropped); add 'auto' or use --no-auto")
    p.add_argument("--no-auto", action="store_true", help="skip num_draft_tokens='auto'")
    p.add_argument("--auto-max-gamma", type=int, default=8, help="largest γ the adaptive controller may pick")
    p.add_argument("--temperatures", default="0",
                   help="comma-separated, e.g. 0,1; duplicates dropped (0 and 0.0 are one)")
    p.add_argument("--batch-sizes", default="1",
                   help="comma-separated, e.g. 1,4,8 (default 1: no batch pass beyond the main pass's rows); "
                        "duplicates dropped")
    p.add_argument("--batching", default="static,continuous",
                   help="how the batch pass batches, comma-separated: static (generate() calls of --batch-sizes "
                        "rows; a batch ends with its slowest row) and/or continuous (a stream of requests, that many "
                        "at a time, each joining as another finishes, as the server runs them; batch sizes > 1); "
                        "duplicates dropped")
    p.add_argument("--batch-gamma", type=int, help="γ for the batch pass (default: best measured γ)")
    p.add_argument("--no-hf", action="store_true", help="skip HF generate (plain and assisted)")
    p.add_argument("--hf-gammas", default="",
                   help="extra HF assisted runs with num_assistant_tokens=γ, constant schedule, no confidence stop "
                        "(e.g. 4); hf_assisted always runs with HF's own defaults")
    p.add_argument("--compile", nargs="?", const="both", choices=["both", "draft"],
                   help="also run our decoder built with compile=True (--compile, or --compile both) or "
                        "compile='draft' (--compile draft: the draft's forwards only): plain_compiled, "
                        "spec_g{γ}_compiled")
    p.add_argument("--few-row-linear", choices=["auto", "on", "off"], default="auto",
                   help="our decoder's few-row linear kernels (decode.kernels; auto: on for float32 CPU models unless "
                        "the target is compiled, --compile both)")
    p.add_argument("--prompt-lookup-ngram", type=int, default=0, metavar="N",
                   help="our speculative methods draft by prompt lookup in greedy runs while the last N tokens "
                        "occurred earlier (decode.lookup; 0: off, the default)")
    p.add_argument("--profile", action="store_true",
                   help="time each step of our methods by part (decode.profile: prefills, draft and verify forwards, "
                        "the math around them, host sync, roll-back, commit) over the main pass, recorded as "
                        "runs[].profile and printed as a per-step table; adds a little overhead to those runs")
    p.add_argument("--ignore-eos", action="store_true", help="always generate max_new_tokens")
    p.add_argument("--no-chat-template", action="store_true", help="tokenize raw text even if a template exists")
    p.add_argument("--max-prompt-tokens", type=int,
                   help="keep each prompt's last N tokens (default: what the models' positions allow); use the "
                        "training window minus --max-new-tokens for models trained on short windows")
    p.add_argument("--cost-context", type=int,
                   help="context length (>= 2 tokens) for measuring c; it plus the largest γ must fit the models' "
                        "positions (default: mean prompt + N/2)")
    p.add_argument("--cost-repeats", type=int, default=11,
                   help="timed rounds for c, v_γ and the bare reference (>= 3; spread over the main pass, a whole "
                        "number before each prompt), and forwards per median of the auto-γ calibration (default 11)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs of each method on each prompt (and each batch), one after another in rotated "
                        "order; the run with the median wall time is recorded (default 1; 3 damps single-call "
                        "timing noise, at 3x the time)")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow checkpoints to run their own Python modeling/tokenizer code (off by default)")
    p.add_argument("--out", default="checkpoints/bench",
                   help="FILE.json (plots beside it as FILE_<plot>.png) or a folder (results.json and <plot>.png); "
                        "checked before the run")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    return p


def _load_tokenizer(paths: list[str], trust_remote_code: bool = False):
    for i, path in enumerate(paths):
        try:
            return loading.load_tokenizer(path, trust_remote_code=trust_remote_code)
        except FileNotFoundError:
            if i == len(paths) - 1:
                raise


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (``python -m decode bench ...``): 0 on success, 2 with a message on bad input."""
    try:
        run_cli(argv)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The validated ``BenchConfig`` of parsed arguments (no model, no file touched). Raises ValueError."""
    gammas, auto = parse_gammas(args.gammas)
    if auto and args.no_auto:
        raise ValueError(f"--gammas {args.gammas!r} lists 'auto' but --no-auto skips it; drop one of them")
    hf_gammas, hf_auto = parse_gammas(args.hf_gammas, "--hf-gammas") if args.hf_gammas.strip() else ([], False)
    if hf_auto:
        raise ValueError(f"--hf-gammas {args.hf_gammas!r}: 'auto' is not an option there; hf_assisted already runs "
                         "HF's own adaptive schedule, --hf-gammas adds fixed γ values only (e.g. --hf-gammas 4)")
    if hf_gammas and args.no_hf:
        raise ValueError(f"--hf-gammas {args.hf_gammas!r} asks for HF assisted runs but --no-hf skips HF; drop one "
                         "of them")
    if args.limit < 1:
        raise ValueError(f"--limit must be >= 1 (got {args.limit}): the number of prompts to run")
    cfg = BenchConfig(
        gammas=gammas, auto=auto or not args.no_auto, auto_max_gamma=args.auto_max_gamma,
        temperatures=parse_list(args.temperatures, float, "temperature"),
        batch_sizes=parse_list(args.batch_sizes, int, "batch size"),
        batching=parse_list(args.batching, str, "batching"), max_new_tokens=args.max_new_tokens,
        hf=not args.no_hf, hf_gammas=hf_gammas,
        ignore_eos=args.ignore_eos, batch_gamma=args.batch_gamma, cost_context_tokens=args.cost_context,
        cost_repeats=args.cost_repeats, repeats=args.repeats, warmup=not args.no_warmup, seed=args.seed,
        compile=compile_setting(args.compile),
        few_row_linear={"auto": None, "on": True, "off": False}[args.few_row_linear],
        prompt_lookup_ngram=args.prompt_lookup_ngram, profile=args.profile,
        target=args.target, draft=args.draft, draft_tokenizer=args.draft_tokenizer, prompts=args.prompts,
        limit=args.limit)
    cfg.validate()
    check_draft_tokenizer_arg(args.draft, args.draft_tokenizer)
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise ValueError(f"--max-prompt-tokens must be >= 1 (got {args.max_prompt_tokens})")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1 (got {args.threads}); omit it for torch's default")
    cfg.target_revision, cfg.draft_revision = loading.hub_revision(args.target), loading.hub_revision(args.draft)
    check_seed(args.seed, "--seed", none_ok=False)
    cfg.device = loading.check_device(args.device)
    if cfg.compile and not compile_supported():
        raise ValueError("--compile: this version's SpeculativeDecoder has no compile option; drop --compile")
    if cfg.compile and str(cfg.device).startswith("cpu"):
        check_cpu_compiler("--compile", "drop --compile")
    return cfg


def run_cli(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse ``argv``, check everything (settings, paths, output path) before loading models, run the benchmark,
    write outputs, print tables.

    Returns:
        the results dict (also written to ``--out``).

    Raises:
        ValueError: bad γ list, temperatures, batch sizes, prompt set, output path, contradictory options, or a
            prompt budget or cost context that cannot fit the models' positions.
        FileNotFoundError: missing target/draft/tokenizer/prompt file.
        decode.compat.IncompatibleModelsError: the pair cannot share a vocabulary.
    """
    loading.run_offline("decode bench")
    args = build_parser().parse_args(argv)
    hf_logging.set_verbosity_error()  # HF's assisted generate warns about its own internal generation_config use
    cfg = config_from_args(args)
    out = OutputPaths.plan(args.out, overwrite=args.overwrite)
    draft_folder = _check_model_paths(args, cfg)
    prompts = load_prompts(args.prompts, limit=args.limit, field=args.prompt_field)
    if len(prompts) < args.limit:  # said before the run; the JSON's prompts.count has it too
        print(f"note: --prompts {args.prompts} has {len(prompts)} prompt(s), fewer than --limit {args.limit}; "
              f"benchmarking {len(prompts)}", file=sys.stderr)
    print(plan_line(cfg, len(prompts)), file=sys.stderr, flush=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(cfg.device)  # checked by config_from_args
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    cfg.device, cfg.dtype = str(device), str(dtype).replace("torch.", "")
    tokenizer, draft_tokenizer = _load_tokenizers(args, draft_folder)
    target, draft = _load_pair(args, cfg, device, dtype, tokenizer, draft_tokenizer)
    prompt_ids = _encode(prompts, tokenizer, target, draft, cfg, args)
    print(f"prompts: {len(prompt_ids)} of {args.prompts}, "
          + (f"chat template of {cfg.chat_template_source} applied" if cfg.chat_template else "no chat template")
          + f", {sum(map(len, prompt_ids)) / len(prompt_ids):.0f} tokens on average", file=sys.stderr, flush=True)
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    eos = stop_token_ids(tokenizer, target) or None  # the stop set of `decode generate` and the server
    results = run_benchmark(target, draft, prompt_ids, [p.category for p in prompts], cfg, pad_token_id=pad,
                            eos_token_id=eos, prompt_names=[p.id for p in prompts], progress=True,
                            tokenizer=tokenizer, draft_tokenizer=draft_tokenizer)
    paths = write_outputs(results, out)
    render_tables(results)
    Console().print("wrote " + ", ".join(paths.values()))
    return results


def _check_model_paths(args: argparse.Namespace, cfg: BenchConfig) -> str | None:
    """Before the prompts and models load: a local path must exist, and offline a hub id must be cached; a
    vocabulary-pruned draft cannot run with HF assisted generation. Returns the draft's local folder (a cached hub
    id's snapshot), or None."""
    for name in ("target", "draft"):  # a local path must exist; a hub id (org/name) is the loader's to find
        path = getattr(args, name)
        if loading.looks_local(path) and not os.path.exists(os.path.expanduser(path)):
            raise FileNotFoundError(f"--{name} {path} does not exist; pass a checkpoint folder or a hub id "
                                    "(org/name) in the local Hugging Face cache")
        loading.check_cached(path, f"--{name}")
    draft_folder = loading.local_folder(args.draft)  # its config and tokenizer are read too
    if cfg.hf and draft_folder and pruned_size(draft_folder) is not None:
        raise ValueError(f"--draft {args.draft} is vocabulary-pruned (its lm_head scores {pruned_size(draft_folder)} "
                         "mapped ids); Hugging Face assisted generation cannot read its id map: pass --no-hf")
    return draft_folder


def _load_tokenizers(args: argparse.Namespace, draft_folder: str | None) -> tuple[Any, Any]:
    """(the target's tokenizer: ``--tokenizer``, else the target's, else the draft's; the draft's tokenizer:
    ``--draft-tokenizer``, else its own when its folder has one and no ``--tokenizer`` was given, else None)."""
    if args.tokenizer:
        tokenizer = loading.load_target_tokenizer(args.tokenizer, args.target, args.trust_remote_code)
    else:
        tokenizer = _load_tokenizer([args.target, args.draft], args.trust_remote_code)
    draft_tokenizer = None
    if args.draft_tokenizer:
        draft_tokenizer = loading.load_draft_tokenizer(args.draft, tokenizer, args.trust_remote_code,
                                                       args.draft_tokenizer)
    elif not args.tokenizer and draft_folder and (Path(draft_folder) / "tokenizer_config.json").exists():
        draft_tokenizer = _load_tokenizer([args.draft], args.trust_remote_code)
    return tokenizer, draft_tokenizer


def _load_pair(args: argparse.Namespace, cfg: BenchConfig, device: torch.device, dtype: torch.dtype, tokenizer,
               draft_tokenizer) -> tuple[Any, Any]:
    """The target and the draft, checked before any timing: a pair that cannot share a vocabulary (nor draft
    through the tokens two vocabularies share) fails here with the difference named, and so does one HF assisted
    generation cannot run. Sets ``cfg.cross_vocab``."""
    target, draft = (_load_model(getattr(args, role), role, dtype, device, args.trust_remote_code)
                     for role in ("target", "draft"))
    cfg.cross_vocab = not shares_vocabulary(tokenizer, draft_tokenizer)
    check_compatibility(target, draft, target_tokenizer=tokenizer, draft_tokenizer=draft_tokenizer,
                        cross_vocab=cfg.cross_vocab)
    sizes = {role: (output_vocab_size(m), input_vocab_size(m)) for role, m in (("target", target), ("draft", draft))}
    if cfg.hf and cfg.cross_vocab and sizes["draft"] == sizes["target"]:  # HF then takes them for one vocabulary
        raise ValueError(f"--draft {args.draft} has a tokenizer of another vocabulary but as many rows as the target "
                         f"({sizes['draft']}); Hugging Face assisted generation reads such a pair as one vocabulary "
                         "and refuses the two tokenizers: pass --no-hf to benchmark plain decoding against ours")
    if cfg.hf and not cfg.cross_vocab and sizes["draft"] != sizes["target"]:  # ours runs it; HF's generate refuses
        raise ValueError(f"--draft {args.draft} has another vocabulary size than the target (lm_head, embedding rows: "
                         f"draft {sizes['draft']}, target {sizes['target']}); Hugging Face assisted generation "
                         "needs them equal: pass --no-hf to benchmark plain decoding against ours")
    return target, draft


def _load_model(path: str, role: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool):
    """One model of the pair, said on stderr before (its path) and after (its size, the seconds it took)."""
    print(f"loading the {role} {path} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    model = loading.load_causal_lm(path, role, dtype, str(device), trust_remote_code=trust_remote_code)
    params = sum(p.numel() for p in model.parameters())
    print(f"{role}: {params / 1e6:.1f}M parameters, {str(dtype).replace('torch.', '')} on {device} "
          f"({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
    return model


def _encode(prompts, tokenizer, target, draft, cfg: BenchConfig, args) -> list[list[int]]:
    """Token ids of the prompts, each cut to its last tokens so prompt + new tokens + a verify fit both models."""
    positions = [p for p in (context_length(target), context_length(draft)) if p]
    max_prompt = None
    if positions:
        max_prompt = min(positions) - cfg.max_new_tokens - max(cfg.gammas or [1]) - 2
        if max_prompt < 1:
            raise ValueError(f"--max-new-tokens {cfg.max_new_tokens} plus the largest γ {max(cfg.gammas or [1])} "
                             f"(--gammas) leave no room for a prompt within the models' {min(positions)} positions; "
                             "lower them")
    if args.max_prompt_tokens is not None:
        max_prompt = args.max_prompt_tokens if max_prompt is None else min(max_prompt, args.max_prompt_tokens)
    cfg.max_prompt_tokens = max_prompt
    cfg.chat_template = not args.no_chat_template and bool(getattr(tokenizer, "chat_template", None))
    cfg.chat_template_source = getattr(tokenizer, "name_or_path", None) if cfg.chat_template else None
    return encode_prompts(prompts, tokenizer, chat_template=not args.no_chat_template, max_prompt_tokens=max_prompt)
