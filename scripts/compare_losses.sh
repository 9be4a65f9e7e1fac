#!/usr/bin/env bash
# Compare distillation losses on the quickstart pair at equal steps (issue 12, point 2):
#   bash scripts/compare_losses.sh                       # acceptance, tvd, jsd, fkl x seeds 0 1, then one evaluation
#   PAIR=checkpoints/quickstart OUT=checkpoints/compare_losses STEPS=400 SEEDS="0 1" \
#     LOSSES="acceptance tvd jsd fkl" GAMMA=4 THREADS=2 bash scripts/compare_losses.sh
#   LOSSES="fkl fkl:draft.vocab.keep=4096" bash scripts/compare_losses.sh   # a variant: loss[:override[:...]]
#   EVAL="eval.prompt_sets.humaneval=1 eval.prompt_sets.mbpp_code=1 eval.prompt_sets.stdlib=1 eval.max_new_tokens=8" \
#     STEPS=2 SEEDS=0 LOSSES=fkl OUT=/tmp/dry bash scripts/compare_losses.sh   # (every prompt set keeps its own count)
#     (a dry run: EVAL holds quickstart-settings overrides for the evaluation, keys as in `python -m quickstart`)
# Each run is `python -m distill train +experiment=quickstart` from the same baseline draft with only `loss=` and
# `train.seed=` changed (loss=acceptance also gets loss.gamma=$GAMMA, the γ the evaluation decodes with), exported,
# then all drafts are measured in one `quickstart.run.evaluate` pass (plain target decoding interleaved with every
# draft per prompt, same seeds): α/token, τ and measured speedup at T=0 and T=1 on HumanEval, MBPP and held-out
# stdlib prompts. Prints a table (mean and range over seeds) and writes $OUT/results.json.
# Nothing is overwritten: a finished run (its export exists) is reused, an interrupted one resumes from its last
# complete checkpoint (or, stopped before its first, starts over in its own folder), and an existing
# $OUT/results.json stops the script unless OVERWRITE=1. Relative PAIR and OUT are taken from the current folder.
# Cost on 2 quiet cores: about 3 min per run (400 steps) plus the evaluation (~1 min per draft); run it when the
# machine is otherwise idle, timings are part of the result.
set -euo pipefail
case "${1:-}" in  # settings are environment variables; arguments are --help or a mistake (they were ignored)
  "") ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  *) echo "error: compare_losses.sh takes no arguments (got '$1'); its settings are environment variables, e.g." \
       "STEPS=400 SEEDS=\"0 1\" LOSSES=\"tvd fkl\" bash scripts/compare_losses.sh (--help lists them)" >&2; exit 2 ;;
esac
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PAIR="$(realpath -m "${PAIR:-$REPO/checkpoints/quickstart}")"  # before the cd: relative to where the user is
OUT="$(realpath -m "${OUT:-$REPO/checkpoints/compare_losses}")"
cd "$REPO"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
STEPS="${STEPS:-400}"
SEEDS="${SEEDS:-0 1}"
LOSSES="${LOSSES:-acceptance tvd jsd fkl}"
GAMMA="${GAMMA:-4}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -n "${THREADS:-}" ]; then export OMP_NUM_THREADS="$THREADS"; fi

for need in "$PAIR/target/config.json" "$PAIR/draft-baseline/config.json"; do
  [ -f "$need" ] || { echo "error: $need not found; run scripts/quickstart.sh first or set PAIR=DIR" >&2; exit 2; }
done
if [ -e "$OUT/results.json" ] && [ "${OVERWRITE:-0}" != "1" ]; then
  echo "error: $OUT/results.json exists; set OUT=another/folder or OVERWRITE=1 to replace it" >&2; exit 2
fi
for name in STEPS GAMMA; do
  [[ "${!name}" =~ ^[0-9]+$ ]] && [ "${!name}" -ge 1 ] || { echo "error: $name=${!name} must be an integer >= 1" >&2; exit 2; }
done
for seed in $SEEDS; do
  [[ "$seed" =~ ^[0-9]+$ ]] || { echo "error: SEEDS='$SEEDS' must be integers >= 0, e.g. SEEDS=\"0 1\"" >&2; exit 2; }
done
[ -n "${SEEDS// }" ] || { echo "error: SEEDS is empty; give at least one seed, e.g. SEEDS=0" >&2; exit 2; }
[ -n "${LOSSES// }" ] || { echo "error: LOSSES is empty; give at least one loss, e.g. LOSSES=fkl" >&2; exit 2; }
# The evaluation's settings, checked now rather than after every run has trained.
EVAL="${EVAL:-}" GAMMA="$GAMMA" "$PY" -c '
import os, sys
from omegaconf import OmegaConf
from quickstart.run import check_eval_settings, load_settings
settings = os.environ["EVAL"]
try:
    check_eval_settings(OmegaConf.merge(load_settings("quickstart", settings.split()).eval,
                                        {"num_draft_tokens": int(os.environ["GAMMA"])}))
except (KeyError, ValueError) as err:
    sys.exit(f"error: EVAL={settings!r}: {err.args[0]}")
' || exit 2
for item in $LOSSES; do
  loss="${item%%:*}"
  [ -f "conf/loss/$loss.yaml" ] || { echo "error: LOSSES names '$loss' but conf/loss/$loss.yaml does not exist" >&2; exit 2; }
done
mkdir -p "$OUT"

drafts=()
for item in $LOSSES; do
  loss="${item%%:*}"
  variant=()  # the item's own overrides after the loss name, ':'-separated
  if [ "$item" != "$loss" ]; then IFS=':' read -ra variant <<< "${item#*:}"; fi
  label="$(printf '%s' "$item" | tr ':=' '_-' | tr -d '.')"
  for seed in $SEEDS; do
    name="$label-s$seed"
    run="$OUT/$name"
    export_dir="$run/export"
    drafts+=("$name=$export_dir")
    if [ -f "$export_dir/config.json" ]; then echo "== $name: reusing $export_dir"; continue; fi
    extra=("${variant[@]}")
    if [ "$loss" = "acceptance" ]; then extra+=("loss.gamma=$GAMMA"); fi
    if compgen -G "$run/step_*/manifest.json" > /dev/null; then extra+=("train.resume=true")  # interrupted: continue
    elif [ -n "$(ls -A "$run" 2>/dev/null)" ]; then extra+=("train.overwrite=true"); fi  # stopped before a checkpoint
    echo "== $name: python -m distill train loss=$loss train.seed=$seed train.max_steps=$STEPS ${extra[*]}"
    "$PY" -m distill train +experiment=quickstart "++target.name_or_path=$PAIR/target" \
        "draft.name_or_path=$PAIR/draft-baseline" "train.output_dir=$run" "loss=$loss" "train.seed=$seed" \
        "train.max_steps=$STEPS" "train.save_every=$STEPS" train.progress=none "${extra[@]}"
    ckpt="$run/best"
    if [ ! -d "$ckpt" ]; then ckpt="$(ls -d "$run"/step_* | sort -t_ -k2 -n | tail -1)"; fi
    "$PY" -m distill export "$ckpt" "$export_dir"
  done
done

echo "== evaluation: plain vs ${#drafts[@]} drafts at T=0 and T=1, γ=$GAMMA"
EVAL="${EVAL:-}" "$PY" - "$PAIR" "$OUT" "$GAMMA" "${drafts[@]}" <<'EOF'
import os
import json
import sys
import time
from collections import defaultdict

from omegaconf import OmegaConf
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from quickstart.run import evaluate, load_settings

pair, out, gamma, specs = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
drafts = dict(spec.split("=", 1) for spec in specs)
ecfg = load_settings("quickstart", os.environ["EVAL"].split()).eval
ecfg = OmegaConf.merge(ecfg, {"num_draft_tokens": gamma})
t0 = time.time()
ev = evaluate(f"{pair}/target", drafts, ecfg)
json.dump({"eval": ev, "drafts": drafts, "eval_seconds": time.time() - t0},  # saved before the table is built
          open(f"{out}/results.json", "w"), indent=1, default=str)
rows = [r for r in ev["rows"] if r["set"] == "all"]
by_loss = defaultdict(lambda: defaultdict(list))
for r in rows:
    for name in drafts:
        loss = name.rsplit("-s", 1)[0]
        m = r[name]
        for key in ("alpha", "mean_accepted_length", "speedup"):
            by_loss[loss][(r["temperature"], key)].append(m[key])
table = Table(title=escape(f"losses at equal steps, γ={gamma} (mean [min, max] over seeds; all prompt sets pooled)"))
table.add_column("loss")
temps = sorted({r["temperature"] for r in rows})
for t in temps:
    for label in ("α", "τ", "speedup"):
        table.add_column(f"{label} T={t:g}", justify="right")
summary = {}
for loss, cols in by_loss.items():
    cells, summary[loss] = [], {}
    for t in temps:
        for key in ("alpha", "mean_accepted_length", "speedup"):
            v = [x for x in cols[(t, key)] if x is not None]
            summary[loss][f"{key}@T={t:g}"] = {"mean": sum(v) / len(v), "min": min(v), "max": max(v), "runs": v}
            cells.append(escape(f"{sum(v) / len(v):.3f} [{min(v):.3f}, {max(v):.3f}]"))
    table.add_row(loss, *cells)
Console(width=200).print(table)
json.dump({"eval": ev, "summary": summary, "drafts": drafts, "eval_seconds": time.time() - t0},
          open(f"{out}/results.json", "w"), indent=1, default=str)
print(f"wrote {out}/results.json")
EOF
