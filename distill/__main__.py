"""``python -m distill SUBCOMMAND ...``: the command line of the distillation toolkit.

Subcommands:
  train          distill a draft against a frozen target (a Hydra app: overrides, --cfg job, --help, -m sweeps)
  generate-data  make and cache target-generated completions (sequence-level KD) for the configured data
  eval           measure α/τ of a draft (draft.name_or_path) against the target on the eval prompts
  export         CHECKPOINT OUT_DIR: merge LoRA, save a Hugging Face draft with tokenizer and card
  cache-logits   score the training data with the target once; store top-k log-probs + tail (distill/cache_logits.py)
  bench-step     time the recipe's step against its bound (target forward + draft forward/backward/optimizer)

``train``, ``generate-data``, ``eval``, ``cache-logits`` and ``bench-step`` are Hydra apps over ``conf/`` with the typed schema of
``distill/config.py``. Before Hydra runs anything, every job's overrides (each job of a ``-m`` sweep) are composed
and checked: a bad override, an unknown key, a wrong type, an out-of-range value, a missing or malformed data file
is reported as ``error: ...`` naming the setting and the fix, with exit code 2 and nothing loaded.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import hydra
import torch
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import open_dict
from transformers.utils import logging as hf_logging

from decode import SpeculativeDecoder
from decode.cache import context_length
from decode.loading import resolve_dtype
from decode.vocab_map import pruned_size
from distill.bench_step import bench_step
from distill.cache_logits import build_cache
from distill.checks import check_inputs, check_output_file, normalize_config, validate
from distill.config import CONF_ENV, SetupError, compose, conf_dir, expand_target_shorthand, explain
from distill.cross_vocab import is_cross_vocab
from distill.data import load_data
from distill.evaluate import acceptance_eval, greedy_completions, resolve_costs, teacher_forced_eval
from distill.export import export, export_notes, slower_temperatures, stopped_export_notes
from distill.logging import Progress
from distill.models import check_pair, load_draft, load_draft_tokenizer, load_target, load_tokenizer
from distill.recipe import train
from distill.runfolder import check_no_live_run, is_main_process, prepare_run_folder, write_results
from distill.target_data import prepare_target_data, target_data_dir

SUBCOMMANDS = {
    "train": "distill a draft against a frozen target: python -m distill train +target=PATH_OR_NAME [k=v ...]",
    "generate-data": "cache target completions (sequence-level KD): python -m distill generate-data [k=v ...]",
    "eval": "measure α/τ of draft.name_or_path against the target: python -m distill eval [k=v ...] [--out FILE]",
    "export": "merge LoRA and save a HF draft with tokenizer and card: python -m distill export CHECKPOINT OUT_DIR",
    "cache-logits": "cache the target's top-k log-probs + tail mass: python -m distill cache-logits "
                    "data.logit_cache=DIR [data.logit_cache_k=32] [k=v ...] (then train data.target_logits=cached)",
    "bench-step": "time the recipe's step vs the bound: python -m distill bench-step [--steps N] [--warmup N] "
                  "[--out FILE [--overwrite]] [k=v ...]",
}
# Flags Hydra itself takes (passed through); --print-config is kept as an alias of --cfg job.
HYDRA_FLAGS_WITH_VALUE = ("--cfg", "-c", "--package", "-p", "--info", "--config-path", "-cp", "--config-name",
                          "-cn", "--config-dir", "-cd", "--experimental-rerun")
HYDRA_FLAGS = ("--help", "-h", "--hydra-help", "--version", "--resolve", "--multirun", "-m", "--run", "-r",
               "--shell-completion", "-sc")


def _fail(e: Exception | str) -> None:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2)


# ------------------------------------------------------------------------------------------------ overrides

def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The override list of every job of a ``-m`` sweep (``loss=fkl,tvd`` -> ``[[loss=fkl], [loss=tvd]]``), in
    Hydra's BasicSweeper order, so each job can be checked before the first one runs."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


# ------------------------------------------------------------------------------------------------ commands

def _load_pair(cfg: Any, with_draft: bool = True) -> tuple[Any, Any, Any, Any]:
    """(tokenizer, target, draft or None, the draft's own tokenizer when it differs from the target's, else None),
    the pair checked with the decoder's compatibility rule (:mod:`distill.cross_vocab` for a draft of another
    vocabulary)."""
    tokenizer = load_tokenizer(cfg.target.tokenizer or cfg.target.name_or_path,
                               trust_remote_code=bool(cfg.target.get("trust_remote_code", False)))
    target = load_target(cfg.target)
    draft = draft_tokenizer = None
    if with_draft:
        draft = load_draft(cfg.draft, target).eval()
        own = load_draft_tokenizer(cfg.draft)
        draft_tokenizer = own if is_cross_vocab(tokenizer, own) else None
        check_pair(target, draft, tokenizer, own, draft_tokenizer is not None)
    return tokenizer, target, draft, draft_tokenizer


def run_train(cfg: Any, opts: dict) -> None:
    summary = train(cfg)
    if is_main_process():
        print(json.dumps({k: summary[k] for k in ("steps", "final_loss", "best", "num_processes", "output_dir")},
                         indent=2))


def run_generate_data(cfg: Any, opts: dict) -> None:
    cfg = normalize_config(cfg)
    use_draft = bool(cfg.data.target_generated.get("use_draft", True) and cfg.draft.get("name_or_path"))
    # The draft is loaded even when it does not draft: its context limits the prompts as in train(), whose
    # examples (and so the cache key) must be exactly these.
    tokenizer, target, draft, draft_tokenizer = _load_pair(cfg)
    use_draft = use_draft and draft_tokenizer is None  # a draft of another vocabulary does not draft here
    device = "cuda" if torch.cuda.is_available() and not cfg.train.get("cpu") else "cpu"
    target.to(device)
    ctx = [c for c in (context_length(target), context_length(draft)) if c]
    examples, _ = load_data(cfg, tokenizer, min(ctx) if ctx else None)  # exactly the examples train() uses
    rows = prepare_target_data(cfg, target, draft.to(device) if use_draft else None, tokenizer, examples)
    print(json.dumps({"rows": len(rows), "path": str(target_data_dir(cfg) / "dataset")}))


def _check_eval_keep(cfg: Any) -> None:
    """``distill eval`` measures the draft as it is: ``draft.vocab.keep`` may only be null or the draft's own map
    size (pruning is a training step, :mod:`distill.vocab`). Raises SetupError before any model loads."""
    keep = (cfg.draft.get("vocab") or {}).get("keep")
    if keep is None:
        return
    try:
        size = pruned_size(cfg.draft.name_or_path)
    except ValueError as err:
        raise SetupError(str(err)) from None
    if size != int(keep):
        head = (f"a {size}-id vocabulary map" if size is not None
                else "no vocabulary map (no draft_vocab_map_size in a local config.json)")
        raise SetupError(f"draft.vocab.keep={keep}, but distill eval measures the draft as it is, and "
                         f"{cfg.draft.name_or_path} has {head}: set draft.vocab.keep=null (pruning to N ids is done "
                         "by python -m distill train draft.vocab.keep=N)")


def _teacher_forced(cfg: Any, target: Any, draft: Any, prompts: list[list[int]], tokenizer: Any,
                    verify_costs: list[float] | None, report: Any, draft_tokenizer: Any = None) -> dict:
    """``distill eval`` with ``eval.method=teacher_forced``: the target's greedy responses to the eval prompts, then
    α by teacher forcing on them (:func:`distill.evaluate.teacher_forced_eval`), with c measured as the recipe does
    (:func:`distill.evaluate.resolve_costs`); a draft with its own ``draft_tokenizer`` through the intersection the
    decoder drafts through."""
    examples = greedy_completions(target, prompts, int(cfg.eval.max_new_tokens), tokenizer.eos_token_id,
                                  int(cfg.eval.batch_size))
    decoder = SpeculativeDecoder(target, draft, tokenizer=tokenizer, draft_tokenizer=draft_tokenizer)
    cost_ratio, verify_costs = resolve_costs(target, draft, prompts, cfg.eval.get("cost_ratio"), verify_costs,
                                             int(cfg.eval.max_gamma), progress=report, decoder=decoder)
    return teacher_forced_eval(target, draft, examples, list(cfg.eval.temperatures), decoder.vocab_size,
                               num_draft_tokens=int(cfg.eval.num_draft_tokens), cost_ratio=cost_ratio,
                               verify_costs=verify_costs, max_gamma=int(cfg.eval.max_gamma),
                               batch_size=int(cfg.eval.batch_size), pad_id=tokenizer.pad_token_id, progress=report,
                               intersection=decoder.intersection)


def run_eval(cfg: Any, opts: dict) -> None:
    cfg = normalize_config(cfg)
    _check_eval_keep(cfg)
    tokenizer, target, draft, draft_tokenizer = _load_pair(cfg)
    ctx = [c for c in (context_length(target), context_length(draft)) if c]
    _, prompts = load_data(cfg, tokenizer, min(ctx) if ctx else None, training=False)
    device = "cuda" if torch.cuda.is_available() and not cfg.train.get("cpu") else "cpu"
    target.to(device), draft.to(device)
    verify_costs = None if cfg.eval.get("verify_costs") is None else [float(v) for v in cfg.eval.verify_costs]
    with Progress(str(cfg.train.progress)).reporting() as report:
        if str(cfg.eval.get("method", "generate")) == "teacher_forced":
            result = _teacher_forced(cfg, target, draft, prompts, tokenizer, verify_costs, report, draft_tokenizer)
        else:
            result = acceptance_eval(target, draft, prompts, tokenizer, list(cfg.eval.temperatures),
                                     num_draft_tokens=int(cfg.eval.num_draft_tokens),
                                     max_new_tokens=int(cfg.eval.max_new_tokens),
                                     batch_size=int(cfg.eval.batch_size), seed=int(cfg.eval.seed),
                                     cost_ratio=cfg.eval.get("cost_ratio"), max_gamma=int(cfg.eval.max_gamma),
                                     progress=report, verify_costs=verify_costs, draft_tokenizer=draft_tokenizer)
    text = json.dumps(result, indent=2)
    print(text)  # first: a results file that cannot be written (a full disk) loses nothing
    if opts.get("out"):
        write_results(text, opts["out"], bool(opts.get("overwrite")))


def _split_argv(name: str, argv: list[str]) -> tuple[list[str], list[str], dict]:
    """(Hydra flags, overrides, own options) of a Hydra subcommand's arguments."""
    flags, overrides, opts = [], [], {}
    it = iter(argv)
    for a in it:
        if a == "--print-config":
            flags += ["--cfg", "job"]
        elif name == "bench-step" and (a in ("--steps", "--warmup") or a.startswith(("--steps=", "--warmup="))):
            key = a.split("=", 1)[0][2:]
            value = a.split("=", 1)[1] if "=" in a else next(it, None)
            try:
                opts[key] = int(value)
            except (TypeError, ValueError):
                _fail(f"--{key} needs a whole number, e.g. --{key} 10 (got {value!r})")
            if opts[key] < (1 if key == "steps" else 0):
                _fail(f"--{key} {opts[key]} must be >= {1 if key == 'steps' else 0}")
        elif name in ("eval", "bench-step") and (a in ("--out", "--overwrite") or a.startswith("--out=")):
            if a == "--overwrite":
                opts["overwrite"] = True
            else:
                opts["out"] = a.split("=", 1)[1] if "=" in a else next(it, None)
                if not opts["out"] or opts["out"].startswith("-"):  # --out --overwrite: a flag, not a file name
                    got = f" (got {opts['out']!r})" if opts["out"] else ""
                    _fail(f"--out needs a file name, e.g. --out results/{name}.json{got}")
        elif a in HYDRA_FLAGS_WITH_VALUE or any(a.startswith(f + "=") for f in HYDRA_FLAGS_WITH_VALUE if
                                                f.startswith("--")):
            flags.append(a)
            if "=" not in a:
                value = next(it, None)
                if value is None:
                    _fail(f"{a} needs a value (e.g. --cfg job)")
                flags.append(value)
        elif a in HYDRA_FLAGS:
            flags.append(a)
        elif a.startswith("-"):
            _fail(f"unknown option {a!r} for `python -m distill {name}`; settings are key=value overrides, "
                  f"see python -m distill {name} --help")
        else:
            overrides.append(a)
    if opts.get("overwrite") and not opts.get("out"):
        _fail("--overwrite replaces an existing --out file, and no --out was given (nothing is written without one); "
              "add --out FILE or drop --overwrite")
    return flags, overrides, opts


def _search_path(flags: list[str]) -> list[str]:
    """Hydra's ``--config-dir DIR`` / ``-cd DIR`` flag as a ``hydra.searchpath`` override for :func:`compose`; of
    several, the last, as Hydra takes it."""
    folder, it = None, iter(flags)
    for flag in it:
        if flag in ("--config-dir", "-cd"):
            folder = next(it, None)
        elif flag.startswith("--config-dir="):
            folder = flag.split("=", 1)[1]
    return [f"hydra.searchpath=['file://{Path(folder).expanduser().resolve()}']"] if folder else []


def preflight(name: str, overrides: list[str], multirun: bool, opts: dict, full: bool = True) -> list[list[str]]:
    """Compose and check every job before Hydra runs any: exits 2 with the first problem. Returns the jobs."""
    try:
        overrides = expand_target_shorthand(overrides)
        jobs = sweep_jobs(overrides) if multirun else [overrides]
        if opts.get("out"):
            if len(jobs) > 1:
                raise SetupError("--out with a -m sweep would write every job's result to one file; run the jobs "
                                 "one by one, or leave --out out and read each job's printed JSON")
            check_output_file(opts["out"], "--out", bool(opts.get("overwrite")))
        for num, job in enumerate(jobs):
            cfg = compose(job)
            if full:
                validate(cfg)
                check_inputs(cfg, training=name == "train", generating=name == "generate-data",
                             evaluating=name == "eval")
                if name == "train" and not cfg.train.overwrite:  # the run folder rule, for every job of a sweep
                    out = Path(cfg.train.output_dir) / str(num) if multirun else Path(cfg.train.output_dir)
                    main_process = is_main_process()
                    if main_process:  # (another rank of this launch would see rank 0's own lock as a live run)
                        check_no_live_run(out)  # its files are another run's work in progress: no advice about them
                    prepare_run_folder(out, cfg.train.resume, overwrite=False,  # (a pure check without overwrite)
                                       main=main_process)  # rank 0 may have made it
    except SetupError as e:
        where = f" (sweep job {jobs.index(job)}: {' '.join(job)})" if multirun and "job" in locals() else ""
        _fail(f"{e}{where}")
    except Exception as e:  # a parse error of an override, raised by Hydra's grammar
        if isinstance(e, HydraException):
            _fail(explain(e, overrides))
        raise
    return jobs


def run_hydra_command(name: str, argv: list[str]) -> None:
    """Run ``python -m distill NAME ARGV`` as a Hydra app (``@hydra.main`` over conf/, typed by the schema)."""
    conf = conf_dir()
    if os.environ.get(CONF_ENV) and not (conf / "config.yaml").is_file():
        _fail(f"{CONF_ENV}={os.environ.get(CONF_ENV)}: {conf} has no config.yaml; {CONF_ENV} replaces the whole "
              f"conf/ folder, so start from a copy of the package's ({Path(__file__).resolve().parent / 'conf'} "
              "when installed, conf/ in a checkout) and edit it")
    flags, overrides, opts = _split_argv(name, argv)
    multirun = any(f in ("-m", "--multirun") for f in flags)
    helping = any(f in ("--help", "-h", "--hydra-help", "--version", "--info", "-sc", "--shell-completion")
                  for f in flags)
    showing = any(f in ("--cfg", "-c") for f in flags)
    processes = int(os.environ.get("WORLD_SIZE") or 1)
    if multirun and processes > 1 and not helping:
        # Each launched process would run every job of the sweep, and the second job's process group never forms
        # (both ranks wait in init_process_group forever), so the sweep is refused before anything runs.
        _fail(f"a Hydra sweep (-m) cannot run under a {processes}-process launch (accelerate launch / torchrun): "
              "its second job hangs while setting up the processes; launch one run per sweep value instead, e.g. "
              "for loss in fkl tvd; do accelerate launch ... -m distill train ... loss=$loss "
              "train.output_dir=checkpoints/run-$loss; done")
    if not helping:  # with Hydra's --config-dir as a search path of the checks' compose, as Hydra's run has it
        preflight(name, overrides + _search_path(flags), multirun, opts, full=not showing)
    overrides = [o for o in expand_target_shorthand(overrides)] if not helping else overrides
    command = HYDRA_COMMANDS[name]

    def task(cfg: Any) -> None:
        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN and name in NO_RUN_FOLDER:
            print(f"sweep job {hc.job.num}: {' '.join(hc.overrides.task)}", flush=True)
        elif hc.mode == RunMode.MULTIRUN:  # each job of a sweep in its own run folder
            with open_dict(cfg):
                cfg.train.output_dir = str(hc.runtime.output_dir)
            print(f"sweep job {hc.job.num}: {' '.join(hc.overrides.task)} -> {cfg.train.output_dir}", flush=True)
        try:
            command(cfg, opts)
        except SetupError as e:
            _fail(e)

    GlobalHydra.instance().clear()
    saved = sys.argv
    scratch = None  # Hydra's sweep folder of a command that makes no run folders (its multirun.yaml, empty job dirs)
    if multirun and name in NO_RUN_FOLDER and not helping:
        scratch = tempfile.mkdtemp(prefix=f"distill-{name}-sweep-")
        overrides = [*overrides, f"hydra.sweep.dir={scratch}"]
    sys.argv = [f"python -m distill {name}", *flags, *overrides, f"hydra.job.name={name}"]
    try:
        hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")(task)()
    finally:
        sys.argv = saved
        GlobalHydra.instance().clear()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def cmd_export(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m distill export", description=SUBCOMMANDS["export"])
    p.add_argument("checkpoint", help="a checkpoint folder of a run (<output_dir>/best or <output_dir>/step_N), or an "
                                      "earlier export (its card is carried over)")
    p.add_argument("out_dir", help="where to write the Hugging Face draft")
    p.add_argument("--dtype", default=None, help="save in this dtype (float32, bf16, fp16); default: as trained")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier export in OUT_DIR (a non-empty OUT_DIR is refused otherwise)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let a draft (or LoRA base, tokenizer) that ships its own modeling code (auto_map) run it; "
                        "read that code first")
    p.add_argument("--lora-base", default=None,
                   help="a LoRA checkpoint's base draft, if it moved since training (default: the recorded one)")
    p.add_argument("--full-vocab", action="store_true",
                   help="expand a vocabulary-pruned head back to the full vocabulary (the other ids get zero rows), "
                        "so vLLM and SGLang can serve the export")
    p.add_argument("--draftkit-only", action="store_true",
                   help="export a draft that vLLM or SGLang would reject, for draftkit's decoder only (the card has "
                        "no vLLM/SGLang lines and says why)")
    args = p.parse_args(argv)
    for line in stopped_export_notes(args.out_dir):  # an earlier export killed mid-way: said, never deleted
        print(line, file=sys.stderr)
    try:
        card = export(args.checkpoint, args.out_dir, resolve_dtype(args.dtype) if args.dtype else None,
                      overwrite=args.overwrite, trust_remote_code=args.trust_remote_code, lora_base=args.lora_base,
                      full_vocab=args.full_vocab, draftkit_only=args.draftkit_only)
    except (FileNotFoundError, ValueError) as e:
        _fail(e)
    for line in export_notes(card):
        print(line, file=sys.stderr)
    if not card.get("target_found", True):
        print(f"warning: the run's target {card['target']} is not there now; the card names that path (edit it in "
              f"{args.out_dir}/README.md)", file=sys.stderr)
    slower = slower_temperatures(card.get("evaluation"))
    if slower:
        print("warning: the checkpoint's evaluation predicts this draft slower than plain decoding at temperature "
              + ", ".join(f"{t} ({v:.2f}x)" for t, v in slower.items()) + "; the card says so", file=sys.stderr)
    ev = card.get("evaluation") or {}
    print(json.dumps({"out_dir": args.out_dir, "target": card["target"],
                      "acceptance_rate": ev.get("acceptance_rate")}, indent=2))


def run_cache_logits(cfg: Any, opts: dict) -> None:
    """``cache-logits`` on a composed config: build (or finish) ``data.logit_cache`` and print its summary."""
    summary = build_cache(cfg)
    if is_main_process():
        print(json.dumps(summary, indent=2))


def run_bench_step(cfg: Any, opts: dict) -> None:
    """``bench-step`` on a composed config: the recipe's step against its bound (distill/bench_step.py)."""
    bench_step(cfg, steps=int(opts.get("steps", 10)), warmup=int(opts.get("warmup", 2)), out=opts.get("out"),
               overwrite=bool(opts.get("overwrite")))


HYDRA_COMMANDS: dict[str, Callable[[Any, dict], None]] = {
    "train": run_train, "generate-data": run_generate_data, "eval": run_eval, "cache-logits": run_cache_logits,
    "bench-step": run_bench_step}
# Commands that write nothing into train.output_dir: a -m sweep of one gets no run folders (nor multirun.yaml) there
NO_RUN_FOLDER = ("eval", "bench-step", "cache-logits")
COMMANDS = {"export": cmd_export}
# Programs that use the library rather than belong to it (the quickstart package).
ELSEWHERE = {"pretrain": "python -m quickstart pretrain", "quickstart": "python -m quickstart"}


def main(argv: list[str] | None = None) -> None:
    """Dispatch ``python -m distill SUBCOMMAND ARGS``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        width = max(map(len, SUBCOMMANDS))
        lines = "\n".join(f"  {name.ljust(width)}  {text}" for name, text in SUBCOMMANDS.items())
        print(f"usage: python -m distill SUBCOMMAND [ARGS]\n\nsubcommands:\n{lines}\n\n"
              "Run `python -m distill SUBCOMMAND --help` for each one (train/eval/generate-data list every config "
              "group and key); configs live in conf/ (docs/distill.md).")
        if not argv:
            raise SystemExit(2)
        return
    name, rest = argv[0], argv[1:]
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # per-file/per-model bars drown the run's own
    hf_logging.disable_progress_bar()
    if name in HYDRA_COMMANDS or name in COMMANDS:
        try:
            run_hydra_command(name, rest) if name in HYDRA_COMMANDS else COMMANDS[name](rest)
        except KeyboardInterrupt:  # (train saves a checkpoint first: its own handler; the others printed a traceback)
            print(f"python -m distill {name}: interrupted (Ctrl-C or SIGTERM). What was saved is kept: run the "
                  "same command again to continue (cache-logits and generate-data resume from their last complete shard; an "
                  "export leaves the earlier export as it was)", file=sys.stderr)
            raise SystemExit(130) from None
    elif name in ELSEWHERE:
        _fail(f"`{name}` is part of the quickstart program, not of the distill library: run "
              f"`{ELSEWHERE[name]} {' '.join(rest) or '--help'}`".rstrip())
    else:
        close = difflib.get_close_matches(name, list(SUBCOMMANDS), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        _fail(ValueError(f"unknown subcommand {name!r}{hint}; choose one of {list(SUBCOMMANDS)} "
                         "(python -m distill --help)"))


if __name__ == "__main__":
    main()
