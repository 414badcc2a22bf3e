#!/bin/bash
# Device run for issue 6 (wt-s9-a): GPU tests, bench --bounds before (base) and after (new), ncu of one decode stretch.
set -u
cd "$(dirname "$0")/.."
D=.dev-a
for f in pipeshard pipeshard-base gpu-tests; do
  xz -dc $D/$f.xz > /tmp/$f 2>/dev/null || python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open('$D/$f.xz').read())" > /tmp/$f
  chmod +x /tmp/$f
done
D=/tmp
L=$OUT/logs; mkdir -p $L
T0=$(date +%s)
stamp() { echo "== $(( $(date +%s) - T0 )) s: $*" | tee -a $L/times.log; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv > $L/smi.txt 2>&1
stamp gpu-tests
PIPESHARD_COMMIT=$NEWC timeout 170 $D/gpu-tests --test-threads 1 --nocapture > $L/gpu-tests.log 2>&1; echo "rc=$?" >> $L/gpu-tests.log
tail -5 $L/gpu-tests.log
for v in new base; do
  stamp bench $v
  bin=$D/pipeshard; c=$NEWC; [ $v = base ] && { bin=$D/pipeshard-base; c=$BASEC; }
  mkdir -p $L/bench-$v
  PIPESHARD_COMMIT=$c timeout 110 $bin exec bench --bounds --trace --threads 16 --cpu-bytes 256M --moe-model qwen3-30b-a3b@4L --out $L/bench-$v > $L/bench-$v/bench.log 2>&1; echo "rc=$?" >> $L/bench-$v/bench.log
  grep -A12 "| bound" $L/bench-$v/bench.log | head -12
done
stamp ncu
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
PIPESHARD_COMMIT=$NEWC timeout 90 $NCU --clock-control none --cache-control none --metrics gpu__time_duration.sum --launch-skip 1500 --launch-count 300 --csv \
  $D/pipeshard exec run --model nemo-8b --weights bf16 --budget 40G --planner ilp --prompt-tokens 16 --gen 4 --ctx 1K --profile profiles/h200.json > $L/ncu.csv 2> $L/ncu.err; echo "ncu rc=$?"
tail -3 $L/ncu.err
stamp done
cd $OUT && tar czf run.tgz logs && rm -rf logs
