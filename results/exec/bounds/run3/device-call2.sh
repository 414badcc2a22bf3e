#!/bin/bash
# Second device call (wt-s9-a): nemo-8b all pinned decode traces, fused (new) and unfused (base), and the new GPU test.
set -u
cd "$(dirname "$0")/.."
for f in pipeshard pipeshard-base gpu-tests; do
  xz -dc .dev-a/$f.xz > /tmp/$f 2>/dev/null || python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open('.dev-a/$f.xz').read())" > /tmp/$f
  chmod +x /tmp/$f
done
L=$OUT/logs; mkdir -p $L
T0=$(date +%s)
stamp() { echo "== $(( $(date +%s) - T0 )) s: $*" | tee -a $L/times.log; }
run() { # $1 = new|base
  bin=/tmp/pipeshard; c=$NEWC; [ $1 = base ] && { bin=/tmp/pipeshard-base; c=$BASEC; }
  PIPESHARD_COMMIT=$c timeout $2 $bin exec run --model nemo-8b --weights bf16 --budget 40G --planner ilp --prompt-tokens 128 --gen 16 --ctx 1K --profile profiles/h200.json --threads 16 --trace $L/$1.json --csv $L/$1.csv > $L/$1.log 2>&1; echo "rc=$?" >> $L/$1.log
  tail -4 $L/$1.log
}
stamp new; run new 22
stamp test
PIPESHARD_COMMIT=$NEWC timeout 8 /tmp/gpu-tests one_gemm --test-threads 1 --nocapture > $L/gpu-test-one-gemm.log 2>&1; echo "rc=$?" >> $L/gpu-test-one-gemm.log
grep -E "rel err|test result|rc=" $L/gpu-test-one-gemm.log
stamp base; run base $(( 46 - $(date +%s) + T0 ))
stamp done
cd $OUT && tar czf run2.tgz logs && rm -rf logs
