#!/usr/bin/env bash
# Everything the GPU machine must do, in one call: build the runtime in place, run the GPU tests,
# run the benchmark; results under $OUT (or ./gpu_out). Usage: bash scripts/gpu_check.sh [smoke|tests|bench|all]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
what=${1:-all}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export TRTLLM_MK_CACHE=${TRTLLM_MK_CACHE:-$PWD/.cubin_cache}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
# The runtime extension is built in place (the editable install only maps the package to this tree).
{ python setup.py build_ext --inplace && pip install --no-deps --no-build-isolation -e . ; } > "$OUT/build.log" 2>&1 \
  || { tail -30 "$OUT/build.log"; exit 1; }
python -c "import trtllm_mk._mkrt" || { echo "runtime extension missing"; tail -30 "$OUT/build.log"; exit 1; }
if [[ $what == smoke || $what == all ]]; then
  for m in ${SMOKE_MODELS:-tiny-llama tiny-qwen3 tiny-qwen2 llama-1b}; do
    timeout 300 python scripts/mk_smoke.py $m ${SMOKE_BATCH:-1} 2>&1 | tail -8 | tee -a "$OUT/smoke.txt"
  done
fi
if [[ $what == tests || $what == all ]]; then
  timeout 500 python -m pytest -x -q -m gpu tests 2>&1 | tail -40 | tee "$OUT/gpu_tests.txt"
fi
if [[ $what == bench || $what == all ]]; then
  timeout 500 python benchmarks/decode_latency.py --out "$OUT/bench" ${BENCH_ARGS:-} 2>&1 | tail -40 | tee "$OUT/bench.txt"
fi
