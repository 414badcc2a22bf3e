#!/usr/bin/env bash
# Issue 14 on the GPU machine, in one command: the GEMV bandwidth bench, the quantised GPU kernel and placement
# tests, and qwen3-30b-a3b in q4_0 at 2/4/8/16 GB. Binaries from scripts/build-gpu-bins.sh in $BIN (default .bin).
# Logs, CSV and the bench table under $OUT (/tmp/pipeshard-out elsewhere).
set -uo pipefail
BIN=${BIN:-.bin}
OUT=${OUT:-/tmp/pipeshard-out}
mkdir -p "$OUT"
export PIPESHARD_COMMIT="$(cat "$BIN/commit" 2>/dev/null || echo unknown)"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; lscpu | grep 'Model name'; date -u; } > "$OUT/machine.txt" 2>&1
# exec's unit tests first: the AVX-512 (and AVX512_BF16) block kernels are checked only where the CPU has them.
# Should they fail, the rest runs on the f32 AVX-512 kernels (PIPESHARD_CPU_NO_BF16) and the log says so.
timeout 30 "$BIN/exec-unit-tests" --test-threads=4 > "$OUT/unit-tests.log" 2>&1
rc=$?; echo "unit tests exit $rc" >> "$OUT/unit-tests.log"
grep -E "test result|FAILED|panicked|exit" "$OUT/unit-tests.log"
[[ $rc == 0 ]] || export PIPESHARD_CPU_NO_BF16=1
if [[ ${PARTS:-bench tests exec} == *bench* ]]; then
  timeout ${BENCH_TIMEOUT:-150} "$BIN/pipeshard" exec bench --out "$OUT" > "$OUT/bench.log" 2>&1
  echo "bench exit $?" >> "$OUT/bench.log"
  grep -E "^\||exit" "$OUT/bench.log"
fi
if [[ ${PARTS:-bench tests exec} == *tests* ]]; then
  timeout 60 "$BIN/exec-gpu-tests" quantised_matmul --test-threads=1 --nocapture > "$OUT/gpu-kernel.log" 2>&1
  echo "gpu kernel test exit $?" >> "$OUT/gpu-kernel.log"
  grep -E "test result|panicked|exit" "$OUT/gpu-kernel.log"
  PIPESHARD_GPU_CASES=${CASES:-tiny-llama-q4_0,tiny-qwen3-q8_0,tiny-qwen3-moe-q4_0,tinyk} \
    timeout ${TESTS_TIMEOUT:-200} "$BIN/exec-gpu-tests" placement_mixes --test-threads=1 --nocapture > "$OUT/gpu-tests.log" 2>&1
  echo "gpu tests exit $?" >> "$OUT/gpu-tests.log"
  grep -E "^[a-z].*\(|^(all-|stream|static|dynamic|per-layer|attn|switch|op off)|test result|panicked|exit" "$OUT/gpu-tests.log" | cut -c1-130
fi
if [[ ${PARTS:-bench tests exec} == *exec* ]]; then
  timeout ${EXEC_TIMEOUT:-300} "$BIN/pipeshard" exec run --model qwen3-30b-a3b --weights q4_0 --prompt-tokens 1024 \
    --ubatch 1024 --gen ${EXEC_GEN:-32} --ctx 4K --budget ${EXEC_BUDGETS:-2G,4G,8G,16G} --planner ${EXEC_PLANNERS:-pshard} \
    --profile profiles/h200.json --threads "$(nproc)" --check --csv "$OUT/exec.csv" > "$OUT/exec.log" 2>&1
  echo "exec exit $?" >> "$OUT/exec.log"
  grep -E "budget|TTFT|peak|failed|cannot|tokens:|check:|reference|overhead|exit|weights" "$OUT/exec.log" | cut -c1-160
fi
