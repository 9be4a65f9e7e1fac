"""Does prompt lookup beside the draft pay at T = 0? Measured on a quickstart run, side by side.

    python scripts/measure_prompt_lookup.py checkpoints/quickstart --gammas 4,5 --ngram 3 --out lookup.json

Greedy decoding of the run's evaluation prompts (its results.json: prompt sets, prompt length, new tokens; eos
does not stop a run) by plain decoding and by the distilled draft at each γ, without and with prompt lookup
(``SpeculativeDecoder(prompt_lookup_ngram=n)``, :mod:`decode.lookup`), all interleaved: each prompt runs every
method back to back, the first method rotating, for ``--rounds`` rounds. The drafts' forwards are compiled as in
the quickstart (``--compile false`` for eager). Prints one table per round and pooled (tokens/s, speedup over
plain decoding, tokens per verify step, acceptance rate, greedy outputs equal to plain decoding's); with
``--out``, writes JSON (refuses an existing file). Prompt lookup changes greedy requests only, so T = 1 is not run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def pool(records: list[dict]) -> dict:
    """Per method, from records ``{"method", "seconds", "new_tokens", "steps", "drafted", "accepted", "equal"}``
    (one per generate call): tokens/s, speedup over the ``plain`` records' tokens/s, tokens per verify step,
    acceptance rate (Σaccepted/Σdrafted; None without drafts) and how many outputs equal plain decoding's."""
    out: dict[str, dict] = {}
    for r in records:
        m = out.setdefault(r["method"], {"seconds": 0.0, "new_tokens": 0, "steps": 0, "drafted": 0, "accepted": 0,
                                         "equal": 0, "runs": 0})
        for key in ("seconds", "new_tokens", "steps", "drafted", "accepted", "equal"):
            m[key] += r[key]
        m["runs"] += 1
    plain = out["plain"]["new_tokens"] / out["plain"]["seconds"]
    for m in out.values():
        m["tokens_per_s"] = m["new_tokens"] / m["seconds"]
        m["speedup"] = m["tokens_per_s"] / plain
        m["tokens_per_step"] = m["new_tokens"] / m["steps"] if m["steps"] else None
        m["acceptance_rate"] = m["accepted"] / m["drafted"] if m["drafted"] else None
    return out


def table(pooled: dict) -> str:
    lines = ["| method | tokens/s | speedup | tokens/step | acceptance rate | greedy = plain |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, m in pooled.items():
        rate = "" if m["acceptance_rate"] is None else f"{m['acceptance_rate']:.3f}"
        lines.append(f"| {name} | {m['tokens_per_s']:.1f} | {m['speedup']:.3f} | {m['tokens_per_step']:.2f} | {rate} "
                     f"| {m['equal']}/{m['runs']} |")
    return "\n".join(lines)


def check_args(args: argparse.Namespace) -> tuple[list[int], dict]:
    """Everything the run needs, checked before any model loads: returns the γ list and the run's ``eval`` results.
    Raises ValueError naming the option or file and the fix."""
    from decode.compiling import check_cpu_compiler
    from decode.outputs import check_output_file

    try:
        gammas = sorted({int(g) for g in args.gammas.split(",") if g.strip()})
    except ValueError:
        gammas = []
    if not gammas or min(gammas) < 1:
        raise ValueError(f"--gammas {args.gammas!r}: give integers >= 1, e.g. --gammas 4,5")
    for option, value in (("--ngram", args.ngram), ("--rounds", args.rounds)):
        if value < 1:
            raise ValueError(f"{option} must be >= 1, got {value}")
    if args.out is not None:
        args.out = check_output_file(args.out, "--out", overwrite=True)  # its folder; '~' expanded
        if os.path.lexists(args.out):  # a file, or a link to one (also a dangling one)
            raise ValueError(f"--out {args.out} exists; choose a new file")
    if args.compile == "draft":
        check_cpu_compiler("--compile draft", "pass --compile false")
    results = args.run / "results.json"
    if not results.is_file():
        raise ValueError(f"{args.run} has no results.json; give a finished quickstart run folder")
    try:
        res = json.loads(results.read_text()).get("eval")
    except (ValueError, AttributeError):
        res = None
    if not isinstance(res, dict) or any(k not in res for k in ("num_prompts", "max_prompt_tokens", "max_new_tokens")):
        raise ValueError(f"{results} holds no finished evaluation (eval.num_prompts, max_prompt_tokens, "
                         "max_new_tokens); give a finished quickstart run folder")
    missing = [d for d in ("target", "draft-distilled", "tokenizer") if not (args.run / d).is_dir()]
    if missing:
        raise ValueError(f"{args.run} has no {', '.join(missing)} folder; give a finished quickstart run folder")
    return gammas, res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="a quickstart output folder (target, draft-distilled, results.json)")
    p.add_argument("--gammas", default="4,5", help="fixed γ values, comma-separated (default 4,5)")
    p.add_argument("--ngram", type=int, default=3, help="prompt_lookup_ngram of the lookup methods (default 3)")
    p.add_argument("--rounds", type=int, default=2, help="rounds over the prompts (default 2)")
    p.add_argument("--compile", choices=["draft", "false"], default="draft", help="the drafts' forwards compiled "
                   "(draft, the quickstart's default) or eager (false)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    try:
        gammas, res = check_args(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torch
    from transformers import AutoTokenizer

    from decode import SpeculativeDecoder
    from decode.outputs import write_results
    from quickstart.run import _load_lm, encode_prompt_sets

    tok = AutoTokenizer.from_pretrained(str(args.run / "tokenizer"))
    target, draft = _load_lm(args.run / "target", "target"), _load_lm(args.run / "draft-distilled")
    compile_ = "draft" if args.compile == "draft" else False
    decoders = {"plain": SpeculativeDecoder(target, None, 0)}
    for g in gammas:
        for n in (0, args.ngram):
            name = f"spec_g{g}" + (f"_lookup{n}" if n else "")
            decoders[name] = SpeculativeDecoder(target, draft, g, tokenizer=tok, compile=compile_,
                                                prompt_lookup_ngram=n)
    prompts = encode_prompt_sets(tok, res["num_prompts"], int(res["max_prompt_tokens"]))
    new = int(res["max_new_tokens"])
    run = lambda name, ids: decoders[name].generate([ids], max_new_tokens=new)  # noqa: E731
    for name in decoders:  # untimed: lazy initialisation, and every shape class of the compiled forwards
        decoders[name].warm_up(1)
        run(name, prompts[0][1])
    methods, rounds = list(decoders), []
    for r in range(args.rounds):
        records = []
        for i, (_, ids) in enumerate(prompts):
            outs = {}
            for name in methods[i % len(methods):] + methods[:i % len(methods)]:
                start = time.perf_counter()
                out = run(name, ids)
                seconds = time.perf_counter() - start
                outs[name] = out.new_tokens[0]
                s = out.stats
                records.append({"method": name, "seconds": seconds, "new_tokens": s.num_new_tokens,
                                "steps": s.num_target_forwards,  # every step, also a last one with γ = 0
                                "drafted": s.num_drafted, "accepted": s.num_accepted})
            for rec in records[-len(methods):]:
                rec["equal"] = int(torch.equal(outs[rec["method"]], outs["plain"]))
        rounds.append(records)
        print(f"\nround {r + 1} (T = 0, {len(prompts)} prompts, {new} new tokens each)\n" + table(pool(records)))
    pooled = pool([rec for records in rounds for rec in records])
    print(f"\npooled over {args.rounds} rounds\n" + table(pooled))
    if args.out is not None:
        write_results(json.dumps({"run": str(args.run), "gammas": gammas, "ngram": args.ngram, "compile": compile_,
                                  "num_prompts": len(prompts), "max_new_tokens": new,
                                  "rounds": [pool(records) for records in rounds], "pooled": pooled}, indent=1),
                      args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
