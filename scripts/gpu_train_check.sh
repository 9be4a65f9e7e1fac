#!/usr/bin/env bash
# bash scripts/gpu_train_check.sh [--out DIR] [--steps N] [--k K]
# One GPU, ≤ 8 minutes: the DDP, FSDP and DeepSpeed ZeRO-2/3 launcher configs and the cached-logit mode, a few bf16
# steps each on a ≈0.7B Llama target built from a config and a small draft, every run's losses compared with a
# float32 CPU reference of the same steps; peak memory and tokens/s. Table on stdout, JSON in DIR.
# DRAFTKIT_GPU_CHECK_TINY=1 runs the same program with tiny models on CPU (how it is tested without a GPU).
set -euo pipefail
# No cd: a relative --out DIR is taken from the current folder (the Python part runs its commands in the repository).
if [[ "${DRAFTKIT_GPU_CHECK_TINY:-0}" != "1" ]] && ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "error: no CUDA device visible to torch; run on a GPU machine, or set DRAFTKIT_GPU_CHECK_TINY=1 for the CPU smoke run" >&2
  exit 2
fi
exec python "$(dirname "$0")/gpu_train_check.py" "$@"
