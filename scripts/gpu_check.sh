#!/usr/bin/env bash
# Everything the GPU machine does, in stages that each fit one device call; results under $OUT.
#   bash scripts/gpu_check.sh [build] [prebuild] [smoke] [tests] [quant] [sanitize] [trace] [calibrate] [ab] [sampling] [bench]
#                             [serve] [tp] [moe]
#   (default: all but prebuild, ab, serve, tp and moe)
# prebuild: the kernels of this run compiled in parallel on this machine's cores for its own GPU
#   (TRTLLM_MK_TEST_GPU=auto), so that what a CPU machine prebuilt for another GPU type (an H200 lent for
#   an H100) is not compiled one by one in the tests. PREBUILD_RUNS: one python argument line per
#   prebuild command (default: the moe and tp stages' kernels, tp over every GPU); PREBUILD_EXTRA: more.
# moe: the expert kinds (MOE_PARTS, default "tests bench"; "sanitize", or MOE_SANITIZE=1: the tiny
#   Qwen3-MoE tests under memcheck, then under racecheck with every lane releasing its ring reads, within
#   MOE_RACECHECK_TIMEOUT seconds, default 420: the four take about 330 s on an H200):
#   tests/test_moe_gpu.py, then the Qwen3-30B-A3B decode benchmark
#   (MOE_BENCH_BATCH, default "1 4"; context 512) beside torch.compile and eager + CUDA graph on the same
#   weights (prebuild: python tests/test_moe_gpu.py, and
#   benchmarks/megakernel_system.py --prebuild --models qwen3-30b-a3b --batch 1 4 --context 512).
# tp: tensor parallelism: tests/test_parallel_gpu.py (ranks on one GPU's SMs), then, with several GPUs,
#   scripts/tp_check.py under torchrun: the check (TP_CHECK_ARGS) and the speed run (TP_SPEED_ARGS, default
#   Llama-3.1-8B full depth, batch 1, context 512) over every GPU (TP_SIZE, default all of them). TP_PARTS (default
#   "check tests engine speed"; "sanitize": memcheck on every rank of a one-layer TP check, TP_SANITIZE_ARGS).
# quant: 4-bit weights (W4A16): tests/test_quant_gpu.py (the tests stage then leaves it out), then the
#   W4A16 decode benchmark (megakernel, tinygemm int4 torch.compile, bf16 torch.compile) under $OUT/quant_bench,
#   and with QUANT_PARTS "fp8bench" the FP8 one (megakernel, torch.compile FP8 weight-only) under $OUT/fp8_bench.
#   QUANT_PARTS (default "tests bench"), QUANT_TESTS_TIMEOUT, QUANT_BENCH_ARGS (default: llama-3.2-1b and
#   llama-3.1-8b, batch 1, context 512), QUANT_BENCH_TIMEOUT (or what DEADLINE_S leaves).
# TRACE_RUNS: one scripts/mk_trace.py argument line per traced step (default: llama-3.2-1b --batch 1).
# AB_RUNS: one scripts/mk_ab.py argument line per interleaved A/B (the ab stage).
# SAMPLING_MODELS: model shapes whose step is timed with each sampling mode (default: llama-3.2-1b).
# DEADLINE_S: seconds this script may run in all (a device call's limit); the bench stage gets what is left.
# PACK_OUT=1: leave one archive, $OUT/results.tar.gz, instead of the separate files.
# Kernels are content-hash cached in .cubin_cache: precompile them on a CPU machine with
#   TRTLLM_MK_CACHE=.cubin_cache python tests/test_megakernel_gpu.py
#   TRTLLM_MK_CACHE=.cubin_cache python tests/test_shapes_gpu.py
#   TRTLLM_MK_CACHE=.cubin_cache python benchmarks/megakernel_system.py --prebuild --context 512
#   TRTLLM_MK_CACHE=.cubin_cache python tests/test_quant_gpu.py
#   TRTLLM_MK_CACHE=.cubin_cache python benchmarks/megakernel_system.py --prebuild --context 512 --batch 1 \
#     --models llama-3.2-1b llama-3.1-8b --weights w4a16 --group 128
# and carry .cubin_cache along, so device time goes to running kernels, not compiling them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
stages=${*:-build smoke tests quant sanitize trace calibrate sampling bench}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export TRTLLM_MK_CACHE=${TRTLLM_MK_CACHE:-$PWD/.cubin_cache}
has() { [[ " $stages " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
# The runtime extension is built in place (the editable install maps the package to this tree).
if [[ ! -f trtllm_mk/_mkrt*.so ]] || has build; then
  { python setup.py build_ext --inplace && pip install --no-deps --no-build-isolation -e . ; } > "$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; exit 1; }
fi
python -c "import trtllm_mk._mkrt" || { echo "runtime extension missing"; tail -30 "$OUT/build.log"; exit 1; }
if has prebuild; then
  n=$(nvidia-smi -L | wc -l)
  prebuild_runs=${PREBUILD_RUNS:-"tests/test_moe_gpu.py
benchmarks/megakernel_system.py --prebuild --gpu auto --models qwen3-30b-a3b --batch 1 4 --context 512
scripts/mk_trace.py qwen3-30b-a3b --prebuild --gpu auto
scripts/tp_check.py --prebuild $n --model llama-3.2-1b --layers 4
scripts/tp_check.py --prebuild $n --model llama-3.2-1b --layers 1
scripts/tp_check.py --prebuild $n --model llama-3.1-8b --layers 0"}
  [[ -n "${PREBUILD_EXTRA:-}" ]] && prebuild_runs+=$'\n'"$PREBUILD_EXTRA"
  t0=$SECONDS
  while read -r line; do
    [[ -n "$line" ]] && { TRTLLM_MK_TEST_GPU=auto timeout 420 python $line >> "$OUT/prebuild.log" 2>&1 || echo "prebuild failed: $line"; } &
  done <<< "$prebuild_runs"
  wait
  echo "prebuild: $(( SECONDS - t0 )) s, $(ls "$TRTLLM_MK_CACHE"/*.cubin | wc -l) cubins in the cache"
fi
if has smoke; then
  for m in ${SMOKE_MODELS:-tiny-llama llama-1b}; do
    timeout 300 python scripts/mk_smoke.py $m ${SMOKE_BATCH:-1} 2>&1 | tail -4 | tee -a "$OUT/smoke.txt"
  done
fi
if has tests; then
  tests_default=tests; has quant && tests_default="tests --ignore=tests/test_quant_gpu.py"
  timeout ${TESTS_TIMEOUT:-540} python -m pytest -q -s -m gpu ${TESTS:-$tests_default} -rs > "$OUT/gpu_tests.log" 2>&1
  grep -E "rel err|passed|failed|FAILED|Error" "$OUT/gpu_tests.log" | tail -40
fi
# seconds a part may run: its own limit, capped by what DEADLINE_S leaves (less 15 s to pack $OUT)
# (at least 1: a part the deadline leaves no time ends at once instead of failing timeout's arguments)
part_s() { local s=$1; [[ -n "${DEADLINE_S:-}" ]] && (( DEADLINE_S - SECONDS - 15 < s )) && s=$(( DEADLINE_S - SECONDS - 15 ))
           (( s < 1 )) && s=1; echo $s; }
if has quant; then
  quant_parts=" ${QUANT_PARTS:-tests bench} "
  eval "quant_args=(${QUANT_BENCH_ARGS:---models llama-3.2-1b llama-3.1-8b --batch 1 --context 512})"
  quant_s=$(part_s ${QUANT_TESTS_TIMEOUT:-420})
  if [[ "$quant_parts" == *" tests "* ]] && (( quant_s >= 30 )); then
    timeout $quant_s python -m pytest -q -s -m gpu tests/test_quant_gpu.py -rs > "$OUT/quant_tests.log" 2>&1
    grep -E "rel err|layout|int4 baseline|passed|failed|FAILED|Error" "$OUT/quant_tests.log" | tail -60
  elif [[ "$quant_parts" == *" tests "* ]]; then
    echo "quant tests: skipped, DEADLINE_S leaves ${quant_s}s"
  fi
  if [[ "$quant_parts" == *" bench "* ]]; then
    quant_s=$(part_s ${QUANT_BENCH_TIMEOUT:-420})
    (( quant_s >= 30 )) || { echo "quant bench: skipped, DEADLINE_S leaves ${quant_s}s"; quant_s=0; }
    (( quant_s > 0 )) && timeout $quant_s python -m benchmarks.decode_latency --out "$OUT/quant_bench" --plugin benchmarks.megakernel_system \
      --weights w4a16 --group ${QUANT_GROUP:-128} "${quant_args[@]}" 2>&1 | tail -30 > "$OUT/quant_bench.txt"
    grep "|" "$OUT/quant_bench/report.md" 2>/dev/null || tail -5 "$OUT/quant_bench.txt" 2>/dev/null
  fi
  if [[ "$quant_parts" == *" fp8bench "* ]]; then   # FP8 weights against gpt-fast's weight-only form, compiled
    quant_s=$(part_s ${QUANT_BENCH_TIMEOUT:-420})
    (( quant_s >= 30 )) && timeout $quant_s python -m benchmarks.decode_latency --out "$OUT/fp8_bench" \
      --plugin benchmarks.megakernel_system --weights fp8 "${quant_args[@]}" 2>&1 | tail -30 > "$OUT/fp8_bench.txt"
    grep "|" "$OUT/fp8_bench/report.md" 2>/dev/null || tail -5 "$OUT/fp8_bench.txt" 2>/dev/null
  fi
fi
if has sanitize; then
  # racecheck twice: the production kernel (its only reports should be the ring-slot release that
  # racecheck cannot credit, see EMPTY_ARRIVALS in mk_kernel.cuh) and the all-lanes-release variant
  # (and memcheck / all-lanes racecheck again on a plan whose OPROJ merges the attention partials)
  # (and, with every row sampling through the candidate search, memcheck and all-lanes racecheck)
  # (and, with 4-bit and FP8 weights, memcheck and all-lanes racecheck: the fifth field, 1 or 8)
  # (and the cp.async weight ring of GPUs without bulk copies: the sixth field, 1; with 4-bit weights too)
  for run in ${SANITIZE_RUNS:-memcheck:0:0:0:0 racecheck:0:0:0:0 racecheck:1:0:0:0 memcheck:0:1:0:0 racecheck:1:1:0:0 memcheck:0:0:1:0 racecheck:1:0:1:0 memcheck:0:0:0:1 racecheck:1:0:0:1 memcheck:0:0:0:8 racecheck:1:0:0:8 memcheck:0:0:0:0:1 racecheck:1:0:0:0:1 memcheck:0:0:0:1:1 racecheck:1:0:0:1:1}; do
    IFS=: read -r tool all merge sample w4 cpa <<< "$run"
    w4=${w4:-0}; cpa=${cpa:-0}
    log="$OUT/sanitize_${tool}_${all}_${merge}_${sample}_${w4}_$cpa.log"
    MK_SMOKE_SHORT=1 MK_SMOKE_ARRIVE_ALL=$all MK_SMOKE_MERGE=$merge MK_SMOKE_SAMPLE=$sample MK_SMOKE_W4=$w4 MK_SMOKE_CPASYNC=$cpa timeout 240 \
      compute-sanitizer --tool $tool --print-limit 20 python scripts/mk_smoke.py tiny-llama > "$log" 2>&1
    echo "$tool (all-lanes release $all, o_merge $merge, sampling $sample, 4-bit $w4, cp.async ring $cpa) exit $?: $(grep -E \
      "ERROR SUMMARY|RACECHECK SUMMARY|Hazard|Invalid" "$log" | tail -3)" | tee -a "$OUT/sanitize.txt"
  done
fi
if has trace; then
  while read -r line; do
    [[ -n "$line" ]] || continue
    timeout 300 python scripts/mk_trace.py $line --out "$OUT/trace" 2>&1 | tail -16 | tee -a "$OUT/trace.txt"
  done <<< "${TRACE_RUNS:-llama-3.2-1b --batch 1}"
fi
if has ab; then
  while read -r line; do
    [[ -n "$line" ]] || continue
    timeout 300 python scripts/mk_ab.py $line 2>&1 | tail -8 | tee -a "$OUT/ab.txt"
  done <<< "${AB_RUNS:-}"
fi
if has sampling; then
  for m in ${SAMPLING_MODELS:-llama-3.2-1b}; do
    timeout 300 python -m benchmarks.sampling_cost $m --out "$OUT/sampling" 2>&1 | tail -10 | tee -a "$OUT/sampling.txt"
  done
fi
if has calibrate; then
  timeout 540 python benchmarks/calibrate.py --out "$OUT/calibration" 2>&1 | tail -20 | tee "$OUT/calibrate.txt"
fi
if has bench; then
  eval "bench_args=(${BENCH_ARGS:---models llama-3.2-1b --batch 1 --context 512})"   # may hold quoted names
  bench_s=${BENCH_TIMEOUT:-540}
  [[ -n "${DEADLINE_S:-}" ]] && bench_s=$(( DEADLINE_S - SECONDS - 15 ))   # leave time to pack $OUT
  timeout $bench_s python -m benchmarks.decode_latency --out "$OUT/bench" --plugin benchmarks.megakernel_system \
    "${bench_args[@]}" 2>&1 | tail -30 > "$OUT/bench.txt"
  grep "|" "$OUT/bench/report.md" 2>/dev/null || tail -5 "$OUT/bench.txt"
  # the measured regression gate: this run against benchmarks/baselines/<gpu>.json (names what regressed)
  [[ -f "$OUT/bench/report.json" ]] && python -m benchmarks.regress check --allow-missing "$OUT/bench/report.json" 2>&1 | tee "$OUT/regress.txt"
fi
if has serve; then
  # The served load test (benchmarks/serve_load.py) on Llama-3.2-1B shapes with random weights: per
  # batch size in SERVE_BATCHES, the engine's decode step (bench), then the server at concurrency 1 set
  # against that step and, for a batch above 1, at concurrency = batch. engines/serve_llama1b_bs<B> is
  # reused when present (build it on a CPU machine and carry it along), built here otherwise.
  # fastapi, uvicorn and openai are not in the GPU image: wheels carried in .whl/ (scripts/serve_wheels.sh)
  if ! python -c "import fastapi, uvicorn, openai" 2>/dev/null && compgen -G ".whl/*.whl" > /dev/null; then
    python -m pip install -q --no-index --no-deps --no-compile --target /tmp/serve_site .whl/*.whl \
      > "$OUT/serve_wheels.log" 2>&1 && export PYTHONPATH=$PYTHONPATH:/tmp/serve_site
  fi
  python -c "import fastapi, uvicorn, openai" 2>/dev/null || echo "serve: fastapi, uvicorn or openai is missing:" \
    "run scripts/serve_wheels.sh where an index is reachable and carry .whl along"
  in_len=${SERVE_INPUT_LEN:-512}; out_len=${SERVE_OUTPUT_LEN:-128}
  python -c "import fastapi, uvicorn, openai" 2>/dev/null && for b in ${SERVE_BATCHES:-1 4}; do
    eng=engines/serve_llama1b_bs$b
    if [[ ! -f $eng/schedule.json ]]; then
      sed "s/^max_batch_size: .*/max_batch_size: $b/" configs/h100_bs1.yaml > "$OUT/serve_llama1b_bs$b.yaml"
      timeout 540 python -m trtllm_mk build --config "$OUT/serve_llama1b_bs$b.yaml" --output-dir $eng \
        > "$OUT/serve_build_bs$b.log" 2>&1 || { echo "serve: build of batch $b failed"; tail -3 "$OUT/serve_build_bs$b.log"
                                                continue; }
    fi
    timeout 300 python -m trtllm_mk bench --engine $eng --weights random --input-len $in_len --output-len $out_len \
      --runs 3 --json "$OUT/serve_bench_bs$b.json" > "$OUT/serve_bench_bs$b.txt" 2>&1
    cmp=(); [[ -f "$OUT/serve_bench_bs$b.json" ]] && cmp=(--compare-bench "$OUT/serve_bench_bs$b.json")
    for c in 1 $( (( b > 1 )) && echo $b ); do
      echo "== batch $b, concurrency $c" | tee -a "$OUT/serve.txt"
      timeout 300 python -m benchmarks.serve_load --engine $eng --weights random --input-len $in_len \
        --max-tokens $out_len --num-prompts $(( 16 * c )) --max-concurrency $c --warmup 2 ${cmp[@]+"${cmp[@]}"} \
        --out "$OUT/serve_load_bs${b}_c$c" --no-progress 2>&1 | tail -12 | tee -a "$OUT/serve.txt"
    done
  done
fi
if has moe; then   # the expert kinds: GPU tests, then Qwen3-30B-A3B against torch.compile
  moe_parts=" ${MOE_PARTS:-tests bench} "; [[ -n "${MOE_SANITIZE:-}" ]] && moe_parts+="sanitize "
  if [[ "$moe_parts" == *" tests "* ]]; then
    timeout $(part_s ${MOE_TESTS_TIMEOUT:-300}) python -m pytest -q -s -m gpu tests/test_moe_gpu.py -rs > "$OUT/moe_tests.log" 2>&1
    grep -E "rel err|passed|failed|FAILED|Error" "$OUT/moe_tests.log" | tail -20
  fi
  if [[ "$moe_parts" == *" sanitize "* ]]; then
    MK_MOE_TEST_STEPS=8 timeout $(part_s 240) compute-sanitizer --tool memcheck --print-limit 20 python -m pytest -q -s \
      -m gpu tests/test_moe_gpu.py -k "tiny and qwen3_moe" > "$OUT/moe_memcheck.log" 2>&1
    echo "moe memcheck exit $?: $(grep -E "ERROR SUMMARY|Invalid|passed|failed" "$OUT/moe_memcheck.log" | tail -3)"
    MK_MOE_TEST_STEPS=8 MK_MOE_ALL_LANES_RELEASE=1 timeout $(part_s ${MOE_RACECHECK_TIMEOUT:-420}) compute-sanitizer --tool racecheck --print-limit 20 \
      python -m pytest -q -s -m gpu tests/test_moe_gpu.py -k "tiny and qwen3_moe" > "$OUT/moe_racecheck.log" 2>&1
    echo "moe racecheck (all-lanes release) exit $?: $(grep -E "RACECHECK SUMMARY|Hazard|passed|failed" "$OUT/moe_racecheck.log" | tail -3)"
  fi
  if [[ "$moe_parts" == *" bench "* ]]; then
    timeout $(part_s ${MOE_BENCH_TIMEOUT:-420}) python -m benchmarks.decode_latency --out "$OUT/moe_bench" \
      --plugin benchmarks.megakernel_system --models qwen3-30b-a3b --batch ${MOE_BENCH_BATCH:-1 4} --context 512 \
      --systems "trtllm_mk megakernel" torch.compile eager+cudagraph 2>&1 | tail -20 > "$OUT/moe_bench.txt"
    grep "|" "$OUT/moe_bench/report.md" 2>/dev/null || tail -5 "$OUT/moe_bench.txt"
  fi
fi
if has tp; then
  # the check between GPUs first (it needs several), then the ranks on one GPU's SMs, then the speed run
  ngpu=$(nvidia-smi -L | wc -l)
  tp=${TP_SIZE:-$ngpu}
  tp_parts=" ${TP_PARTS:-check tests engine speed} "
  if (( tp > 1 )) && [[ "$tp_parts" == *" check "* ]]; then
    eval "tp_check=(${TP_CHECK_ARGS:---model llama-3.2-1b --layers 4 --steps 32})"
    timeout $(part_s ${TP_CHECK_TIMEOUT:-120}) torchrun --nproc-per-node $tp scripts/tp_check.py "${tp_check[@]}" \
      --out "$OUT" > "$OUT/tp_check.log" 2>&1; echo "tp_check rc=$?"; tail -25 "$OUT/tp_check.log"
  fi
  if [[ "$tp_parts" == *" tests "* ]]; then
    timeout $(part_s ${TP_TESTS_TIMEOUT:-150}) python -m pytest -q -s -m gpu tests/test_parallel_gpu.py -rs \
      > "$OUT/tp_tests.log" 2>&1
    grep -E "rel err|passed|failed|FAILED|Error" "$OUT/tp_tests.log" | tail -20
  fi
  if (( ngpu >= 2 )) && [[ "$tp_parts" == *" engine "* ]]; then   # torchrun run (2 GPUs) against run --simulate
    # for this machine's GPU type (the ranks refuse an engine built for another), on one checkpoint: with
    # --weights random each GPU rank draws its own shard on its GPU, not the model --simulate draws whole
    sed 's/^gpu: .*/gpu: auto/' configs/tiny_cpu_tp2.yaml > "$OUT/tiny_tp2.yaml"
    python -m trtllm_mk build --config "$OUT/tiny_tp2.yaml" --output-dir /tmp/tiny_tp2 > "$OUT/tp_engine.log" 2>&1
    python -c "import json, sys; from trtllm_mk.model.tiny import write_tiny_checkpoint as w
w(sys.argv[1], 'llama', seed=3, **json.load(open('configs/models/tiny-llama.json')))" /tmp/tiny_tp2_ckpt >> "$OUT/tp_engine.log" 2>&1
    for mode in gpu simulate; do
      if [[ $mode == gpu ]]; then launch=(env CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2 -m trtllm_mk)
      else launch=(python -m trtllm_mk); fi
      timeout $(part_s 90) "${launch[@]}" run --engine /tmp/tiny_tp2 --weights /tmp/tiny_tp2_ckpt --ignore-eos \
        --prompt "3 141 59 26 5 358 97" --max-new-tokens 16 $([[ $mode == simulate ]] && echo --simulate) \
        2>>"$OUT/tp_engine.log" | head -1 > "$OUT/tp_engine_$mode.txt"
    done
    [[ -s "$OUT/tp_engine_gpu.txt" ]] && cmp -s "$OUT/tp_engine_gpu.txt" "$OUT/tp_engine_simulate.txt" \
      && echo "tp engine: torchrun run = run --simulate: $(cat "$OUT/tp_engine_gpu.txt")" \
      || { echo "tp engine: outputs differ"; cat "$OUT"/tp_engine_*.txt; tail -5 "$OUT/tp_engine.log"; }
  fi
  if (( tp > 1 )) && [[ "$tp_parts" == *" sanitize "* ]]; then   # memcheck in every rank's process
    eval "tp_san=(${TP_SANITIZE_ARGS:---model llama-3.2-1b --layers 1 --steps 4})"
    timeout $(part_s 240) torchrun --nproc-per-node $tp --no-python compute-sanitizer --tool memcheck --print-limit 20 \
      python scripts/tp_check.py "${tp_san[@]}" --out "$OUT/tp_sanitize" > "$OUT/tp_memcheck.log" 2>&1
    echo "tp memcheck exit $?: $(grep -E "ERROR SUMMARY|Invalid|check" "$OUT/tp_memcheck.log" | tail -4)"
  fi
  if (( tp > 1 )) && [[ "$tp_parts" == *" speed "* ]]; then
    eval "tp_speed=(${TP_SPEED_ARGS:---model llama-3.1-8b --layers 0 --steps 100 --speed})"
    timeout $(part_s ${TP_SPEED_TIMEOUT:-300}) torchrun --nproc-per-node $tp scripts/tp_check.py "${tp_speed[@]}" \
      --out "$OUT" > "$OUT/tp_speed.log" 2>&1; echo "tp_speed rc=$?"; tail -12 "$OUT/tp_speed.log"
  fi
fi
if [[ -n "${PACK_OUT:-}" ]]; then
  # a transport that brings back only a few files: one archive of everything under $OUT
  tar czf /tmp/gpu_check_out.tar.gz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/gpu_check_out.tar.gz "$OUT/results.tar.gz"
fi
