"""The toolkit's main job end to end, offline, in one command: bootstrap a target on real code, pretrain a baseline
draft, distill it against the target, export it, and measure both drafts on held-out real prompts.

    scripts/quickstart.sh                  # installs, then: python -m quickstart
    python -m quickstart --smoke   # the same path in 1-2 minutes (CI end-to-end test)

Phases (each reuses its artifact under ``--out`` when present; the commands are printed so each can be rerun alone):

1. tokenizer  ``python -m quickstart pretrain --tokenizer-only``: byte-level BPE on the stdlib train split.
2. target     ``python -m quickstart pretrain --size target``: Llama from scratch, wall-clock budgeted.
3. draft      ``python -m quickstart pretrain --size draft``: the baseline draft, plain next-token cross-entropy.
4. distill    ``python -m distill cache-logits`` (with ``quickstart.distill.target_logits=cached``, the default: the
              target scores the training data once, top-32 + 128 sampled tail ids per position), then
              ``python -m distill train +experiment=quickstart``: the recipe, starting from the baseline draft.
5. export     ``python -m distill export``: a plain Hugging Face checkpoint of the distilled draft.
6. eval       in this process: α, τ, tokens/s and speedup over plain target decoding for the baseline and the
              exported distilled draft, at each temperature, on HumanEval, MBPP and held-out stdlib prompts.

Measurement (see ``evaluate``): every run goes through ``decode.SpeculativeDecoder``; plain decoding is the same
engine with ``num_draft_tokens=0``; the drafts' forwards are compiled (``quickstart.eval.compile: draft``), the
target's are not, on both sides. For each prompt, plain, baseline and distilled runs follow each other (order
rotated per prompt) with the same generator seed, so machine drift hits all three alike. Speedup is pooled
tokens/s of a draft over pooled tokens/s of plain decoding on the same prompts and temperature. acceptance rate =
Σaccepted / Σdrafted (``DecodeStats.acceptance_rate``), α = the per-token acceptance probability of Leviathan et al.
(2023) that their speedup formula takes (``DecodeStats.alpha``), τ = mean tokens committed per verify
step.

Settings live in ``conf/experiment/quickstart.yaml`` (``quickstart_smoke.yaml`` for ``--smoke``), under the
``quickstart:`` key; the rest of that file configures ``python -m distill train``.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import itertools
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from transformers import AutoTokenizer

from decode.bench.config import HF, BenchConfig, Method
from decode.bench.hf_assisted import run_hf
from decode.bench.measure import acceptance, decode_stats, measure_costs, predict, run_interleaved
from decode.compiling import check_compile, check_cpu_compiler
from decode.costs import warm_up
from decode.engine import SpeculativeDecoder
from decode.loading import chat_prompt_ids, load_causal_lm
from decode.lookup import check_prompt_lookup
from decode.metrics import DecodeStats
from decode.outputs import replace_text
from decode.prompts import checkout_root, load_prompts as load_bench_prompts
from decode.requests import GenerationOutput
from decode.vocab_map import draft_vocab_map, scatter_to_vocab
from distill.checks import validate
from distill.checkpoint import find_latest, is_complete
from distill.config import SetupError, compose, conf_dir
from distill.corpus import CORPORA, check_corpus, load_prompts
from distill.export import CARD_JSON
from distill.logging import sigterm_raises
from distill.runfolder import FolderBusy, lock_folder, rerun_overrides
from quickstart import INTERRUPTED_EXIT
from quickstart.pretrain import RESULT_FILE, SIZES, tokenizer_record
from quickstart.pretrain import main as pretrain_main

REPO = Path(__file__).resolve().parents[1]  # the repository (a checkout) or site-packages (an installed wheel)
RESULTS_FILE = "results.json"
MODES = ("plain", "baseline", "distilled")


# ------------------------------------------------------------------------------------------------ config

MAP_SETTINGS = ("eval.prompt_sets",)  # quickstart settings whose {name: value} override replaces the whole map


def in_checkout() -> bool:
    """Whether the package runs from the repository (a checkout or an editable install), not from site-packages."""
    return checkout_root() is not None


def load_settings(experiment: str, overrides: list[str] = ()) -> Any:
    """The ``quickstart:`` section of ``conf/experiment/<experiment>.yaml`` with ``key=value`` overrides applied
    (keys relative to that section, e.g. ``eval.max_new_tokens=32``).

    Raises:
        FileNotFoundError: no such experiment file.
        KeyError: the file has no ``quickstart:`` section, an override names a key it does not have, or gives a
            section (e.g. ``target``) a value that is not a mapping.
    """
    path = conf_dir() / "experiment" / f"{experiment}.yaml"
    if not path.is_file():
        names = sorted(f.stem for f in path.parent.glob("*.yaml") if "\nquickstart:" in f.read_text())
        conf = os.environ.get("DRAFTKIT_CONF")
        raise FileNotFoundError(f"{path} not found: --experiment names a file of {path.parent} with a "
                                f"'quickstart:' section: {', '.join(names) or 'none there'}"
                                + (f" (DRAFTKIT_CONF={conf} replaces the package's conf/)" if conf else ""))
    raw = OmegaConf.load(path)
    if "quickstart" not in raw:
        raise KeyError(f"{path} has no 'quickstart:' section; it is not a quickstart experiment")
    base = raw.quickstart
    OmegaConf.set_struct(base, True)  # a misspelled override is an error, not a silently ignored new key
    maps = [o for o in overrides if o.split("=", 1)[0] in MAP_SETTINGS]
    given = OmegaConf.from_dotlist([o for o in overrides if o not in maps])
    try:
        merged = OmegaConf.merge(base, given)
    except ConfigKeyError as err:
        raise KeyError(f"unknown quickstart setting ({str(err).splitlines()[0]}); the settings are the keys of the "
                       f"'quickstart:' section of {path}") from err
    OmegaConf.set_struct(merged, False)
    for override in maps:  # {set: n} replaces the sets (a merge kept the others), parsed as Hydra parses a dict
        key = override.split("=", 1)[0]
        try:
            value = OverridesParser.create().parse_overrides([override])[0].value()
        except HydraException as err:
            raise KeyError(f"quickstart setting {override!r}: {str(err).splitlines()[0]}") from None
        if not isinstance(value, dict):
            raise KeyError(f"quickstart setting {override!r}: {key} takes {{name: number}}, e.g. "
                           f"{key}={{humaneval:10,mbpp_code:10}}")
        OmegaConf.update(merged, key, value, merge=False)
    for override in overrides:
        key = override.split("=", 1)[0]
        was, now = OmegaConf.select(base, key), OmegaConf.select(given, key)
        if OmegaConf.is_dict(was) and key not in MAP_SETTINGS and not OmegaConf.is_dict(now):
            raise KeyError(f"quickstart setting {override!r}: {key} is a section ({', '.join(map(str, was))}); set "
                           f"one of its keys, e.g. {key}.{next(iter(was), 'KEY')}=...")
    return merged


def _env(threads: int | None = None) -> dict[str, str]:
    """The phases' environment: offline, quiet, and (``threads``) a bound on torch's CPU threads."""
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               WANDB_MODE=env.get("WANDB_MODE", "offline"), WANDB_SILENT="true")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def run_phase(name: str, cmd: list[str], phases: dict, console, in_process=None, env=None) -> bool:
    """Run one phase's command and record command, seconds and status; True on success.

    ``cmd`` runs as a subprocess (output streamed), or, given ``in_process``, as ``in_process(cmd[4:])`` in this
    process (``python -m quickstart pretrain`` phases: saves the seconds of importing torch and transformers again).
    """
    console.rule(f"[bold]{name}")
    console.print("$ " + shlex.join(["python"] + cmd[1:]), markup=False, highlight=False)
    t0 = time.time()
    if in_process is None:
        rc = _run_child(cmd, env or _env(), console)
    else:
        try:
            in_process(cmd[4:])
            rc = 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except Exception:  # noqa: BLE001 - report and let main() decide, like a failed subprocess
            console.print_exception()
            rc = 1
    phases[name] = {"command": shlex.join(["python"] + cmd[1:]), "seconds": round(time.time() - t0, 1),
                    "status": "ok" if rc == 0 else f"failed (exit {rc})"}
    if rc == INTERRUPTED_EXIT:
        raise KeyboardInterrupt(name)
    return rc == 0


class Terminated(KeyboardInterrupt):
    """SIGTERM, taken like Ctrl-C (``kill PID``, systemd and ``docker stop`` send it): the phase saves, then stop."""


_held_lock = None  # the run's --out lock (lock_out_dir), which every phase's subprocess holds too while it lives


def _phase_process_setup():
    """What a phase's subprocess runs before the phase (``preexec_fn``): its own process group, and SIGTERM when
    this process dies (Linux's ``PR_SET_PDEATHSIG``), so a ``kill -9`` of the quickstart makes the phase save and
    stop instead of training on into the folder a rerun then uses. libc's ``prctl`` is looked up here, in this
    process, so the forked child only calls it. The function never raises (that would stop the phase starting)."""
    prctl = None
    if sys.platform.startswith("linux"):
        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            prctl = None

    def setup() -> None:
        try:
            os.setpgrp()
            if prctl is not None:
                prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
        except Exception:  # noqa: BLE001
            pass

    return setup


def _run_child(cmd: list[str], env: dict, console) -> int:
    """Run a phase's subprocess; its exit status. The child has its own process group, so a Ctrl-C in the terminal
    reaches this process only, and this process passes it on, once, as it does SIGTERM (a child in our group got
    the terminal's Ctrl-C but not a SIGTERM sent to this process, which then died and left the child running on its
    own; a Ctrl-C sent to this process alone never reached the child). Then wait for the child to save its
    checkpoint and exit, instead of ``subprocess.run``'s kill after 0.25 s, which lost the steps since the last
    save; a second Ctrl-C kills it. If this process is killed outright (``kill -9``), the child gets SIGTERM
    (:func:`_phase_process_setup`), and it holds the run's lock until it has exited, so a rerun cannot start
    beside it."""
    lock = [_held_lock.fileno()] if _held_lock is not None else []
    proc = subprocess.Popen(cmd, cwd=REPO if in_checkout() else None, env=env, preexec_fn=_phase_process_setup(),
                            pass_fds=lock)  # an installed package's phases run where the quickstart was started
    try:
        return proc.wait()
    except KeyboardInterrupt as stop:
        proc.send_signal(signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT)
        console.print("[yellow]interrupted: waiting for the phase to save its checkpoint (Ctrl-C again to kill it)")
        try:
            proc.wait()
        except KeyboardInterrupt:
            proc.kill()
            proc.wait()
        raise


def _pretrain_cmd(qs, out: Path, which: str) -> list[str]:
    cmd = [sys.executable, "-m", "quickstart", "pretrain", "--tokenizer", str(out / "tokenizer"), "--corpus", qs.corpus,
           "--vocab-size", str(qs.vocab_size)]
    if which == "tokenizer":
        return cmd + ["--tokenizer-only"]
    p = qs[which]
    cmd += ["--out", str(out / p.dir), "--size", p.size, "--budget-s", str(p.budget_s), "--batch-size",
            str(p.batch_size), "--seq-len", str(p.seq_len), "--lr", str(p.lr), "--val-tokens", str(p.val_tokens)]
    if qs.get("threads"):
        cmd += ["--threads", str(qs.threads)]
    return cmd


def _hydra_path(path: str | Path) -> str:
    """``path`` as the value of a Hydra override: quoted (quotes and a trailing backslash escaped) unless it holds
    only characters Hydra reads literally, so an --out with a quote, comma, ``=`` or bracket reaches the recipe
    as written."""
    text = str(path)
    if re.fullmatch(r"[A-Za-z0-9_/.\-+@% ]*", text):
        return text
    return "'" + re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, text).replace("'", "\\'") + "'"


def _cache_overrides(qs, out: Path) -> list[str]:
    """The recipe overrides of ``quickstart.distill.target_logits=cached`` (none when online)."""
    if str(qs.distill.get("target_logits", "online")) != "cached":
        return []
    return ["data.target_logits=cached", f"data.logit_cache={_hydra_path(out / qs.distill.cache_dir)}",
            f"data.logit_cache_k={int(qs.distill.cache_k)}",
            f"data.logit_cache_tail_samples={int(qs.distill.tail_samples)}"]


def _cache_cmd(qs, experiment: str, out: Path, extra: list[str]) -> list[str]:
    """``python -m distill cache-logits`` with the distill phase's own config (it resumes an interrupted build)."""
    return [sys.executable, "-m", "distill", "cache-logits", f"+experiment={experiment}",
            f"++target.name_or_path={_hydra_path(out / qs.target.dir)}",
            f"draft.name_or_path={_hydra_path(out / qs.draft.dir)}",
            f"train.output_dir={_hydra_path(out / qs.distill.dir)}", *_cache_overrides(qs, out), *extra]


def _cache_complete(qs, out: Path) -> bool:
    """True if the cache folder holds a complete cache made with this run's k and tail samples.

    Raises ValueError naming the folder when it holds a cache made with other settings (reusing it would fail in the
    recipe; rebuilding would delete a user's files)."""
    manifest = out / qs.distill.cache_dir / "manifest.json"
    if not manifest.is_file():
        return False
    try:
        m = json.loads(manifest.read_text())
    except json.JSONDecodeError:
        return False  # damaged: cache-logits names it and the fix
    want = {"k": int(qs.distill.cache_k), "tail_samples": int(qs.distill.tail_samples)}
    have = {key: m.get(key, 0 if key == "tail_samples" else None) for key in want}
    if have != want:
        raise ValueError(f"{manifest.parent} holds a logit cache made with {have}, this run asks for {want}: delete "
                         "that folder to rebuild it, or set distill.cache_k / distill.tail_samples to its values")
    return bool(m.get("complete"))


def _distill_cmd(qs, experiment: str, out: Path, extra: list[str]) -> list[str]:
    run_dir = out / qs.distill.dir
    cmd = [sys.executable, "-m", "distill", "train", f"+experiment={experiment}",
           f"++target.name_or_path={_hydra_path(out / qs.target.dir)}",
           f"draft.name_or_path={_hydra_path(out / qs.draft.dir)}", f"train.output_dir={_hydra_path(run_dir)}",
           *_cache_overrides(qs, out)]
    return cmd + rerun_overrides(run_dir) + list(extra)  # an interrupted run continues (or starts over) in its folder


def _distilled_checkpoint(qs, out: Path) -> Path | None:
    """The recipe's checkpoint to export: ``best/`` (highest α on its held-out windows) else the last step."""
    run_dir = out / qs.distill.dir
    best = run_dir / "best"
    return best if is_complete(best) else find_latest(run_dir)


# ------------------------------------------------------------------------------------------------ evaluation

# Spec-Bench (Xia et al. 2024) reports six categories: its 80 MT-Bench questions (eight categories, first turn
# only) form one, the other five are its own.
SPEC_BENCH = "spec_bench"
SPEC_BENCH_GROUPS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
MT_BENCH_CATEGORIES = frozenset(("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                                 "humanities"))
LOOKUP, HF_ASSISTED = "lookup", "hf_assisted"  # the modes beside plain decoding and the drafts


def spec_bench_prompts(n: int, skip: int = 0) -> list[tuple[str, str]]:
    """``(category, text)`` of ``n`` Spec-Bench prompts after the first ``skip``, taken round-robin over its six
    categories (``SPEC_BENCH_GROUPS``: ``n=12`` gives two of each; MT-Bench's own eight categories take turns
    inside ``mt_bench``), so the timed prompts and the calibration prompts after them never overlap.

    Raises:
        ValueError: a prompt's category is none of Spec-Bench's.
    """
    every = load_bench_prompts(SPEC_BENCH)
    groups: dict[str, list[str]] = {g: [] for g in SPEC_BENCH_GROUPS}
    for p in load_bench_prompts(SPEC_BENCH, len(every)):  # round-robin over the raw categories
        group = "mt_bench" if p.category in MT_BENCH_CATEGORIES else p.category
        if group not in groups:
            raise ValueError(f"Spec-Bench prompt {p.id} has category {p.category!r}, none of "
                             f"{', '.join(SPEC_BENCH_GROUPS)} or MT-Bench's")
        groups[group].append(p.text)
    order = [(g, text) for row in itertools.zip_longest(*groups.values()) for g, text in zip(groups, row)
             if text is not None]
    return order[skip:skip + n]


def encode_prompt_sets(tokenizer, sets: dict[str, int], max_prompt_tokens: int | None,
                       skip: dict[str, int] | None = None, chat: bool = False) -> list[tuple[str, list[int]]]:
    """``(label, token_ids)`` for the first ``n`` prompts of each set (after its first ``skip[set]`` ones); the
    label is the set's name, or for ``spec_bench`` the prompt's category (:func:`spec_bench_prompts`).

    ``chat``: each prompt is one user turn through the tokenizer's chat template with the assistant turn opened
    (:func:`decode.loading.chat_prompt_ids`); else its raw text. ``max_prompt_tokens``: each prompt keeps its last
    this many tokens (the end is what the model continues; the from-scratch target was trained on short windows);
    None keeps all."""
    out = []
    for name, n in sets.items():
        first = int((skip or {}).get(name, 0))
        texts = (spec_bench_prompts(int(n), first) if name == SPEC_BENCH
                 else [(name, text) for text in load_prompts(name, first + int(n))[first:]])
        for label, text in texts:
            ids = (chat_prompt_ids(tokenizer, [{"role": "user", "content": text}]) if chat
                   else list(tokenizer(text)["input_ids"]))
            out.append((label, ids if max_prompt_tokens is None else ids[-max_prompt_tokens:]))
    return out


def _load_lm(path: str | Path, role: str = "draft"):
    """The one loader of decode and distill (fp32, eval, frozen): a vocabulary-pruned draft keeps its id map."""
    return load_causal_lm(str(path), role=role, dtype="float32")


def evaluate(target_dir: str | Path, drafts: dict[str, str | Path], ecfg, console=None) -> dict:
    """Measure each draft against the target on held-out prompts, interleaved with plain target decoding (and,
    as configured, prompt lookup alone and Hugging Face assisted generation).

    Args:
        target_dir: Hugging Face checkpoint of the target (its tokenizer is used for every model).
        drafts: name -> draft checkpoint, e.g. {"baseline": ..., "distilled": ...}; the names are free, the table
            shows them, and the last one's tokens/s and α are also given over the first one's.
        ecfg: ``quickstart.eval`` settings: prompt_sets {name: n} (``spec_bench: n``: n prompts over its six
            categories, a table row each), temperatures, num_draft_tokens (γ: an int for every draft and
            temperature, or ``best``: chosen per draft and temperature by :func:`choose_gammas` on
            ``calibration_prompts`` further prompts of each set, up to ``max_draft_tokens``), max_new_tokens,
            max_prompt_tokens (null: no cut), chat_template (each prompt one user turn of the tokenizer's chat
            template; default false: raw text), ignore_eos (default true: every run makes max_new_tokens; false:
            runs stop at the tokenizer's eos), seed, compile (the drafts' ``SpeculativeDecoder(compile=...)``:
            false, ``draft`` or true; plain decoding is compiled only with true, the one setting that compiles the
            target), prompt_lookup_ngram (the drafts' decoders' prompt lookup for greedy runs, :mod:`decode.lookup`;
            0: off), prompt_lookup_alone (n > 0: a ``lookup`` mode, the target with prompt lookup and no draft,
            γ = the largest γ considered; default 0: none), hf_assisted (a draft's name: an ``hf_assisted`` mode,
            Hugging Face assisted generation with that draft at its γ; default null: none).
        console: rich console for the progress bar (None: a new one).

    Returns:
        dict with ``rows`` (one per temperature x prompt label, plus "all": plain tokens/s and, per mode, γ, α,
        τ, tokens/s, speedup, verify-aware predicted speedup for the drafts), ``modes``, ``drafts``,
        ``cost_ratio`` and ``verify_costs`` per draft (:func:`engine_costs`), ``gammas`` ({mode: {T: γ}}),
        ``calibration`` (:func:`choose_gammas`' output, or None for a fixed γ), ``greedy_lossless`` (greedy
        outputs of every mode that equal plain greedy outputs / total), ``draft_ratio`` and the settings.

    Raises:
        decode.compat.IncompatibleModelsError: a draft does not share the target's vocabulary.
        ValueError: a bad setting (:func:`check_eval_settings`), or ``ignore_eos: false`` with a tokenizer that
            has no eos.
    """
    console = console or Console()
    setting = check_eval_settings(ecfg)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    max_gamma = int(ecfg.get("max_draft_tokens", 8)) if setting == "best" else setting
    compile, lookup_alone = eval_compile(ecfg), int(ecfg.get("prompt_lookup_alone", 0))
    eos = eval_eos(ecfg, tokenizer)
    decoders = eval_decoders(target_dir, drafts, tokenizer, max_gamma, compile, eval_prompt_lookup(ecfg),
                             lookup_alone)
    hf_draft = _hf_assisted_draft(ecfg, drafts, console)
    if hf_draft is not None:
        decoders[HF_ASSISTED] = HFAssisted(decoders["plain"].target, _full_vocab_draft(_load_lm(drafts[hf_draft])),
                                           _pad_id(tokenizer))
    max_prompt = eval_max_prompt_tokens(ecfg)
    chat = bool(ecfg.get("chat_template", False))
    prompts = encode_prompt_sets(tokenizer, dict(ecfg.prompt_sets), max_prompt, chat=chat)
    temps = [float(t) for t in ecfg.temperatures]
    new = int(ecfg.max_new_tokens)
    _warm_up(decoders, prompts[0][1], temps, new, compile, eos, console)
    models = list(drafts)
    calib = (encode_prompt_sets(tokenizer, {k: int(ecfg.get("calibration_prompts", 2)) for k in ecfg.prompt_sets},
                                max_prompt, skip=dict(ecfg.prompt_sets), chat=chat) if setting == "best" else None)
    gammas, costs, calibration = draft_gammas({n: decoders[n] for n in models}, setting, calib, prompts[0][1], temps,
                                              new, int(ecfg.seed), max_gamma, eos, console)
    if lookup_alone:
        gammas[LOOKUP] = {t: max_gamma for t in temps}
    if hf_draft is not None:
        gammas[HF_ASSISTED] = dict(gammas[hf_draft])
    outputs = timed_runs(decoders, prompts, temps, new, int(ecfg.seed), gammas, eos, console)
    modes = [m for m in decoders if m != "plain"]
    labels = [p[0] for p in prompts]
    rows = _pool(outputs, temps, labels, modes, costs, gammas)
    return {"rows": rows, "modes": modes, "drafts": models, "draft_ratio": draft_ratio(rows, models),
            "cost_ratio": {n: c for n, (c, _) in costs.items()}, "verify_costs": {n: v for n, (_, v) in costs.items()},
            "greedy_lossless": greedy_lossless(outputs, len(prompts), list(decoders)),
            "num_prompts": dict(collections.Counter(labels)), "num_draft_tokens": setting,
            "gammas": {n: {str(t): g for t, g in per.items()} for n, per in gammas.items()},
            "calibration": calibration, "max_new_tokens": new, "max_prompt_tokens": max_prompt,
            "chat_template": chat, "eos_token_id": eos, "prompt_lookup_alone": lookup_alone,
            "hf_assisted": hf_draft, "temperatures": temps, "compile": compile,
            "prompt_lookup_ngram": eval_prompt_lookup(ecfg)}


PROBE_GAMMA = 4  # γ of the calibration runs that measure α before γ is chosen


def draft_gammas(decoders: dict, setting: int | str, calib: list[tuple[str, list[int]]] | None, context: list[int],
                 temps: list[float], max_new_tokens: int, seed: int, max_gamma: int, eos: int | None,
                 console) -> tuple[dict, dict, dict | None]:
    """``(gammas {draft: {T: γ}}, costs {draft: (c, v)}, calibration)``: with ``setting`` ``best``, γ chosen on the
    calibration prompts ``calib`` (:func:`choose_gammas`); else γ = ``setting`` everywhere and each draft's cost
    model measured on ``context`` (:func:`engine_costs`), calibration None."""
    if setting != "best":
        return ({n: {t: setting for t in temps} for n in decoders},
                {n: engine_costs(dec, context) for n, dec in decoders.items()}, None)
    console.print(f"eval: choosing γ per draft and temperature on {len(calib)} further prompts (γ = {PROBE_GAMMA}"
                  f" runs, measured costs, γ <= {max_gamma})")
    calibration = choose_gammas(decoders, [ids for _, ids in calib], temps, max_new_tokens, seed, max_gamma, eos)
    gammas = {n: {t: calibration[n]["per_temperature"][t]["num_draft_tokens"] for t in temps} for n in decoders}
    costs = {n: (calibration[n]["cost_ratio"], calibration[n]["verify_costs"]) for n in decoders}
    return gammas, costs, calibration


def eval_decoders(target_dir: str | Path, drafts: dict[str, str | Path], tokenizer, max_gamma: int,
                  compile: bool | str, lookup: int, lookup_alone: int = 0) -> dict[str, SpeculativeDecoder]:
    """``{"plain": the target alone, draft name: the target with that draft[, "lookup": the target with prompt
    lookup of n = lookup_alone and no draft, γ = max_gamma]}``; the drafts' decoders compiled as ``compile`` says,
    plain decoding and lookup only with ``compile=True`` (the one setting that compiles the target)."""
    target = _load_lm(target_dir, "target")
    decoders = {"plain": SpeculativeDecoder(target, None, num_draft_tokens=0, compile=compile is True)}
    for name, path in drafts.items():
        decoders[name] = SpeculativeDecoder(target, _load_lm(path), num_draft_tokens=PROBE_GAMMA, tokenizer=tokenizer,
                                            draft_tokenizer=tokenizer, max_auto_draft_tokens=max_gamma,
                                            compile=compile, prompt_lookup_ngram=lookup)
    if lookup_alone:
        decoders[LOOKUP] = SpeculativeDecoder(target, None, num_draft_tokens=max_gamma, tokenizer=tokenizer,
                                              compile=compile is True, prompt_lookup_ngram=lookup_alone)
    return decoders


class FullVocabHead(torch.nn.Module):
    """A vocabulary-pruned draft's N-row head (:mod:`decode.vocab_map`) as a V-wide one: its N logits at the ids of
    its map, -inf elsewhere, so a caller that reads ids off the head (Hugging Face assisted generation) gets target
    ids and never proposes an id the draft does not score."""

    def __init__(self, head: torch.nn.Module, vocab_map: torch.Tensor, vocab_size: int):
        super().__init__()
        self.head, self.vocab_size = head, vocab_size
        self.register_buffer("vocab_map", vocab_map.clone(), persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return scatter_to_vocab(self.head(hidden), self.vocab_map, self.vocab_size)  # (..., N) -> (..., V)


def _full_vocab_draft(draft):
    """``draft`` itself, or for a vocabulary-pruned one the same model with a :class:`FullVocabHead` (in place:
    give it a copy that nothing else decodes with)."""
    vocab_map = draft_vocab_map(draft)
    if vocab_map is not None:
        draft.set_output_embeddings(FullVocabHead(draft.get_output_embeddings(), vocab_map,
                                                  int(draft.get_input_embeddings().weight.shape[0])))
    return draft


def _pad_id(tokenizer) -> int:
    """The pad id Hugging Face ``generate`` is given (one prompt per call: no padding is ever written)."""
    for value in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if value is not None:
            return int(value)
    return 0


class HFAssisted:
    """Hugging Face assisted generation (``target.generate(assistant_model=draft)``), called as
    :meth:`decode.engine.SpeculativeDecoder.generate` is for one prompt. The call and its timing are the
    benchmark's (:func:`decode.bench.hf_assisted.run_hf`: a fixed γ with a constant schedule and no confidence
    stop, every logits processor neutral so it samples what our decoder samples; tokens/s = new tokens over the
    wall time of the call). Its stats hold tokens and seconds only: HF does not report acceptance."""

    def __init__(self, target, draft, pad_id: int):
        self.target, self.draft, self.pad_id = target, draft, pad_id

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float,
                 generator: torch.Generator, num_draft_tokens: int | None = None,
                 eos_token_id: int | None = None) -> GenerationOutput:
        method = Method(HF_ASSISTED, HF, num_draft_tokens, assisted=True)
        rows, wall, ttft, peak = run_hf(self.target, self.draft, method, input_ids, torch.ones_like(input_ids),
                                        temperature, BenchConfig(max_new_tokens=max_new_tokens), eos_token_id,
                                        self.pad_id, generator.initial_seed(), self.target.device)
        new = torch.tensor(rows[0], dtype=torch.long)
        stats = DecodeStats(num_new_tokens=len(rows[0]), num_sequences=1, total_s=wall, peak_memory_bytes=peak,
                            ttft_s=(ttft.ttft_s or 0.0) if ttft is not None else 0.0)
        return GenerationOutput(sequences=[torch.cat([input_ids[0].cpu(), new])], new_tokens=[new], stats=stats)


def _generate(decoder, ids: list[int], temperature: float, seed: int, max_new_tokens: int, gamma: int | None,
              eos: int | None):
    """One timed run's call (``gamma`` None: the decoder's own γ). ``eos`` None: eos is not a stop, every run
    generates max_new_tokens, so tokens/s compares equal amounts of work."""
    return decoder.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, temperature=temperature,
                            generator=torch.Generator().manual_seed(seed), num_draft_tokens=gamma,
                            eos_token_id=eos)


def _warm_up(decoders: dict, ids: list[int], temps: list[float], max_new_tokens: int, compile: bool | str,
             eos: int | None, console) -> None:
    """Untimed: the first call of each model pays for lazy initialisation, and compilation: a full-length run per
    temperature meets the shapes the timed runs will."""
    for dec in decoders.values():
        _generate(dec, ids[-16:], 0.0, 0, max_new_tokens, None, eos)
    if not compile:
        return
    console.print(f"eval: compiling ({'the drafts' if compile == 'draft' else 'both models'}' forwards, untimed)")
    for mode, dec in decoders.items():
        if isinstance(dec, SpeculativeDecoder) and (dec.draft is not None or compile is True):
            # every shape class at batch 1 (a step's draft input is 3+ tokens only where the prompt lookup covered
            # its leading drafts, which one run may never meet: a graph built in a timed run costs seconds)
            warm_up(dec, 1)
            for temperature in temps:
                _generate(dec, ids, temperature, 0, max_new_tokens, None, eos)


def timed_runs(decoders: dict, prompts: list[tuple[str, list[int]]], temps: list[float], max_new_tokens: int,
               seed: int, gammas: dict, eos: int | None, console) -> dict:
    """Every mode on every prompt and temperature, interleaved (:func:`decode.bench.measure.run_interleaved`: the
    modes' runs on a prompt follow each other, the first rotating from prompt to prompt, with the same generator
    seed), under a progress bar. Returns ``{(temperature, mode): [[output] per prompt]}``."""
    columns = (TextColumn("eval {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("", total=len(temps) * len(prompts) * len(decoders))

        def run(mode: str, i: int, temperature: float):
            out = _generate(decoders[mode], prompts[i][1], temperature, seed * 1_000_003 + i, max_new_tokens,
                            gammas.get(mode, {}).get(temperature), eos)
            bar.update(task, advance=1, description=f"T={temperature:g} {prompts[i][0]}")
            return out

        return run_interleaved(run, list(decoders), len(prompts), temps)


def greedy_lossless(outputs: dict, num_prompts: int, modes: list[str]) -> dict:
    """Greedy outputs of every mode but plain equal to plain greedy decoding's on the same prompt, of all greedy
    runs (``equal``/``total``), and per mode (``by_mode``)."""
    if (0.0, "plain") not in outputs:
        return {"equal": 0, "total": 0, "by_mode": {}}
    plain = [runs[0].new_tokens[0] for runs in outputs[(0.0, "plain")]]
    by_mode = {m: sum(torch.equal(outputs[(0.0, m)][i][0].new_tokens[0], plain[i]) for i in range(num_prompts))
               for m in modes if m != "plain"}
    return {"equal": sum(by_mode.values()), "total": num_prompts * len(by_mode), "by_mode": by_mode}


def eval_eos(ecfg, tokenizer) -> int | None:
    """The stop id of every run: None with ``quickstart.eval.ignore_eos`` true (the default: every run makes
    max_new_tokens), else the tokenizer's eos (for a chat model, the end of its turn, e.g. ``<|im_end|>``).
    Raises ValueError when the tokenizer has none."""
    if ecfg.get("ignore_eos", True):
        return None
    if tokenizer.eos_token_id is None:
        raise ValueError("quickstart.eval.ignore_eos=false: the target's tokenizer has no eos token to stop at; "
                         "set eval.ignore_eos=true")
    return int(tokenizer.eos_token_id)


def eval_max_prompt_tokens(ecfg) -> int | None:
    """``quickstart.eval.max_prompt_tokens``: an integer >= 1 (each prompt keeps its last this many tokens), or
    null (no cut); 192 when absent."""
    value = ecfg.get("max_prompt_tokens", 192)
    return None if value is None else int(value)


def _hf_assisted_draft(ecfg, drafts: dict, console) -> str | None:
    """The draft ``quickstart.eval.hf_assisted`` names, or None: unset, or (said on ``console``) a draft this
    evaluation does not have (a distillation that failed leaves the first draft only)."""
    name = ecfg.get("hf_assisted")
    if name is None:
        return None
    if name not in drafts:
        console.print(f"[yellow]eval: quickstart.eval.hf_assisted={name!r} names no draft of this evaluation "
                      f"({', '.join(drafts)}); Hugging Face assisted generation is left out")
        return None
    return name


def eval_compile(ecfg) -> bool | str:
    """``quickstart.eval.compile`` checked: false (also when the key is absent), ``draft`` (the drafts' forwards
    compiled, the target eager: the quickstart's default) or true (both models'). Compilation needs a C++
    compiler (inductor's CPU backend), so its absence is named here, before any training, not in the evaluation 20
    minutes later.

    Raises:
        ValueError: another value, or no working C++ compiler where inductor looks (``$CXX``, else ``g++``;
            :func:`decode.compiling.check_cpu_compiler`).
    """
    value = ecfg.get("compile", False)
    try:
        value = check_compile(value)
    except ValueError:
        raise ValueError(f"quickstart.eval.compile={value!r}: use false, draft (the drafts' forwards compiled, "
                         "docs/decode.md \"Compilation\") or true (both models)") from None
    if value:
        check_cpu_compiler(f"quickstart.eval.compile={value}", "set eval.compile=false")
    return value


def gamma_setting(value) -> int | str:
    """``quickstart.eval.num_draft_tokens``: a positive int, or ``"best"``. Raises ValueError naming the setting."""
    if isinstance(value, str) and value.strip().lower() == "best":
        return "best"
    try:
        gamma = int(value)
    except (TypeError, ValueError):
        gamma = 0
    if gamma < 1 or str(value).strip() != str(gamma):
        raise ValueError(f"quickstart.eval.num_draft_tokens={value!r}: use a positive integer γ or 'best' "
                         f"(γ chosen per draft and temperature)")
    return gamma


def _check_number(key: str, value, kind=int, low: int = 1) -> None:
    """``quickstart.<key>`` must be an integer >= ``low``, or (``kind=float``) a finite number > 0; else ValueError
    naming the setting."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int)
          and math.isfinite(value) and (value > 0 if kind is float else value >= low))
    if not ok:
        raise ValueError(f"quickstart.{key}={value!r} must be " +
                         ("a number > 0" if kind is float else f"an integer >= {low}"))


def _check_eval_count(ecfg, key: str, default: int, low: int = 1) -> None:
    """``quickstart.eval.<key>`` (``default`` when absent) must be an integer >= ``low``."""
    _check_number(f"eval.{key}", ecfg.get(key, default), low=low)


def check_pretrain_settings(qs) -> None:
    """Check the pretraining settings (``quickstart.corpus``, ``vocab_size``, ``threads``, ``target.*`` and
    ``draft.*``) before any phase runs. Raises ValueError naming the setting and what it takes."""
    if qs.corpus not in CORPORA:
        raise ValueError(f"quickstart.corpus={qs.corpus!r} is not a corpus; choose one of {', '.join(CORPORA)}")
    try:
        check_corpus(qs.corpus)
    except FileNotFoundError as err:
        raise ValueError(f"quickstart.corpus={qs.corpus}: {err}") from None
    _check_number("vocab_size", qs.vocab_size, low=259)
    if qs.get("threads") is not None:
        _check_number("threads", qs.threads, low=0)  # 0 or null: torch's default
    d = qs.distill
    mode = str(d.get("target_logits", "online"))
    if mode not in ("online", "cached"):
        raise ValueError(f"quickstart.distill.target_logits={mode!r}: choose online or cached")
    if mode == "cached":
        _check_number("distill.cache_k", d.get("cache_k"))
        _check_number("distill.tail_samples", d.get("tail_samples"), low=0)
        if not d.get("cache_dir"):
            raise ValueError("quickstart.distill.cache_dir is empty; give the cache folder's name under the output")
    for which in ("target", "draft"):
        p = qs[which]
        if p.size not in SIZES:
            raise ValueError(f"quickstart.{which}.size={p.size!r} is not a size preset; choose one of "
                             f"{', '.join(sorted(SIZES))}")
        _check_number(f"{which}.budget_s", p.budget_s, float)
        _check_number(f"{which}.batch_size", p.batch_size)
        _check_number(f"{which}.seq_len", p.seq_len, low=2)
        _check_number(f"{which}.lr", p.lr, float)
        _check_number(f"{which}.val_tokens", p.val_tokens)


# Recipe keys the quickstart sets for its distill phase, with what sets them: --distill-overrides may not (the phase
# would train elsewhere and the export find nothing, or resume/overwrite against the quickstart's own rule).
QUICKSTART_OWNS = {
    "target.name_or_path": "its target, <--out>/quickstart.target.dir", "target": "its target, under --out",
    "draft.name_or_path": "the baseline draft, <--out>/quickstart.draft.dir",
    "train.output_dir": "<--out>/quickstart.distill.dir", "data.logit_cache": "<--out>/quickstart.distill.cache_dir",
    "train.resume": "an interrupted run continues on the next quickstart run",
    "train.overwrite": "a run killed before its first save starts over on the next quickstart run"}


def check_distill_settings(qs, experiment: str, out: Path, extra: list[str]) -> None:
    """Compose the distill phase's config (``+experiment=``, the cache settings, ``--distill-overrides``) and check
    every value that needs no model, so a typo fails now and not after the pretraining phases. The target and
    draft folders do not exist yet; their paths are checked when the phase starts.

    Raises ValueError naming the setting (a ``quickstart.distill.*`` one when it feeds the recipe's key)."""
    for override in extra:
        key = override.split("=", 1)[0].lstrip("+~")
        if key in QUICKSTART_OWNS:
            raise ValueError(f"--distill-overrides {override!r}: the quickstart sets {key} itself "
                             f"({QUICKSTART_OWNS[key]}); leave it out")
    overrides = _distill_cmd(qs, experiment, out, extra)[4:]  # after: python -m distill train
    try:
        validate(compose(overrides), model_paths=False)
    except SetupError as err:
        fed = {"data.logit_cache_k": "quickstart.distill.cache_k",
               "data.logit_cache_tail_samples": "quickstart.distill.tail_samples"}
        hint = next((f" (set by {q})" for key, q in fed.items() if key in str(err)
                     and not any(x.lstrip("+").startswith(key + "=") for x in extra)), "")
        raise ValueError(f"the distill phase's config: {err}{hint}") from None


def eval_prompt_lookup(ecfg) -> int:
    """``quickstart.eval.prompt_lookup_ngram`` checked: the drafts' decoders' ``prompt_lookup_ngram`` (an integer
    >= 0; 0 or absent: off). Raises ValueError naming the setting."""
    return check_prompt_lookup(ecfg.get("prompt_lookup_ngram", 0), name="quickstart.eval.prompt_lookup_ngram")


def check_eval_settings(ecfg) -> int | str:
    """Check every ``quickstart.eval`` setting the evaluation reads, so a bad one stops the run before any
    training (not 25 minutes later). Returns the γ setting (:func:`gamma_setting`). Raises ValueError naming the
    setting and what it takes."""
    setting = gamma_setting(ecfg.get("num_draft_tokens", "best"))
    eval_compile(ecfg)
    eval_prompt_lookup(ecfg)
    # the first token comes from the prefill: one more is the least that drafts
    _check_eval_count(ecfg, "max_new_tokens", 64, low=2)
    if ecfg.get("max_prompt_tokens", 192) is not None:  # null: prompts are not cut
        _check_eval_count(ecfg, "max_prompt_tokens", 192)
    for key, default in (("chat_template", False), ("ignore_eos", True)):
        if not isinstance(ecfg.get(key, default), bool):
            raise ValueError(f"quickstart.eval.{key}={ecfg.get(key)!r}: use true or false")
    check_prompt_lookup(ecfg.get("prompt_lookup_alone", 0), name="quickstart.eval.prompt_lookup_alone")
    hf = ecfg.get("hf_assisted")
    if hf is not None and (not isinstance(hf, str) or hf in ("plain", LOOKUP, HF_ASSISTED)):
        raise ValueError(f"quickstart.eval.hf_assisted={hf!r}: give the name of a draft (e.g. distilled) for Hugging "
                         "Face assisted generation with it, or null for none")
    _check_eval_count(ecfg, "seed", 0, low=0)
    if setting == "best":
        _check_eval_count(ecfg, "max_draft_tokens", 8)
        _check_eval_count(ecfg, "calibration_prompts", 2)
    temps = ecfg.get("temperatures")
    try:
        bad = not temps or any(not (math.isfinite(float(t)) and float(t) >= 0) for t in temps)
    except (TypeError, ValueError):
        bad = True
    if bad:
        raise ValueError(f"quickstart.eval.temperatures={temps!r}: use a non-empty list of temperatures >= 0 "
                         "(0 = greedy), e.g. [0.0,1.0]")
    sets = ecfg.get("prompt_sets")
    if not sets or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in dict(sets).values()):
        raise ValueError(f"quickstart.eval.prompt_sets={sets!r}: use {{set: number of prompts >= 1}}, e.g. "
                         "{humaneval: 10, mbpp_code: 10, stdlib: 10} or {spec_bench: 12}")
    clash = sorted(set(dict(sets)) & set(SPEC_BENCH_GROUPS)) if SPEC_BENCH in sets else []
    if clash:
        raise ValueError(f"quickstart.eval.prompt_sets names {SPEC_BENCH} and {', '.join(clash)}, which is also a "
                         f"Spec-Bench category (a table row each): leave {', '.join(clash)} out")
    return setting


def check_prompt_sets(ecfg) -> None:
    """Every set of ``quickstart.eval.prompt_sets`` exists and holds its number of timed prompts plus the
    ``calibration_prompts`` after them (γ = best), so the table never labels fewer prompts than it measured.
    Raises ValueError naming the setting."""
    calibration = int(ecfg.get("calibration_prompts", 2)) if gamma_setting(
        ecfg.get("num_draft_tokens", "best")) == "best" else 0
    for name, n in dict(ecfg.prompt_sets).items():
        try:
            have = len(load_prompts(name))
        except (ValueError, FileNotFoundError) as err:
            raise ValueError(f"quickstart.eval.prompt_sets.{name}: {err}") from None
        if n + calibration > have:
            why = f" + {calibration} after them for the γ choice (eval.calibration_prompts)" if calibration else ""
            raise ValueError(f"quickstart.eval.prompt_sets.{name}={n}: the set has {have} prompts and the run needs "
                             f"{n}{why}; use at most {have - calibration}")


def _pretrain_record(folder: Path) -> dict | None:
    """``folder/pretrain.json`` (a finished pretraining phase), or None. Raises ValueError if it is not JSON."""
    try:
        return _read_json(folder / RESULT_FILE)
    except ValueError:
        raise ValueError(f"{folder / RESULT_FILE} is damaged (not JSON): delete {folder} to retrain it") from None


def check_artifacts(qs, out: Path) -> None:
    """Before any phase: the artifacts already under ``out`` may be reused by this run.

    A finished target or baseline draft made with another size, corpus, window or vocabulary (a ``--smoke`` folder
    given to a full run, or the reverse) is refused, not reused as if this run had made it; so is a logit cache made
    with other ``cache_k`` / ``tail_samples``. An artifact made from an earlier phase that is missing now (its folder
    deleted to redo it) is refused too: the phases after it must be redone, so their folders must go as well. Nothing
    is deleted here. Raises ValueError naming the folder and the fix."""
    shared = {"corpus": ("corpus", qs.corpus), "vocab_size": ("vocab_size", int(qs.vocab_size))}
    # The tokenizer is checked against its own record too: one made for another vocabulary, reused, would train
    # models that record the asked-for value, not the real one (a tokenizer without a record is not checked).
    records = [(out / "tokenizer", "tokenizer", tokenizer_record(out / "tokenizer") or {}, shared)]
    for which in ("target", "draft"):
        folder = out / qs[which].dir
        records.append((folder, which, (_pretrain_record(folder) or {}).get("config") or {},
                        {f"{which}.size": ("size", qs[which].size), **shared,
                         f"{which}.seq_len": ("seq_len", int(qs[which].seq_len))}))
    for folder, which, old, want in records:
        diff = {key: (old[field], value) for key, (field, value) in want.items()
                if field in old and old[field] != value}
        if diff:
            made = ", ".join(f"{k}={o!r}" for k, (o, _) in diff.items())
            asked = ", ".join(f"{k}={v!r}" for k, (_, v) in diff.items())
            raise ValueError(f"{folder} holds a {which} made with {made}, and this run asks for {asked}: choose "
                             "another --out, or set those settings to its values to reuse it (a --smoke run and a "
                             "full one need separate folders)")
    _cache_complete(qs, out)  # a cache made with other settings: named now, not after the pretraining phases
    done = {"tokenizer/": (out / "tokenizer" / "tokenizer.json").is_file()}
    for which in ("target", "draft"):
        done[f"{qs[which].dir}/"] = _pretrain_record(out / qs[which].dir) is not None
    cache = out / qs.distill.cache_dir / "manifest.json"
    done[f"{qs.distill.cache_dir}/"] = cache.is_file()
    done[f"{qs.distill.dir}/"] = (out / qs.distill.dir).is_dir() and find_latest(out / qs.distill.dir) is not None
    done[f"{qs.export.dir}/"] = (out / qs.export.dir / "config.json").is_file()
    names = list(done)  # tokenizer, target, draft, cache, distill, export
    later = {names[0]: names[1:], names[1]: names[3:], names[2]: names[4:]}
    for phase, after in later.items():
        stale = [n for n in after if done[n]]
        if not done[phase] and stale:
            raise ValueError(f"{out / phase} holds no finished {phase.rstrip('/')}, but {', '.join(stale)} (made "
                             f"from the earlier one) {'is' if len(stale) == 1 else 'are'} still in {out}: delete them too so they are redone with the "
                             f"new one, or put the earlier {phase} back (nothing is deleted for you)")


def make_out_dir(out: Path, setting: str) -> None:
    """Create the output folder now, before any work, or raise ValueError naming ``setting`` and why it cannot."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"{setting} {out} is a file, not a folder: give a folder (a new one, or an earlier run's to "
                         "reuse its artifacts)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".quickstart-write-probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"{setting} {out} cannot be used: {err.strerror or err} ({err.filename or out}); give a "
                         "folder you can create and write to") from None


LOCK_FILE = ".quickstart.lock"


def lock_out_dir(out: Path):
    """Hold an exclusive lock on ``out/.quickstart.lock`` for this run (``distill.runfolder.lock_folder``: it goes
    with the process, also on ``kill -9``), or raise ValueError when another quickstart holds it (two runs into one
    folder trained, overwrote and mixed each other's phases). Returns the open file (keep it open while the run
    lasts); None where ``fcntl`` does not exist (Windows)."""
    try:
        return lock_folder(out, LOCK_FILE)
    except FolderBusy as err:
        raise ValueError(f"another quickstart is running into {out} ({err.holder or 'its process is not named'}); "
                         "wait for it to finish or stop it (Ctrl-C: its phase saves first), or give another --out"
                         ) from None


def choose_gammas(decoders: dict, prompts: list[list[int]], temperatures: list[float], max_new_tokens: int,
                  seed: int, max_gamma: int, eos: int | None = None) -> dict:
    """Choose γ per draft and temperature from a calibration run, before any timed run.

    For each draft, the engine's own cost model is measured (:func:`engine_costs`: c and the verify costs v_γ for
    γ <= the decoder's ``max_auto_draft_tokens``), each prompt is decoded at γ = ``PROBE_GAMMA`` per temperature
    to measure Leviathan et al.'s per-token acceptance α (``DecodeStats.alpha``, pooled), and γ is the one of the
    verify-aware prediction ``(1 − α^(γ+1)) / ((1 − α)(γc + v_γ))`` that is best over ``1..max_gamma``
    (:func:`decode.bench.measure.predict`; γ = 0 would be plain decoding, which the table already shows). The
    prompts must be disjoint from the timed ones, so that the choice is not fitted to the measurement it is judged
    by.

    Args:
        decoders: name -> ``SpeculativeDecoder`` with a draft and ``max_auto_draft_tokens >= max_gamma``.
        prompts: token-id lists (the calibration prompts).
        temperatures: decoding temperatures; max_new_tokens: tokens per calibration run; seed: generator seed base.
        max_gamma: largest γ considered (>= 1).
        eos: the runs' stop id (None: each run makes max_new_tokens).

    Returns:
        ``{name: {"cost_ratio": c, "verify_costs": [v_0 = 1, .., v_max], "per_temperature": {T: {"alpha": α,
        "num_draft_tokens": γ, "predicted_speedup": verify-aware prediction at γ}}}}``.

    Raises:
        ValueError: no prompts, or ``max_gamma < 1``.
    """
    if not prompts:
        raise ValueError("choose_gammas needs calibration prompts (quickstart.eval.calibration_prompts >= 1)")
    if max_gamma < 1:
        raise ValueError(f"quickstart.eval.max_draft_tokens must be >= 1, got {max_gamma}")
    out = {}
    for name, dec in decoders.items():
        c, v = engine_costs(dec, prompts[0])
        per_t = {}
        for t in temperatures:
            seeds = [seed * 1_000_003 + 500_000 + i for i in range(len(prompts))]
            alpha = decode_stats(dec, prompts, t, max_new_tokens, seeds, eos_token_id=eos,
                                 num_draft_tokens=PROBE_GAMMA).alpha
            g, predicted = predict(alpha, c, v, max_gamma=max_gamma)  # alpha: 0.0 with no trial
            per_t[t] = {"alpha": alpha, "num_draft_tokens": g, "predicted_speedup": predicted}
        out[name] = {"cost_ratio": c, "verify_costs": v, "per_temperature": per_t}
    return out


def engine_costs(decoder, context: list[int]) -> tuple[float, list[float]]:
    """The decoder's own cost model at batch 1 (:func:`decode.bench.measure.measure_costs` on a context of 64 tokens,
    as ``decode.costs.calibrate`` times): c = draft / target time of a single-token decode forward and
    ``[v_0 = 1, v_1, .., v_max]``, v_γ = target forward over γ + 1 tokens / over one, for γ up to the decoder's
    ``max_auto_draft_tokens``. One measurement per draft serves both the γ choice and the table's prediction."""
    gammas = decoder.max_auto_draft_tokens  # 64 timed tokens, as calibrate() times: measure_costs leaves room for γ + 1
    return measure_costs(decoder, [context], gammas, context_tokens=64 + gammas + 1, repeats=11)


def _pool(outputs: dict, temps: list[float], labels: list[str], modes: list[str], costs: dict,
          gammas: dict) -> list[dict]:
    """One row per (temperature, prompt label) and (temperature, "all"), pooling DecodeStats over prompts; a cell
    per mode (the drafts' with their cost model, ``costs``)."""
    rows = []
    for t in temps:
        for s in list(dict.fromkeys(labels)) + ["all"]:
            plain = _pooled(outputs[(t, "plain")], labels, s)
            row = {"temperature": t, "set": s, "plain_tokens_per_s": plain.tokens_per_s,
                   "plain_new_tokens": plain.num_new_tokens}
            for m in modes:
                row[m] = _draft_cell(_pooled(outputs[(t, m)], labels, s), plain, gammas[m][t], *costs.get(m, (None,
                                                                                                              None)))
            rows.append(row)
    return rows


def _pooled(runs_per_prompt: list, labels: list[str], prompt_set: str) -> DecodeStats:
    """One mode's stats at one temperature, pooled over the prompts labelled ``prompt_set`` (``"all"``: every
    one)."""
    return DecodeStats.merge([runs[0].stats for name, runs in zip(labels, runs_per_prompt)
                              if prompt_set in ("all", name)])


def _draft_cell(st: DecodeStats, plain: DecodeStats, gamma: int, cost_ratio: float | None,
                verify_costs: list[float] | None) -> dict:
    """A mode's α, τ, tokens/s, speedup over plain and (given its cost model) verify-aware prediction at its γ,
    from pooled stats."""
    m = acceptance(st)
    return {"num_draft_tokens": gamma, "acceptance_rate": m["acceptance_rate"], "alpha": m["alpha"],
            "mean_accepted_length": m["mean_accepted_length"], "tokens_per_s": st.tokens_per_s,
            "speedup": st.tokens_per_s / plain.tokens_per_s,
            "predicted_speedup": (predict(m["alpha"], cost_ratio, verify_costs, gamma=gamma)[1]
                                  if m["alpha"] is not None and cost_ratio is not None else None),
            "num_new_tokens": st.num_new_tokens, "num_verify_steps": st.num_verify_steps,
            "accepted_length_histogram": m["accepted_length_histogram"]}


def draft_ratio(rows: list[dict], drafts: list[str]) -> dict | None:
    """The last draft over the first (e.g. distilled over the step-0 draft) on every prompt, per temperature:
    tokens/s ratio and both α. None with fewer than two drafts."""
    if len(drafts) < 2:
        return None
    first, last = drafts[0], drafts[-1]
    return {"of": last, "over": first,
            "per_temperature": {str(r["temperature"]): {
                "tokens_per_s": r[last]["tokens_per_s"] / r[first]["tokens_per_s"],
                "alpha": {first: r[first]["alpha"], last: r[last]["alpha"]}} for r in rows if r["set"] == "all"}}


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _eval_caption(ev: dict) -> str:
    """The speed table's title: how γ was set, compilation, prompt lookup, prompts and the stop rule."""
    chosen = ("γ chosen per draft and temperature on further prompts" if ev["num_draft_tokens"] == "best"
              else f"γ={ev['num_draft_tokens']}")
    chosen += {"draft": ", drafts compiled", True: ", both models compiled"}.get(ev.get("compile"), "")
    if ev.get("prompt_lookup_ngram"):
        chosen += f", prompt lookup (n = {ev['prompt_lookup_ngram']}) beside the drafts at T = 0"
    if ev.get("prompt_lookup_alone"):
        chosen += (f", lookup = prompt lookup alone (n = {ev['prompt_lookup_alone']}, no draft; greedy only: at "
                   "T > 0 it is plain decoding)")
    if ev.get("hf_assisted"):
        chosen += f", hf_assisted = Hugging Face assisted generation with {ev['hf_assisted']} at its γ"
    prompts = "chat-template prompts" if ev.get("chat_template") else "raw-text prompts"
    stop = ("runs stop at eos: tokens/s = pooled new tokens / pooled seconds over prompts" if
            ev.get("eos_token_id") is not None else
            f"{ev['max_new_tokens']} new tokens per prompt, tokens/s pooled over prompts")
    return f"speculative decoding vs plain target decoding ({chosen}; {prompts}, {stop})"


def render_table(results: dict, console) -> None:
    """The quickstart's summary: models, then γ / α / τ / tokens/s / speedup per mode, temperature and prompt
    label, and the last draft against the first."""
    models = Table(title="quickstart models (measured in this run)")
    for col in ("model", "params", "non-embedding", "val loss (nats/token)", "bits/byte", "tokens seen", "train s"):
        models.add_column(col, justify="right" if col != "model" else "left")
    for name in ("target", "baseline_draft"):
        m = results.get(name)
        if m:
            models.add_row(name, f"{m['params'] / 1e6:.2f}M", f"{m['params_non_embedding'] / 1e6:.2f}M",
                           f"{m['val_loss']:.3f}", f"{m['val_bits_per_byte']:.3f}", f"{m['tokens_seen'] / 1e6:.2f}M",
                           f"{m['train_s']:.0f}")
    if models.row_count:  # a target imported rather than trained here has no pretraining record
        console.print(models)
    ev = results.get("eval")
    if not ev:
        return
    modes = ev.get("modes") or [k for k, v in ev["rows"][0].items() if isinstance(v, dict)]
    table = Table(title=_eval_caption(ev))
    for col in ("T", "prompts", "mode", "γ", "acc. rate", "α", "τ", "tokens/s", "plain tokens/s", "speedup",
                "predicted"):
        table.add_column(col, justify="left" if col in ("prompts", "mode") else "right")
    for r in ev["rows"]:
        n = ev["num_prompts"].get(r["set"], sum(ev["num_prompts"].values()))
        for i, d in enumerate(modes):
            m = r[d]
            pred = f"{m['predicted_speedup']:.2f}x" if m.get("predicted_speedup") is not None else "-"
            table.add_row(f"{r['temperature']:g}" if i == 0 else "", f"{r['set']} ({n})" if i == 0 else "", d,
                          _fmt(m.get("num_draft_tokens", ev["num_draft_tokens"]), ""), _fmt(m["acceptance_rate"], ".3f"),
                          _fmt(m.get("alpha"), ".3f"),
                          _fmt(m["mean_accepted_length"], ".2f"), f"{m['tokens_per_s']:.1f}",
                          f"{r['plain_tokens_per_s']:.1f}" if i == 0 else "", f"{m['speedup']:.2f}x", pred,
                          end_section=(i == len(modes) - 1 and r["set"] == "all"))
    console.print(table)
    costs = ", ".join(f"{d} c={c:.3f}" for d, c in ev["cost_ratio"].items() if c is not None)
    lossless = ev["greedy_lossless"]
    per_mode = ", ".join(f"{m} {k}" for m, k in lossless.get("by_mode", {}).items())
    console.print(f"acc. rate = acceptance rate Σaccepted/Σdrafted; α = Leviathan et al.'s per-token acceptance "
                  f"probability (DecodeStats.alpha); predicted = (1 − α^(γ+1)) / ((1 − α)(γc + v_γ)) "
                  f"with the engine's measured draft/target forward cost ratio c ({costs or 'n/a'}) and verify cost "
                  f"v_γ (a target forward over γ+1 tokens / over one). Greedy output identical to plain greedy "
                  f"output in {lossless['equal']}/{lossless['total']} runs"
                  + (f" ({per_mode} of {ev['greedy_lossless']['total'] // max(len(lossless['by_mode']), 1)} each)."
                     if per_mode else "."))
    ratio = ev.get("draft_ratio")
    if ratio:
        per_t = "; ".join(f"T={float(t):g}: {x['tokens_per_s']:.2f}x tokens/s, α {_fmt(x['alpha'][ratio['over']], '.3f')}"
                          f" -> {_fmt(x['alpha'][ratio['of']], '.3f')}" for t, x in ratio["per_temperature"].items())
        console.print(f"{ratio['of']} vs {ratio['over']} on all prompts: {per_t}")


# ------------------------------------------------------------------------------------------------ main

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m quickstart",
        description="Bootstrap a target on the Python stdlib, pretrain a baseline draft, distill it, export it, and "
                    "measure α, τ and speedup of both drafts on HumanEval, MBPP and held-out stdlib prompts. "
                    "Artifacts under --out are reused when present.")
    p.add_argument("overrides", nargs="*", help="settings of the quickstart: section, e.g. target.budget_s=300 "
                   "eval.prompt_sets.mbpp_code=20")
    p.add_argument("--smoke", action="store_true", help="tiny sizes and seconds of training (experiment "
                   "quickstart_smoke): the same path in 1-2 minutes")
    p.add_argument("--experiment", default=None, help="conf/experiment/NAME.yaml (default: quickstart, or "
                   "quickstart_smoke with --smoke)")
    p.add_argument("--out", default=None, help="output folder (default: the experiment's out_dir)")
    p.add_argument("--distill-overrides", default="", help="extra Hydra overrides for `python -m distill train`, "
                   "quoted, e.g. \"train.max_steps=800 optim.lr=1e-3\"; another loss or on-policy data need the "
                   "target online: distill.target_logits=online --distill-overrides \"loss=tvd "
                   "data.on_policy_fraction=0.5\"")
    return p


def _environment() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.is_available()}


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def main(argv: list[str] | None = None) -> int:
    """Run the quickstart; print the tables; write ``<out>/results.json``. Returns the exit status (1 if a phase
    failed; the evaluation still runs on whatever was produced)."""
    args = build_parser().parse_intermixed_args(argv)  # settings before and after --out alike
    experiment = args.experiment or ("quickstart_smoke" if args.smoke else "quickstart")
    try:
        qs = load_settings(experiment, args.overrides)
        # --out as any command takes a path: from where it was typed (scripts/quickstart.sh runs from the repository
        # and passes that folder as QUICKSTART_CWD); the experiment's own out_dir is a folder of the repository
        # (a checkout's; an installed package's is relative to the current folder, not to site-packages)
        base = REPO if not args.out and in_checkout() else Path(os.environ.get("QUICKSTART_CWD") or os.getcwd())
        out = Path(args.out or qs.out_dir).expanduser()
        out = (out if out.is_absolute() else base / out).resolve()
        try:
            extra = shlex.split(args.distill_overrides)
        except ValueError as err:
            raise ValueError(f"--distill-overrides {args.distill_overrides!r}: {err} (quote each override as the "
                             "shell would)") from None
        check_pretrain_settings(qs)  # every setting before the first phase, not after 25 minutes of training
        check_distill_settings(qs, experiment, out, extra)
        check_eval_settings(qs.eval)
        check_prompt_sets(qs.eval)
        check_artifacts(qs, out)  # what is under --out already: reused only if this configuration made it
        make_out_dir(out, "--out" if args.out else f"quickstart.out_dir ({qs.out_dir})")
        lock = lock_out_dir(out)  # held until the run ends (closed below), and by each phase's subprocess
    except (FileNotFoundError, KeyError, ValueError) as err:
        print(f"error: {err.args[0] if err.args else err}", file=sys.stderr)
        return 2
    console = Console(width=None if sys.stdout.isatty() else 132)  # CI logs: wide enough for the tables
    phases: dict[str, dict] = {}
    results: dict[str, Any] = {"experiment": experiment, "out": str(out), "environment": _environment(),
                               "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "phases": phases}
    t_start = time.time()
    for key, value in _env(qs.get("threads")).items():  # the in-process phases run offline too
        os.environ.setdefault(key, value)
    global _held_lock
    _held_lock = lock
    try:
        with sigterm_raises(Terminated):  # like Ctrl-C: the phase saves, exit 130
            return _run_phases(qs, experiment, out, extra, console, phases, results, t_start)
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted; nothing is lost: run the same command again to continue (finished "
                      f"phases under {out} are reused, an interrupted one resumes from its last save)")
        return INTERRUPTED_EXIT
    finally:
        _held_lock = None
        if lock is not None:
            lock.close()


def _cached(name: str, marker: Path, phases: dict, console) -> bool:
    """Whether the phase ``name`` is done (its ``marker`` file exists); if so, record and say that it is reused."""
    if marker.is_file():
        phases[name] = {"status": f"cached ({marker.parent})", "seconds": 0.0}
        console.print(f"[dim]{name}: reusing {marker.parent}")
    return marker.is_file()


def _run_phases(qs, experiment: str, out: Path, extra: list[str], console, phases: dict, results: dict,
                t_start: float) -> int:
    """:func:`main`'s phases and evaluation, after every check."""
    env = _env(qs.get("threads"))
    ok = True
    for name in ("tokenizer", "target", "draft"):
        marker = out / "tokenizer" / "tokenizer.json" if name == "tokenizer" else out / qs[name].dir / "pretrain.json"
        if not _cached(name, marker, phases, console) and not run_phase(
                name, _pretrain_cmd(qs, out, name), phases, console, in_process=pretrain_main):
            console.print(f"[red]{name} failed; see the output above. Nothing to evaluate without it.")
            return _finish(results, out, console, t_start, 1)

    export_dir = out / qs.export.dir
    distilled = _cached("distill+export", export_dir / "config.json", phases, console)
    results["distill_overrides"] = extra
    if distilled and extra:  # overrides act only on a distillation that runs: say so (results.json records them)
        console.print(f"[yellow]--distill-overrides {shlex.join(extra)} apply when the distillation runs; this run "
                      f"reuses {export_dir}. To distill with them, delete {export_dir} and {out / qs.distill.dir} "
                      "(or give another --out)")
    if not distilled:
        scored = True
        if _cache_overrides(qs, out):  # quickstart.distill.target_logits=cached: score the training data once first
            try:
                complete = _cache_complete(qs, out)
            except ValueError as err:
                console.print(f"[red]error: {err}")
                return 2
            scored = (_cached("cache-logits", out / qs.distill.cache_dir / "manifest.json", phases, console) if complete
                      else run_phase("cache-logits", _cache_cmd(qs, experiment, out, extra), phases, console, env=env))
        if scored and run_phase("distill", _distill_cmd(qs, experiment, out, extra), phases, console, env=env):
            ckpt = _distilled_checkpoint(qs, out)
            distilled = ckpt is not None and run_phase(
                "export", [sys.executable, "-m", "distill", "export", str(ckpt), str(export_dir)], phases, console,
                env=env)
        if not distilled:
            ok = False
            console.print("[red]The distill/export phase failed (its error is above). Fix the cause and run the same "
                          "command again: finished phases are reused. Evaluating the baseline draft only.")

    drafts = {"baseline": out / qs.draft.dir}
    if distilled:
        drafts["distilled"] = export_dir
    console.rule("[bold]eval")
    t0 = time.time()
    results["target"] = _read_json(out / qs.target.dir / "pretrain.json")  # before the evaluation: kept if it fails
    results["baseline_draft"] = _read_json(out / qs.draft.dir / "pretrain.json")
    results["distilled_draft"] = _read_json(export_dir / CARD_JSON) if distilled else None
    try:
        results["eval"] = evaluate(out / qs.target.dir, drafts, qs.eval, console)
    except Exception as err:  # keep results.json (phase timings, the models made) whatever the evaluation hits
        console.print(traceback.format_exc())
        phases["eval"] = {"seconds": round(time.time() - t0, 1), "status": f"failed: {type(err).__name__}: {err}"}
        console.print(f"[red]eval failed: {err}. The trained models are kept under {out}; rerun the same command "
                      "to evaluate them (finished phases are reused).")
        return _finish(results, out, console, t_start, 1)
    phases["eval"] = {"seconds": round(time.time() - t0, 1), "status": "ok"}
    return _finish(results, out, console, t_start, 0 if ok else 1)


def keep_previous_results(path: Path) -> Path | None:
    """Before a rerun writes ``path`` (``results.json``), rename an earlier one to ``results-<its start>.json``
    (``-2``, ``-3``, ... if that name is taken), so that no measured result is overwritten. Returns the new name of
    the earlier file, or None if there was none."""
    if not path.is_file():
        return None
    try:
        started = str(json.loads(path.read_text()).get("started") or "")
    except (ValueError, AttributeError):  # not JSON or not an object: keep it under its modification time
        started = ""
    stamp = "".join(ch for ch in started[:19] if ch.isalnum()) or time.strftime(
        "%Y%m%dT%H%M%S", time.localtime(path.stat().st_mtime))
    target, n = path.with_name(f"{path.stem}-{stamp}{path.suffix}"), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.stem}-{stamp}-{n}{path.suffix}")
    path.rename(target)
    return target


def _finish(results: dict, out: Path, console, t_start: float, status: int) -> int:
    results["total_s"] = round(time.time() - t_start, 1)
    results["status"] = "ok" if status == 0 else "failed"
    path = out / RESULTS_FILE
    kept = keep_previous_results(path)
    text = json.dumps(results, indent=2, default=str) + "\n"
    try:
        replace_text(path, text)  # whole or not at all: a kill or a full disk never leaves half a file
    except OSError as err:  # the run's measurements are only in memory now: show them rather than lose them
        print(text)
        console.print(f"[red]could not write {path} ({err}); the results are printed above: free space and "
                      "rerun the same command (finished phases are reused), or copy them from here")
        return 1
    if kept is not None:
        console.print(f"[dim]the previous {RESULTS_FILE} is kept as {kept.name}")
    console.rule("[bold]quickstart results")
    render_table(results, console)
    timing = ", ".join(f"{k} {v.get('seconds', 0):.0f}s" for k, v in results["phases"].items())
    console.print(f"phases: {timing}; total {results['total_s']:.0f}s -> {out / RESULTS_FILE}")
    return status


if __name__ == "__main__":
    sys.exit(main())
