"""``python -m distill SUBCOMMAND ...``: the command line of the distillation toolkit.

Subcommands:
  train          distill a draft against a frozen target (Hydra overrides, see conf/ and docs/distill.md)
  generate-data  make and cache target-generated completions (sequence-level KD) for the configured data
  eval           measure α/τ of a draft (draft.name_or_path) against the target on the eval prompts
  export         CHECKPOINT OUT_DIR: merge LoRA, save a Hugging Face draft with tokenizer and card
  pretrain       pre-train a small target/draft pair on a text corpus (distill/pretrain.py)
  cache-logits   score the training data with the target once; store top-k log-probs + tail (distill/logit_cache.py)
  bench-step     time the recipe's step against its bound (target forward + draft forward/backward/optimizer)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

CONF_ENV = "DRAFTKIT_CONF"
SUBCOMMANDS = {
    "train": "distill a draft against a frozen target: python -m distill train +target.name_or_path=T [k=v ...]",
    "generate-data": "cache target completions (sequence-level KD): python -m distill generate-data [k=v ...]",
    "eval": "measure α/τ of draft.name_or_path against the target: python -m distill eval [k=v ...] [--out FILE]",
    "export": "merge LoRA and save a HF draft with tokenizer and card: python -m distill export CHECKPOINT OUT_DIR",
    "pretrain": "pre-train a small target/draft pair on a corpus: python -m distill pretrain --help",
    "cache-logits": "cache the target's top-k log-probs + tail mass: python -m distill cache-logits "
                    "data.logit_cache=DIR [data.logit_cache_k=32] [k=v ...] (then train data.target_logits=cached)",
    "bench-step": "time the recipe's step vs the bound: python -m distill bench-step [--steps N] [--out FILE] "
                  "[k=v ...]",
}


def conf_dir() -> Path:
    """The Hydra config folder: ``$DRAFTKIT_CONF`` or ``<repo>/conf``."""
    return Path(os.environ.get(CONF_ENV) or Path(__file__).resolve().parents[1] / "conf").resolve()


def expand_target_shorthand(overrides: list[str]) -> list[str]:
    """``+target=X`` selects ``conf/target/X.yaml`` when that file exists; otherwise X is a path or hub id and the
    override becomes ``+target.name_or_path=X`` (so ``+target=/models/qwen`` works as the issue's usage reads)."""
    out = []
    for o in overrides:
        if o.startswith("+target=") and not (conf_dir() / "target" / f"{o.split('=', 1)[1]}.yaml").exists():
            o = "+target.name_or_path=" + o.split("=", 1)[1]
        out.append(o)
    return out


def compose(overrides: list[str]):
    """Compose ``conf/config.yaml`` with Hydra overrides (``key=value``, ``+key=value``, ``group=option``);
    ``+target=PATH_OR_HUB_ID`` is accepted too (see :func:`expand_target_shorthand`)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(conf_dir()), job_name="distill"):
        return hydra_compose(config_name="config", overrides=expand_target_shorthand(list(overrides)))


def _compose_or_exit(overrides: list[str]):
    """:func:`compose` for the command line: a bad override prints Hydra's message (no traceback) and exits 2."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        return compose(overrides)
    except (HydraException, OmegaConfBaseException) as e:
        hint = ""
        if "target." in str(e) and "Could not override" in str(e):
            hint = ("\nThe target group is not in the defaults: add target keys with a plus, e.g. "
                    "+target.name_or_path=PATH +target.dtype=bf16 (or ++ to force).")
        _fail(RuntimeError(f"{e}{hint}"))


def _overrides_parser(prog: str, help_text: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m distill {prog}", description=help_text)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +target.name_or_path=PATH loss=tvd "
                   "train.max_steps=100 +experiment=NAME")
    p.add_argument("--print-config", action="store_true", help="print the composed config and exit")
    return p


def _fail(e: Exception) -> None:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2)


def cmd_train(argv: list[str]) -> None:
    from omegaconf import OmegaConf

    from distill.models import SetupError
    from distill.recipe import train

    args = _overrides_parser("train", SUBCOMMANDS["train"]).parse_args(argv)
    cfg = _compose_or_exit(args.overrides)
    if args.print_config:
        print(OmegaConf.to_yaml(cfg))
        return
    try:
        summary = train(cfg)
    except SetupError as e:
        _fail(e)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({k: summary[k] for k in ("steps", "final_loss", "best", "num_processes", "output_dir")},
                         indent=2))


def cmd_generate_data(argv: list[str]) -> None:
    import torch

    from distill.models import (SetupError, check_pair, context_length, load_draft, load_draft_tokenizer,
                                load_target, load_tokenizer)
    from distill.recipe import load_data, normalize_config, prepare_target_data, target_data_dir

    args = _overrides_parser("generate-data", SUBCOMMANDS["generate-data"]).parse_args(argv)
    try:
        cfg = normalize_config(_compose_or_exit(args.overrides))
        tokenizer = load_tokenizer(cfg.target.tokenizer or cfg.target.name_or_path)
        target = load_target(cfg.target)
        draft = None
        if cfg.data.target_generated.get("use_draft", True) and cfg.draft.get("name_or_path"):
            draft = load_draft(cfg.draft, target).eval()
            check_pair(target, draft, tokenizer, load_draft_tokenizer(cfg.draft))
        device = "cuda" if torch.cuda.is_available() and not cfg.train.get("cpu") else "cpu"
        target.to(device)
        if draft is not None:
            draft.to(device)
        ctx = [c for c in (context_length(target), context_length(draft) if draft is not None else None) if c]
        examples, _ = load_data(cfg, tokenizer, min(ctx) if ctx else None)  # exactly the examples train() uses
        rows = prepare_target_data(cfg, target, draft, tokenizer, examples)
    except SetupError as e:
        _fail(e)
    print(json.dumps({"rows": len(rows), "path": str(target_data_dir(cfg) / "dataset")}))


def cmd_eval(argv: list[str]) -> None:
    import torch

    from distill.evaluate import acceptance_eval
    from distill.models import (SetupError, check_pair, context_length, load_draft, load_draft_tokenizer,
                                load_target, load_tokenizer)
    from distill.recipe import load_data, normalize_config

    p = _overrides_parser("eval", SUBCOMMANDS["eval"])
    p.add_argument("--out", help="write the JSON result here too")
    args = p.parse_args(argv)
    try:
        cfg = normalize_config(_compose_or_exit(args.overrides))
        tokenizer = load_tokenizer(cfg.target.tokenizer or cfg.target.name_or_path)
        target = load_target(cfg.target)
        draft = load_draft(cfg.draft, target).eval()
        check_pair(target, draft, tokenizer, load_draft_tokenizer(cfg.draft))
        ctx = [c for c in (context_length(target), context_length(draft)) if c]
        _, prompts = load_data(cfg, tokenizer, min(ctx) if ctx else None)
    except SetupError as e:
        _fail(e)
    device = "cuda" if torch.cuda.is_available() and not cfg.train.get("cpu") else "cpu"
    target.to(device), draft.to(device)
    result = acceptance_eval(target, draft, prompts, tokenizer, list(cfg.eval.temperatures),
                             num_draft_tokens=int(cfg.eval.num_draft_tokens),
                             max_new_tokens=int(cfg.eval.max_new_tokens),
                             batch_size=int(cfg.eval.batch_size), seed=int(cfg.eval.seed),
                             cost_ratio=cfg.eval.get("cost_ratio"), max_gamma=int(cfg.eval.max_gamma))
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


def cmd_export(argv: list[str]) -> None:
    from distill.export import export
    from distill.models import resolve_dtype

    p = argparse.ArgumentParser(prog="python -m distill export", description=SUBCOMMANDS["export"])
    p.add_argument("checkpoint", help="a checkpoint folder of a run: <output_dir>/best or <output_dir>/step_N")
    p.add_argument("out_dir", help="where to write the Hugging Face draft")
    p.add_argument("--dtype", default=None, help="save in this dtype (float32, bf16, fp16); default: as trained")
    args = p.parse_args(argv)
    try:
        card = export(args.checkpoint, args.out_dir, resolve_dtype(args.dtype))
    except (FileNotFoundError, ValueError) as e:
        _fail(e)
    ev = card.get("evaluation") or {}
    print(json.dumps({"out_dir": args.out_dir, "target": card["target"],
                      "acceptance_rate": ev.get("acceptance_rate")}, indent=2))


def cmd_pretrain(argv: list[str]) -> None:
    try:
        from distill.pretrain import main as pretrain_main
    except ImportError as e:
        _fail(RuntimeError(f"`pretrain` needs distill/pretrain.py, which is not available here ({e})"))
    pretrain_main(argv)


def run_cache_logits(cfg) -> dict:
    """``cache-logits`` on a composed config: build (or finish) ``data.logit_cache``; returns its summary."""
    from distill.logit_cache import build_cache

    return build_cache(cfg)


def cmd_cache_logits(argv: list[str]) -> None:
    from omegaconf import OmegaConf

    from distill.models import SetupError

    args = _overrides_parser("cache-logits", SUBCOMMANDS["cache-logits"]).parse_args(argv)
    cfg = _compose_or_exit(args.overrides)
    if args.print_config:
        print(OmegaConf.to_yaml(cfg))
        return
    try:
        summary = run_cache_logits(cfg)
    except SetupError as e:
        _fail(e)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary, indent=2))


def run_bench_step(cfg, steps: int, warmup: int, out: str | None) -> dict:
    """``bench-step`` on a composed config: the recipe's step against its bound (distill/bench_step.py)."""
    from distill.bench_step import bench_step

    return bench_step(cfg, steps=steps, warmup=warmup, out=out)


def cmd_bench_step(argv: list[str]) -> None:
    from distill.models import SetupError

    p = _overrides_parser("bench-step", SUBCOMMANDS["bench-step"])
    p.add_argument("--steps", type=int, default=10, help="timed rounds (each times every part once, interleaved)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--out", help="write the JSON result here (refuses an existing file)")
    args = p.parse_args(argv)
    if args.out and Path(args.out).exists():
        _fail(FileExistsError(f"--out {args.out} exists; choose another file (results are never overwritten)"))
    if args.steps < 1 or args.warmup < 0:
        _fail(ValueError(f"--steps {args.steps} must be >= 1 and --warmup {args.warmup} >= 0"))
    cfg = _compose_or_exit(args.overrides)
    if args.print_config:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(cfg))
        return
    try:
        run_bench_step(cfg, args.steps, args.warmup, args.out)
    except SetupError as e:
        _fail(e)


COMMANDS = {"train": cmd_train, "generate-data": cmd_generate_data, "eval": cmd_eval, "export": cmd_export,
            "pretrain": cmd_pretrain, "cache-logits": cmd_cache_logits, "bench-step": cmd_bench_step}


def main(argv: list[str] | None = None) -> None:
    """Dispatch ``python -m distill SUBCOMMAND ARGS``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        width = max(map(len, SUBCOMMANDS))
        lines = "\n".join(f"  {name.ljust(width)}  {text}" for name, text in SUBCOMMANDS.items())
        print(f"usage: python -m distill SUBCOMMAND [ARGS]\n\nsubcommands:\n{lines}\n\n"
              "Run `python -m distill SUBCOMMAND --help` for each one; configs live in conf/ (docs/distill.md).")
        if not argv:
            raise SystemExit(2)
        return
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        _fail(ValueError(f"unknown subcommand {name!r}; choose one of {list(COMMANDS)} (python -m distill --help)"))
    COMMANDS[name](rest)


if __name__ == "__main__":
    main()
