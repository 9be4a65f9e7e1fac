#!/usr/bin/env bash
# One GPU run, sized to finish within 8 minutes on one H200:
#   1. the decoder tests with DRAFTKIT_TEST_DEVICE=cuda (tests that opt in put their models on the GPU);
#   2. plain vs ours (eager, then eager vs compiled where SpeculativeDecoder has compile=True) vs Hugging Face
#      assisted generation at the same γ, on a ≈1.03B Llama target and its ≈110M early-exit draft built from
#      configs (decode/bench/synthetic_pair.py), batch 1 and 16, T=0 and T=1 (scripts/gpu_bench.py).
# Tables go to stdout; with OUT set, logs and JSON go under $OUT (gpu_bench.json, gpu_bench_compiled.json).
#
#   OUT=/tmp/gpu bash scripts/gpu_bench.sh
#   GPU_BENCH_TINY=1 GPU_BENCH_SKIP_TESTS=1 bash scripts/gpu_bench.sh     # the whole path on a CPU, tiny sizes
#
# Time limits (seconds): GPU_BENCH_TEST_TIMEOUT (default 150) for the tests, GPU_BENCH_TIMEOUT (default 300) for
# the benchmark; the eager results are written before the compiled stage starts.
set -uo pipefail
out="${OUT:-}"
if [ -n "$out" ]; then out="$(realpath -m "$out")"; fi  # before the cd: a relative OUT is the user's folder
cd "$(dirname "$0")/.."

export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
tiny="${GPU_BENCH_TINY:-0}"
if [ -n "$out" ]; then
  for f in environment.txt pytest.log bench.log gpu_bench.json gpu_bench_compiled.json; do
    if [ -e "$out/$f" ]; then
      echo "error: OUT=$out already holds $f from an earlier run; choose an empty folder" >&2
      exit 2
    fi
  done
  mkdir -p "$out" || exit 2
fi

# Copy stdin to stdout and, when OUT is set, to $OUT/$1.
log() { if [ -n "$out" ]; then tee "$out/$1"; else cat; fi; }

python - <<'PY' | log environment.txt
import torch, transformers
print(f"torch {torch.__version__}, transformers {transformers.__version__}, cuda available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print(f"device: {torch.cuda.get_device_name(0)}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
PY

if [ "$tiny" = 1 ]; then device=cpu; else device=cuda; fi
test_status=skipped
if [ "${GPU_BENCH_SKIP_TESTS:-0}" != 1 ]; then
  echo "== decoder tests, DRAFTKIT_TEST_DEVICE=$device"
  DRAFTKIT_TEST_DEVICE="$device" timeout "${GPU_BENCH_TEST_TIMEOUT:-150}" \
    python -m pytest tests/decode -m "not slow" -q -p no:cacheprovider 2>&1 | log pytest.log
  test_status=${PIPESTATUS[0]}
fi

echo "== benchmark"
args=()
if [ "$tiny" = 1 ]; then args+=(--tiny); fi
if [ -n "$out" ]; then args+=(--out "$out"); fi
timeout "${GPU_BENCH_TIMEOUT:-300}" python scripts/gpu_bench.py "${args[@]}" 2>&1 | log bench.log
bench_status=${PIPESTATUS[0]}

echo "== done: tests exit status $test_status, benchmark exit status $bench_status (124: timed out)"
if [ "$test_status" != skipped ] && [ "$test_status" != 0 ]; then exit 1; fi
exit "$bench_status"
