#!/usr/bin/env bash
# The device check: GPU tests (the Triton kernels: attention, 8-bit KV, GGUF, AWQ/GPTQ/W8A8, fused MoE, MLA, LoRA; engines
# on them), decode-attention bandwidth, 8B-shaped throughput vs transformers; one table.
#
#   PYTHONUNBUFFERED=1 bash benchmarks/gpu_check.sh            # from the repository root, on a CUDA machine
#
# Each section runs on its own under a timeout, so one failing or hanging section does not stop the others;
# the table says each section's exit status. With OUT set, the table and the logs are written there too.
# Section timeouts (seconds) can be lowered for a short lease: TESTS_S, ATTENTION_S, PAGELLM_S, HF_S, KERNELS_S,
# GGUF_TESTS_S, GGUF_S (0 skips a kernels or gguf section). The GGUF kernels' tests run in their own section
# (gguf_tests), not in `tests`: they compile ~65 kernels, in 4 processes where pytest-xdist is installed. The
# kernels sections time the fused-MoE and MLA kernels at Mixtral's, Qwen3-MoE's and DeepSeek-V3's shapes (not yet
# run on a GPU); benchmarks/gguf_gpu_tiles.py, the GGUF tile sweep, is not part of the check (~2 minutes).
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python3}
DEST=${OUT:-$(mktemp -d)}
RESULTS="$DEST/gpu_results.jsonl"
: > "$RESULTS"
started=$(date +%s)

section() {  # section NAME TIMEOUT COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "=== $name (timeout ${limit}s) ==="
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$DEST/$name.log"
  local status=${PIPESTATUS[0]}
  local note="$(( $(date +%s) - t0 )) s"
  [ "$status" = 124 ] && note="$note, timed out"
  printf '{"section": "section", "name": "%s", "status": %d, "note": "%s"}\n' "$name" "$status" "$note" >> "$RESULTS"
}

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | tee "$DEST/gpu.txt"
$PYTHON -c "import torch, triton, transformers as t; print('torch', torch.__version__, 'triton', triton.__version__,
                                                          'transformers', t.__version__)"

# Several processes where pytest-xdist is installed: most of the time is Triton compiling, on the host's cores.
workers=$($PYTHON -c "import xdist" 2>/dev/null && echo "-n 4")
section tests "${TESTS_S:-240}" $PYTHON -m pytest -q -m gpu $workers tests/gpu -p no:cacheprovider \
  --ignore=tests/gpu/test_triton_gguf_gpu.py
summary=$(grep -E '^[0-9]+ (passed|failed)|passed|failed|error' "$DEST/tests.log" | tail -1)
printf '{"section": "tests", "name": "pytest -m gpu tests/gpu", "summary": "%s"}\n' "${summary//\"/}" >> "$RESULTS"

section attention "${ATTENTION_S:-80}" $PYTHON benchmarks/gpu_bench.py attention --results "$RESULTS"
section pagellm "${PAGELLM_S:-150}" $PYTHON benchmarks/gpu_bench.py pagellm --results "$RESULTS"
section hf "${HF_S:-90}" $PYTHON benchmarks/gpu_bench.py hf --results "$RESULTS"
if [ "${KERNELS_S:-120}" != 0 ]; then
  section kernels_moe "${KERNELS_S:-120}" $PYTHON benchmarks/gpu_kernels.py moe --results "$RESULTS"
  section kernels_mla "${KERNELS_S:-120}" $PYTHON benchmarks/gpu_kernels.py mla --results "$RESULTS"
fi

if [ "${GGUF_TESTS_S:-330}" != 0 ]; then
  section gguf_tests "${GGUF_TESTS_S:-330}" $PYTHON -m pytest -q -m gpu $workers tests/gpu/test_triton_gguf_gpu.py \
    -p no:cacheprovider
  summary=$(grep -E 'passed|failed|error|skipped' "$DEST/gguf_tests.log" | tail -1)
  printf '{"section": "tests", "name": "pytest tests/gpu/test_triton_gguf_gpu.py", "summary": "%s"}\n' \
    "${summary//\"/}" >> "$RESULTS"
fi
if [ "${GGUF_S:-180}" != 0 ]; then
  section gguf "${GGUF_S:-180}" $PYTHON benchmarks/gguf_gpu.py --results "$RESULTS" --out "$DEST/gguf_gpu.md"
fi

echo "=== table ($(( $(date +%s) - started )) s in all) ==="
$PYTHON benchmarks/gpu_bench.py table --results "$RESULTS" --out "$DEST/gpu_check.md"
