"""The GPU launch paths of `python -m distill train`, checked against a CPU/fp32 reference (scripts/gpu_train_check.sh).

On one GPU: the DDP, FSDP and DeepSpeed ZeRO-2/3 launcher configs (conf/launcher/*.yaml, one process) and the
cached-logit mode (cache-logits, then train data.target_logits=cached) each run a few steps of the same experiment
in bf16 on a ≈0.7B Llama target built from a config (random weights: the check is about the launch paths and the
numerics, not about quality) with a small draft. Every run's per-step losses are compared with a float32 CPU run of
the same steps (same data order, same initial draft); peak memory and tokens/s are reported. Everything is built
here from the repository's own text (no downloads): a byte-level BPE tokenizer, the two models, a .txt corpus.

DRAFTKIT_GPU_CHECK_TINY=1 runs the same program with tiny models on CPU (the launchers become the two-process CPU
config; the cached mode runs as on the GPU): that is how this script is tested without a GPU.
Writes <out>/gpu_train_check.json and prints a table. Exit code 1 when any run fails or drifts beyond tolerance.
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
sys.path.insert(0, str(REPO))  # this checkout's distill, not another installed copy
TINY = os.environ.get("DRAFTKIT_GPU_CHECK_TINY") == "1"
SIZES = {  # (hidden, layers, intermediate, heads, kv heads)
    "target": (64, 2, 160, 4, 2) if TINY else (1536, 24, 4096, 16, 4),  # ≈0.7B with the 8k vocabulary
    "draft": (32, 1, 64, 2, 1) if TINY else (512, 4, 1408, 8, 2),
}
VOCAB = 300 if TINY else 8192
LAUNCHERS = ["cpu_2proc"] if TINY else ["ddp", "fsdp", "deepspeed_zero2", "deepspeed_zero3"]
BF16_TOLERANCE = 0.05  # relative per-step loss difference allowed between a bf16 GPU run and the fp32 reference


def build_inputs(root: Path) -> dict:
    """Tokenizer, target, draft and a .txt corpus under ``root`` (reused when present)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    paths = {"target": root / "target", "draft": root / "draft", "text": root / "corpus.txt"}
    if all((p / "config.json").exists() for p in (paths["target"], paths["draft"])) and paths["text"].exists():
        return paths
    texts = [p.read_text(errors="ignore") for p in sorted(REPO.glob("**/*.py")) if ".venv" not in p.parts]
    texts += [p.read_text(errors="ignore") for p in sorted(REPO.glob("docs/*.md"))]
    root.mkdir(parents=True, exist_ok=True)
    paths["text"].write_text("\n\n".join(t.replace("\n\n", "\n") for t in texts))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    for name, seed in (("target", 0), ("draft", 1)):
        h, layers, inter, heads, kv = SIZES[name]
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=len(fast), hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=512,
                          bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
        model = LlamaForCausalLM(cfg)
        with torch.no_grad():  # sharper than random init: losses of order 1, so bf16-vs-fp32 differences mean something
            model.lm_head.weight.mul_(8.0)
        model.save_pretrained(str(paths[name]))
        fast.save_pretrained(str(paths[name]))
        print(f"built {name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters", flush=True)
    return paths


def overrides(paths: dict, out: Path, steps: int, *extra: str) -> list[str]:
    return [f"+target.name_or_path={paths['target']}", f"draft.name_or_path={paths['draft']}", "data=jsonl",
            f"data.source.path={paths['text']}", "data.source.kind=text", "data.source.prompt_tokens=64",
            "data.source.completion_tokens=64", "data.source.windows_per_doc=2", "data.max_new_tokens=64",
            "data.holdout=4", "data.chat_template=false", "data.append_eos=false", "loss=jsd",
            f"train.max_steps={steps}", "train.batch_size=4", "train.log_every=1", "train.save_every=0",
            "train.progress=none", "optim.warmup_steps=1", "optim.lr=1e-4", "eval.every=0", "eval.at_start=false",
            "eval.num_prompts=2", "eval.max_new_tokens=8", "eval.temperatures=[0.0]", "eval.cost_ratio=0.5",
            f"train.output_dir={out}", *extra]


def run(cmd: list[str], log: Path, timeout: float) -> tuple[int, float]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO),
               WANDB_MODE="disabled")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.perf_counter() - t0


def losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")] if (out / "metrics.jsonl").exists() else []
    return [r["train/loss"] for r in rows if "train/loss" in r]


def result_row(name: str, out: Path, rc: int, seconds: float, reference: list[float] | None, log: Path) -> dict:
    row = {"run": name, "rc": rc, "seconds": round(seconds, 1), "log": str(log)}
    got = losses(out)
    row["losses"] = got
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    row["peak_memory_mb"] = summary.get("peak_memory_mb")
    tps = [json.loads(line).get("train/tokens_per_s") for line in open(out / "metrics.jsonl")] \
        if (out / "metrics.jsonl").exists() else []
    tps = [t for t in tps if t]
    row["tokens_per_s"] = statistics.median(tps[1:] or tps) if tps else None  # step 1 includes warm-up
    if reference is not None and got:
        n = min(len(got), len(reference))
        row["max_rel_diff"] = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(got[:n], reference[:n]))
        row["ok"] = rc == 0 and n == len(reference) and row["max_rel_diff"] <= BF16_TOLERANCE
    else:
        row["ok"] = rc == 0 and bool(got)
    if rc != 0:
        row["error"] = open(log).read()[-1500:]
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(REPO / "checkpoints" / "gpu_train_check"),
                   help="work and result folder (must not hold a gpu_train_check.json)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    p.add_argument("--k", type=int, default=64, help="data.logit_cache_k of the cached-mode runs")
    p.add_argument("--timeout", type=float, default=150, help="seconds per run")
    args = p.parse_args()
    out = Path(args.out).resolve()
    if (out / "gpu_train_check.json").exists():
        print(f"error: {out}/gpu_train_check.json exists; choose another --out (results are never overwritten)",
              file=sys.stderr)
        return 2
    paths = build_inputs(out / "inputs")
    py, rows = sys.executable, []
    device = ["train.cpu=true"] if TINY else []
    precision = "no" if TINY else "bf16"

    # float32 CPU references: online, and cached (cache built on CPU in fp32)
    ref_dir, ref_log = out / "ref_online", out / "ref_online.log"
    rc, s = run([py, "-m", "distill", "train", *overrides(paths, ref_dir, args.steps, "train.cpu=true",
                                                          "train.mixed_precision=no")], ref_log, args.timeout * 4)
    rows.append(result_row("reference: CPU fp32 online", ref_dir, rc, s, None, ref_log))
    reference = losses(ref_dir)
    cache_cpu = out / "cache_cpu"
    cached_ov = [f"data.logit_cache={cache_cpu}", f"data.logit_cache_k={args.k}"]
    rc, s = run([py, "-m", "distill", "cache-logits", *overrides(paths, out / "c0", args.steps, "train.cpu=true",
                                                                 "train.mixed_precision=no", *cached_ov)],
                out / "cache_cpu.log", args.timeout * 4)
    ref_c = out / "ref_cached"
    rc2, s2 = run([py, "-m", "distill", "train", *overrides(paths, ref_c, args.steps, "train.cpu=true",
                                                            "train.mixed_precision=no", "data.target_logits=cached",
                                                            *cached_ov)], out / "ref_cached.log", args.timeout * 4)
    rows.append(result_row(f"reference: CPU fp32 cached k={args.k}", ref_c, rc or rc2, s + s2, None,
                           out / "ref_cached.log"))
    reference_cached = losses(ref_c)

    for launcher in LAUNCHERS:
        name = launcher if TINY else f"{launcher} (1 process)"
        run_dir, log = out / launcher, out / f"{launcher}.log"
        if launcher.startswith("deepspeed"):
            import importlib.util

            if importlib.util.find_spec("deepspeed") is None:
                rows.append({"run": name, "rc": None, "ok": False, "error": "deepspeed is not installed "
                             "(pip install 'draftkit[deepspeed]'): not run"})
                continue
        n_proc = ["--num_processes", "2"] if TINY else ["--num_processes", "1"]
        cmd = ["accelerate", "launch", "--config_file", str(REPO / f"conf/launcher/{launcher}.yaml"), *n_proc, "-m",
               "distill", "train", *overrides(paths, run_dir, args.steps, f"train.mixed_precision={precision}",
                                              *(["train.batch_size=2"] if TINY else []), *device)]
        rc, s = run(cmd, log, args.timeout)
        rows.append(result_row(name, run_dir, rc, s, reference, log))

    cache_dev = out / "cache_device"
    dev_ov = [f"data.logit_cache={cache_dev}", f"data.logit_cache_k={args.k}", f"train.mixed_precision={precision}",
              *device]
    rc, s_build = run([py, "-m", "distill", "cache-logits", *overrides(paths, out / "c1", args.steps, *dev_ov)],
                      out / "cache_device.log", args.timeout)
    cached_dir, log = out / "cached", out / "cached.log"
    rc2, s = run([py, "-m", "distill", "train", *overrides(paths, cached_dir, args.steps, "data.target_logits=cached",
                                                           *dev_ov)], log, args.timeout)
    row = result_row(f"cached k={args.k} ({'cpu' if TINY else 'gpu'}, vs CPU cached reference)", cached_dir,
                     rc or rc2, s, reference_cached, log)
    row["cache_build_seconds"] = round(s_build, 1)
    manifest = cache_dev / "manifest.json"
    if manifest.exists():
        from distill.logit_cache import summarize

        row["cache"] = summarize(cache_dev, json.loads(manifest.read_text()))
    rows.append(row)

    report = {"tiny": TINY, "steps": args.steps, "k": args.k, "tolerance_rel": BF16_TOLERANCE, "rows": rows}
    (out / "gpu_train_check.json").write_text(json.dumps(report, indent=2))
    print(f"\n{'run':<44} {'ok':>4} {'max rel Δloss':>14} {'peak MiB':>9} {'tokens/s':>9} {'s':>6}")
    def fmt(value, spec):
        return "" if value is None else format(value, spec)

    for r in rows:
        print(f"{r['run']:<44} {'yes' if r.get('ok') else 'NO':>4} {fmt(r.get('max_rel_diff'), '.4f'):>14} "
              f"{fmt(r.get('peak_memory_mb'), '.0f'):>9} {fmt(r.get('tokens_per_s'), '.0f'):>9} "
              f"{fmt(r.get('seconds'), '.0f'):>6}")
        if r.get("error"):
            print(f"    {r['error'].strip().splitlines()[-1][:200]}")
    print(f"\nwrote {out / 'gpu_train_check.json'}")
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
