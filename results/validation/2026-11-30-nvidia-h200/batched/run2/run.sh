#!/usr/bin/env bash
# issue 10, batched cells: CPU rows (16 threads) and the GPU's batched decode attention measured in this lease,
# then the batched validation grid against that profile. Everything lands in $OUT/run.tgz.
set -u
B=.dev-batch2/pipeshard
R=/tmp/r
mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1
lscpu | grep -E "Model name|^CPU\(s\)" >> $R/gpu.txt
T0=$(date +%s)
$B profile measure --cpu-only --gpu-from profiles/h200.json --gpu-decode-attention --threads 16 --name h200 \
  --out $R/h200-cpu16.json > $R/profile.log 2>&1
echo "profile rc=$? $(( $(date +%s) - T0 )) s" | tee -a $R/profile.log
T1=$(date +%s)
$B validate --experiment .dev-batch2/validate-h200-batched.toml --profile $R/h200-cpu16.json --out $R/v --worst 3 \
  > $R/validate.log 2>&1
echo "validate rc=$? $(( $(date +%s) - T1 )) s" | tee -a $R/validate.log
tail -5 $R/profile.log; tail -25 $R/validate.log
tar czf $OUT/run.tgz -C /tmp r
cp $R/validate.log $R/profile.log $OUT/
