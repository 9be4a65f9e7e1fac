"""Measure the target-logit cache on a pair: cache size per token and build time, train step time cached vs online,
and α at T=0 and T=1 after equal steps for several k against the full online loss (docs/distill.md).

    python scripts/measure_logit_cache.py --target checkpoints/quickstart/target \
        --draft checkpoints/quickstart/draft-baseline --steps 400 --ks 8 32 128 --out checkpoints/cache_measure
    python scripts/measure_logit_cache.py ... --ks 32 --tail-samples 0 32 --seeds 0 1 --out DIR   # sampled tail

Every run uses `+experiment=quickstart` (its loss, precision, batch 8 × (64 + 64) tokens, stdlib windows) with
the given pair; the online run trains with the full-vocabulary loss, each cached run with the top-k + tail loss
on a cache built by `python -m distill cache-logits` (with `--tail-samples S`, S ids sampled per position from the
target's tail, for `loss=fkl`), all from the same initial draft for the same steps and, per seed, data order. α is measured afterwards by `python -m distill eval` on the same held-out prompts for every draft (and
the initial one). Extra Hydra overrides go after `--` (relative paths in them are taken from the repository root).
Writes <out>/results.json and prints a markdown table. Rerun the same command after Ctrl-C: finished evaluations,
caches and runs are reused, an interrupted run resumes from its last checkpoint (step ms then cover both parts).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def sh(cmd: list[str], log: Path) -> float:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"failed ({rc}): {' '.join(cmd)}\n{log.read_text()[-3000:]}")
    return time.perf_counter() - t0


def train(cmd: list[str], run_dir: Path, steps: int, log: Path) -> None:
    """``python -m distill train``, rerun-safe: a run that reached ``steps`` is kept, an interrupted one resumes from
    its last complete checkpoint, one stopped before its first starts over in its own folder."""
    from distill.checkpoint import is_complete, rerun_overrides, step_dir

    if not is_complete(step_dir(run_dir, steps)):
        sh([*cmd, *rerun_overrides(run_dir)], log)


def step_stats(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    train = [r for r in rows if "train/tokens_per_s" in r]
    seen = [r["train/tokens_seen"] for r in train]
    per_step = [b - a for a, b in zip([0] + seen, seen)]
    ms = [1e3 * n / r["train/tokens_per_s"] for n, r in zip(per_step, train)][1:]  # step 1 includes warm-up
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"step_ms_median": statistics.median(ms) if ms else None, "steps": summary["steps"],
            "final_loss": summary["final_loss"], "peak_memory_mb": summary.get("peak_memory_mb")}


def alpha(result: dict) -> dict:
    """Per temperature: the acceptance rate (Σaccepted/Σdrafted) and α (per-token acceptance)."""
    return {t: {"acceptance_rate": m["acceptance_rate"], "alpha": m.get("alpha")}
            for t, m in result["per_temperature"].items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True, help="the initial draft of every run")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--ks", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--tail-samples", type=int, nargs="+", default=[0],
                   help="data.logit_cache_tail_samples values to build and train for each k (0: buckets only)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="train.seed of every training run")
    p.add_argument("--out", required=True, help="work folder (must not hold a results.json)")
    p.add_argument("extra", nargs="*", help="Hydra overrides for every run, after --")
    args = p.parse_args()
    for flag, ok in (("--steps", args.steps >= 1), ("--ks", min(args.ks) >= 1),
                     ("--tail-samples", min(args.tail_samples) >= 0), ("--seeds", min(args.seeds) >= 0)):
        if not ok:
            p.error(f"{flag}={getattr(args, flag[2:].replace('-', '_'))} is out of range (--steps, --ks >= 1; "
                    "--tail-samples, --seeds >= 0)")
    for flag in ("--target", "--draft"):
        if not (Path(getattr(args, flag[2:])) / "config.json").is_file():
            p.error(f"{flag} {getattr(args, flag[2:])} is not a checkpoint folder (no config.json)")
    out = Path(args.out).resolve()
    sys.path.insert(0, str(REPO))
    from decode.outputs import check_output_folder

    try:
        check_output_folder(out)
    except ValueError as e:
        p.error(str(e))
    out.mkdir(parents=True, exist_ok=True)  # a rerun after Ctrl-C reuses what the interrupted one finished
    py = sys.executable
    base = ["+experiment=quickstart", f"++target.name_or_path={Path(args.target).resolve()}",
            f"draft.name_or_path={Path(args.draft).resolve()}", f"train.max_steps={args.steps}", "train.log_every=1",
            "train.save_every=0", "train.progress=none", "eval.every=0", "eval.at_start=false",
            "train.max_time_s=null",  # equal steps: the experiment's wall-clock cap would stop slow (online) runs early
            *args.extra]
    results: dict = {"steps": args.steps, "ks": args.ks, "tail_samples": args.tail_samples, "seeds": args.seeds,
                     "overrides": base, "runs": {}}

    def evaluate(name: str, draft: Path | str) -> dict:
        file = out / f"eval_{name}.json"
        if file.exists():  # written by an interrupted run of this script
            return alpha(json.loads(file.read_text()))
        sh([py, "-m", "distill", "eval", *base, f"draft.name_or_path={draft}", "--out", str(file)],
           out / f"eval_{name}.log")
        return alpha(json.loads(file.read_text()))

    results["runs"]["initial"] = {"alpha": evaluate("initial", Path(args.draft).resolve())}
    from distill.logit_cache import summarize

    caches = {}
    for k in args.ks:
        for tail in args.tail_samples:
            cache = out / f"cache_k{k}" if not tail else out / f"cache_k{k}_s{tail}"
            ov = [f"data.logit_cache={cache}", f"data.logit_cache_k={k}", f"data.logit_cache_tail_samples={tail}"]
            timing = out / f"{cache.name}.build_s.json"  # the first build's time (a rerun finds the cache built)
            if not timing.exists():
                resumed = cache.exists()
                build_s = sh([py, "-m", "distill", "cache-logits", *base, *ov, f"train.output_dir={out / 'c'}"],
                             out / f"{cache.name}.log")
                timing.write_text(json.dumps({"cache_build_s": build_s, "cache_build_resumed": resumed}))
            caches[cache.name.replace("cache_", "")] = (ov, {"cache": summarize(cache, json.loads(
                (cache / "manifest.json").read_text())), **json.loads(timing.read_text())})
    for seed in args.seeds:
        tag = f"_seed{seed}" if len(args.seeds) > 1 else ""
        online = out / f"online{tag}"
        train([py, "-m", "distill", "train", *base, f"train.seed={seed}", f"train.output_dir={online}"], online,
              args.steps, out / f"online{tag}.log")
        results["runs"][f"online{tag}"] = {**step_stats(online),
                                           "alpha": evaluate(f"online{tag}", online / f"step_{args.steps:06d}")}
        for name, (ov, info) in caches.items():
            run_dir = out / f"cached_{name}{tag}"
            train([py, "-m", "distill", "train", *base, *ov, f"train.seed={seed}", "data.target_logits=cached",
                   f"train.output_dir={run_dir}"], run_dir, args.steps, out / f"cached_{name}{tag}.log")
            results["runs"][f"cached_{name}{tag}"] = {**step_stats(run_dir), **info, "alpha": evaluate(
                f"{name}{tag}", run_dir / f"step_{args.steps:06d}")}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print("| run | cache bytes/token | cache build s | step ms | peak MiB | acc. rate T=0 | α T=0 | acc. rate T=1 "
          "| α T=1 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results["runs"].items():
        c = r.get("cache") or {}
        a = r["alpha"]
        cells = [name, f"{c['bytes_per_token']:.0f}" if c else "", f"{r['cache_build_s']:.0f}" if c else "",
                 f"{r['step_ms_median']:.0f}" if r.get("step_ms_median") else "",
                 f"{r['peak_memory_mb']:.0f}" if r.get("peak_memory_mb") else "",
                 *(f"{(a.get(t) or {}).get(key) or float('nan'):.3f}" for t in ("0.0", "1.0")
                   for key in ("acceptance_rate", "alpha"))]
        print("| " + " | ".join(cells) + " |")
    print(f"\nwrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
