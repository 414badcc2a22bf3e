#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with the binaries scripts/build-gpu-bins.sh put in .bin/.
# Writes logs and CSVs under $OUT (the device tool's output folder; /tmp/pipeshard-out elsewhere).
#   PARTS="tests hf exec" (default); also "unit" (exec's unit tests: the AVX-512 kernels on this CPU), "profile"
#   (profile measure into $OUT/$PROFILE_NAME.json), "cpusection" (the same, CPU section only, keeping the GPU and PCIe
#   sections of $GPU_FROM), "hostsection" (PCIe, launches, DRAM and CPU, GPU op rows of $GPU_FROM),
#   "validate" (the H200 grid with every cell's traces, against the profile this call or an earlier call on
#   the same warm machine measured, if any; skipped where the profiler found that host disturbed),
#   "preenqueue" (exec run --pre-enqueue on/off A/B on a CPU-experts decode, and a checked run with it on),
#   "ringwait" (when a compute-stream wait on a copy's event ends behind a deep copy queue), "launchpace" (the
#   host's launch pace idle, after the validation's host check, with polling workers and under CPU load),
#   "besidelaunch" (the CPU expert block while the host thread launches GPU work, against polling only),
#   "ncuattn" (decode attention and its split combine under ncu at 4K and 16K keys), "grouped" (exec run
#   --grouped-experts on/off A/B, checked), "tiled" (the same on the q4_0 MoE's prefill, where it switches the tiled experts),
#   "binab" (that q4_0 MoE run by .bin/pipeshard against another build's CLI, AB_BASE, at AB_BUDGETS),
#   "bounds" (exec bench --bounds) and "experts" (the CPU expert block's bench at qwen3-30b-a3b's decode shape
#   beside the DRAM read, every thread); EXEC_MODELS, EXEC_PLANNERS, EXEC_GEN and EXEC_TIMEOUT shape the exec
#   part, VALIDATE_EXPERIMENT (default experiments/validate-h200.toml) the grid.
set -uo pipefail
OUT=${OUT:-/tmp/pipeshard-out}
mkdir -p "$OUT"
for f in .bin/*.xz; do [[ -e $f ]] && xz -d -f "$f" && chmod +x "${f%.xz}"; done
# The binaries' commit as build-gpu-bins.sh recorded it (with `-dirty` where they were built from changes).
export PIPESHARD_COMMIT="$(cat .bin/commit 2>/dev/null || echo unknown)"
PARTS=${PARTS:-"tests hf exec"}
# The profile's name and file follow the lease's GPU ("NVIDIA H100 80GB HBM3" → h100): a lease may bring an
# H100 where an H200 was asked for, and an H200's GPU rows would misprice it.
PROFILE_NAME=${PROFILE_NAME:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 \
  | grep -oiE '\b[a-z][0-9]{2,4}\b' | head -1 | tr 'A-Z' 'a-z')}
PROFILE_NAME=${PROFILE_NAME:-h200}
# A profile measured here ("profile", "hostsection", "cpusection") is also kept in .lease/ (git-ignored, not
# carried): a later call on the same warm machine validates against it, so a profile and a validation that do
# not fit one 10-minute command still measure one host (leases' hosts differ: run39 against run40, README).
# A profile whose host the profiler found disturbed (its note says "measure again") is marked so: "validate"
# then skips (VALIDATE_ANYWAY=1 runs it), which saved ~200 s of a disturbed lease (run42) for another lease.
keep_profile() {
  [[ -s $OUT/$PROFILE_NAME.json ]] || return 0
  mkdir -p .lease && cp "$OUT/$PROFILE_NAME.json" .lease/profile.json
  if grep -q "measure again" "$1"; then touch .lease/disturbed; else rm -f .lease/disturbed; fi
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; date -u; } > "$OUT/machine.txt" 2>&1
if [[ $PARTS == *tests* ]]; then
  export PIPESHARD_HF_DIR=/tmp/pipeshard-hf
  timeout 330 .bin/exec-gpu-tests --test-threads=1 --nocapture > "$OUT/gpu-tests.log" 2>&1
  echo "gpu tests exit $?" >> "$OUT/gpu-tests.log"
  grep -E "^device|^[a-z].*\(|^(all-|stream|static|dynamic|per-layer|attn|switch|op off)|test result|panicked|refused|exit" "$OUT/gpu-tests.log" | cut -c1-150
fi
if [[ $PARTS == *unit* ]]; then
  timeout 120 .bin/exec-unit-tests --test-threads="$(nproc)" > "$OUT/exec-unit-tests.log" 2>&1
  echo "exec unit tests exit $?" >> "$OUT/exec-unit-tests.log"
  grep -E "test result|panicked|FAILED|exit" "$OUT/exec-unit-tests.log"
fi
if [[ $PARTS == *profile* ]]; then
  # ≈ 250 s on the H200 since session 10 (215 s was too little), 290 s with the tiled expert rows (session 18).
  timeout ${PROFILE_TIMEOUT:-360} .bin/pipeshard profile measure --name "$PROFILE_NAME" --threads "$(nproc)" --out "$OUT/$PROFILE_NAME.json" > "$OUT/profile.log" 2>&1
  echo "profile exit $?" >> "$OUT/profile.log"
  keep_profile "$OUT/profile.log"
  grep -E "^note|exit" "$OUT/profile.log" | cut -c1-200
fi
if [[ $PARTS == *hostsection* ]]; then
  # Everything the host shapes (PCIe, launches, interference, DRAM, CPU), GPU op rows from $GPU_FROM (~3 min
  # instead of ~5 for the whole profile). It did not make the validation that follows more accurate (run27:
  # its CPU GEMV rows read 26 % slow while the cells minutes later ran at full speed; README, session 12).
  # GPU_EXPERTS=1: the GPU's routed-expert rows measured again too (an executor change moved them).
  timeout ${HOST_SECTION_TIMEOUT:-240} .bin/pipeshard profile measure --name "$PROFILE_NAME" --threads "$(nproc)" --host-only \
    --gpu-from "$GPU_FROM" ${GPU_EXPERTS:+--gpu-experts} --out "$OUT/$PROFILE_NAME.json" > "$OUT/profile-host.log" 2>&1
  echo "profile exit $?" >> "$OUT/profile-host.log"
  keep_profile "$OUT/profile-host.log"
  grep -E "^note|exit|wall time" "$OUT/profile-host.log" | cut -c1-200
fi
if [[ $PARTS == *cpusection* ]]; then
  # The CPU section again, keeping the GPU and PCIe sections of $GPU_FROM (a profile whose host was disturbed).
  timeout ${CPU_SECTION_TIMEOUT:-330} .bin/pipeshard profile measure --name "$PROFILE_NAME" --threads "$(nproc)" --cpu-only --gpu-from "$GPU_FROM" \
    --out "$OUT/$PROFILE_NAME.json" > "$OUT/profile-cpu.log" 2>&1
  echo "profile exit $?" >> "$OUT/profile-cpu.log"
  keep_profile "$OUT/profile-cpu.log"
  grep -E "^note|exit|wall time" "$OUT/profile-cpu.log" | cut -c1-200
fi
if [[ $PARTS == *validate* && -e .lease/disturbed && -z ${VALIDATE_ANYWAY:-} ]]; then
  echo "validate skipped: the profiler found this host disturbed (.lease/profile.json's note: measure again); a fresh lease, or VALIDATE_ANYWAY=1"
elif [[ $PARTS == *validate* ]]; then
  profile=profiles/$PROFILE_NAME.json
  if [[ -s $OUT/$PROFILE_NAME.json ]]; then profile=$OUT/$PROFILE_NAME.json; elif [[ -s .lease/profile.json ]]; then profile=.lease/profile.json; fi
  echo "validating against $profile"
  timeout ${VALIDATE_TIMEOUT:-420} .bin/pipeshard validate --experiment "${VALIDATE_EXPERIMENT:-experiments/validate-h200.toml}" --profile "$profile" \
    --worst 4 --all-traces --out "$OUT/validation" > "$OUT/validate.log" 2>&1
  echo "validate exit $?" >> "$OUT/validate.log"
  # Everything validate wrote (cells.csv, summary, provenance, plots, worst cells, every cell's traces) in one
  # file: the device tool brings back 8 files at most (run31 lost its summary and provenance to that limit).
  tar czf "$OUT/validation.tgz" -C "$OUT" validation && rm -rf "$OUT/validation"
  tail -n 30 "$OUT/validate.log" | cut -c1-200
fi
if [[ $PARTS == *experts* ]]; then
  { timeout 60 .bin/pipeshard exec bench --cpu-only --formats none --cpu-bytes 256M --threads "$(nproc)"
    timeout 200 .bin/exec-experts-bench --bench --noplot; echo "experts exit $?"; } > "$OUT/experts.log" 2>&1
  grep -E "DRAM read|bf16 \(|experts_t|time:|thrpt:|exit" "$OUT/experts.log"
fi
if [[ $PARTS == *preenqueue* ]]; then
  # `exec run --pre-enqueue on|off` interleaved on a CPU-experts decode (qwen3-30b-a3b@4L bf16, pshard at 2 GB),
  # then one checked run with it on (logits against an all-pinned reference).
  mkdir -p "$OUT/ab"
  run_ab() { timeout 150 .bin/pipeshard exec run --model qwen3-30b-a3b@4L --weights bf16 --budget 2G --planner pshard \
    --prompt-tokens 1008 --ctx 1K --gen 16 --threads "$(nproc)" --profile profiles/h200.json "$@"; }
  for i in 1 2; do for p in on off; do
    run_ab --pre-enqueue $p --trace "$OUT/ab/t$i-$p.json" > "$OUT/ab/run$i-$p.log" 2>&1
    grep -E "TTFT|warn|failed|error" "$OUT/ab/run$i-$p.log" | sed "s/^/$i $p: /"
  done; done
  run_ab --pre-enqueue on --check > "$OUT/ab/check-on.log" 2>&1
  grep -E "check|reference|failed|error" "$OUT/ab/check-on.log"
  tar czf "$OUT/ab.tgz" -C "$OUT" ab && rm -rf "$OUT/ab"
fi
if [[ $PARTS == *grouped* ]]; then
  # `exec run --grouped-experts on|off` interleaved on an all-pinned bf16 MoE decode (qwen3-30b-a3b@4L at 16 GB)
  # and at 2 GB (pinned experts beside streamed and CPU ones), each run checked against the all-pinned
  # per-expert reference.
  mkdir -p "$OUT/grouped"
  for budget in 16G 2G; do for i in 1 2; do for g in on off; do
    timeout 150 .bin/pipeshard exec run --model qwen3-30b-a3b@4L --weights bf16 --budget $budget --planner pshard \
      --prompt-tokens 1008 --ctx 1K --gen 16 --threads "$(nproc)" --profile profiles/h200.json --grouped-experts $g \
      --check --trace "$OUT/grouped/t-$budget-$i-$g.json" > "$OUT/grouped/run-$budget-$i-$g.log" 2>&1
    grep -E "TTFT|check:|failed|error" "$OUT/grouped/run-$budget-$i-$g.log" | sed "s/^/$budget $i $g: /"
  done; done; done
  tar czf "$OUT/grouped.tgz" -C "$OUT" grouped && rm -rf "$OUT/grouped"
fi
if [[ $PARTS == *tiled* ]]; then
  # `exec run --grouped-experts on|off` interleaved on the validation's q4_0 MoE (qwen3-30b-a3b@24L, a 1008-token
  # prefill in one chunk) all pinned (16 GB) and with pinned experts beside streamed and CPU ones (4 GB): the
  # tiled prefill experts against the per-expert path (and, since session 18, the grouped q4_0 decode experts),
  # each run checked against the all-pinned per-expert reference.
  mkdir -p "$OUT/tiled"
  for budget in 16G 4G; do for g in on off; do
    timeout 100 .bin/pipeshard exec run --model qwen3-30b-a3b@24L --weights q4_0 --budget $budget --planner pshard \
      --prompt-tokens 1008 --ctx 1K --gen 16 --threads "$(nproc)" --profile profiles/h200.json --grouped-experts $g \
      --check --trace "$OUT/tiled/t-$budget-$g.json" > "$OUT/tiled/run-$budget-$g.log" 2>&1
    grep -E "TTFT|check:|failed|error" "$OUT/tiled/run-$budget-$g.log" | sed "s/^/$budget $g: /" | cut -c1-200
  done; done
  tar czf "$OUT/tiled.tgz" -C "$OUT" tiled && rm -rf "$OUT/tiled"
fi
if [[ $PARTS == *binab* ]]; then
  # The same q4_0 MoE run (qwen3-30b-a3b@24L, a 1008-token prefill in one chunk, pshard) by two builds,
  # interleaved at AB_BUDGETS: .bin/pipeshard against $AB_BASE (another commit's CLI, built into .bin/ by
  # hand), each checked against the all-pinned reference, with traces (the executor's host and GPU spans).
  mkdir -p "$OUT/binab"
  base=${AB_BASE:-.bin/pipeshard-base}
  for budget in ${AB_BUDGETS:-2G 4G}; do for i in 1 2; do for b in new base; do
    bin=.bin/pipeshard; [[ $b == base ]] && bin=$base
    timeout 100 "$bin" exec run --model qwen3-30b-a3b@24L --weights q4_0 --budget $budget --planner pshard \
      --prompt-tokens 1008 --ctx 1K --gen 16 --threads "$(nproc)" --profile profiles/h200.json \
      --check --trace "$OUT/binab/t-$budget-$i-$b.json" > "$OUT/binab/run-$budget-$i-$b.log" 2>&1
    grep -E "TTFT|check:|failed|error" "$OUT/binab/run-$budget-$i-$b.log" | sed "s/^/$budget $i $b: /" | cut -c1-200
  done; done; done
  tar czf "$OUT/binab.tgz" -C "$OUT" binab && rm -rf "$OUT/binab"
fi
if [[ $PARTS == *ncuattn* ]]; then
  # Decode attention and its split combine under ncu at 4K and 16K keys (qwen3-30b-a3b@2L, its 32/4 heads):
  # the device time of each, the last decode steps' launches (prefill chunks run unsplit, no combine).
  mkdir -p "$OUT/ncu"
  for ctx in 4096 16384; do
    timeout 100 ncu --clock-control none --kernel-name regex:'^(attention|attn_combine)$' \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv .bin/pipeshard exec run --model qwen3-30b-a3b@2L \
      --weights q4_0 --budget 32G --planner pshard --prompt-tokens $((ctx - 64)) --ctx $ctx --gen 4 \
      --profile profiles/h200.json > "$OUT/ncu/attn-$ctx.csv" 2> "$OUT/ncu/attn-$ctx.err"
    python3 - "$OUT/ncu/attn-$ctx.csv" "$ctx" <<'PY'
import csv, io, sys
text = open(sys.argv[1]).read()
rows = list(csv.DictReader(io.StringIO(text[text.find('"ID"'):]))) if '"ID"' in text else []
for k in ("attention", "attn_combine"):
    t = [float(r["Metric Value"].replace(",", "")) / 1e3 for r in rows
         if r["Kernel Name"] == k and r["Metric Name"] == "gpu__time_duration.sum"]
    b = [float(r["Metric Value"].replace(",", "")) / 1e6 for r in rows
         if r["Kernel Name"] == k and r["Metric Name"] == "dram__bytes_read.sum"]
    print(f"ctx {sys.argv[2]} {k}: last 4 launches {['%.1f us' % x for x in t[-4:]]}, DRAM read {['%.2f MB' % x for x in b[-4:]]}")
PY
  done
  tar czf "$OUT/ncu.tgz" -C "$OUT" ncu && rm -rf "$OUT/ncu"
fi
if [[ $PARTS == *ringwait* ]]; then
  # When a compute-stream wait on one copy's event ends behind a deep copy queue (crates/exec/examples/ring_wait.rs).
  timeout 60 .bin/exec-ring-wait > "$OUT/ring-wait.log" 2>&1
  echo "ring wait exit $?" >> "$OUT/ring-wait.log"
  cat "$OUT/ring-wait.log"
fi
if [[ $PARTS == *launchpace* ]]; then
  # The host's launch pace idle, after the validation's host check, while the pool's workers poll and under CPU
  # load (crates/profiler/examples/launch_pace.rs).
  timeout 90 .bin/launch-pace "$(nproc)" > "$OUT/launch-pace.log" 2>&1
  echo "launch pace exit $?" >> "$OUT/launch-pace.log"
  cat "$OUT/launch-pace.log"
fi
if [[ $PARTS == *besidelaunch* ]]; then
  # A decode layer's CPU expert block with the host thread launching GPU work meanwhile against polling only
  # (crates/profiler/examples/cpu_experts_beside_launches.rs).
  timeout 60 .bin/cpu-experts-beside-launches "$(nproc)" > "$OUT/cpu-experts-beside-launches.log" 2>&1
  echo "cpu experts beside launches exit $?" >> "$OUT/cpu-experts-beside-launches.log"
  cat "$OUT/cpu-experts-beside-launches.log"
fi
if [[ $PARTS == *bounds* ]]; then
  timeout 330 .bin/pipeshard exec bench --bounds --formats none --threads "$(nproc)" --trace --out "$OUT/bounds" \
    > "$OUT/bounds.log" 2>&1
  echo "bounds exit $?" >> "$OUT/bounds.log"
  grep -E "^\||pre-enqueue:" "$OUT/bounds.log" | cut -c1-200
fi
if [[ $PARTS == *hf* ]]; then
  PYTHONUNBUFFERED=1 timeout 150 python3 scripts/hf_compare.py /tmp/pipeshard-hf > "$OUT/hf-compare.log" 2>&1
  echo "hf compare exit $?" >> "$OUT/hf-compare.log"
  tail -n 12 "$OUT/hf-compare.log"
fi
if [[ $PARTS == *exec* ]]; then
  for model in ${EXEC_MODELS:-nemo-8b llama-3.1-8b}; do
    timeout ${EXEC_TIMEOUT:-250} .bin/pipeshard exec run --model "$model" --weights bf16 --prompt-tokens 1024 --ubatch 1024 \
      --gen ${EXEC_GEN:-32} --ctx 4K --budget 2G,4G,8G,16G,32G --planner ${EXEC_PLANNERS:-ngl,pshard,ilp} --threads "$(nproc)" --check \
      --csv "$OUT/exec.csv" --trace "$OUT/trace.json" > "$OUT/exec-$model.log" 2>&1
    echo "exec $model exit $?" >> "$OUT/exec-$model.log"
    grep -E "budget|TTFT|peak|failed|cannot|tokens:|check:|reference|overhead|exit" "$OUT/exec-$model.log" | cut -c1-160
  done
  ls "$OUT"/trace-*.json 2>/dev/null | tail -n +2 | xargs -r rm -f
fi
