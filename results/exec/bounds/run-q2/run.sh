#!/bin/bash
# Issue 14 run-q2: exec lib tests + GPU tests, then the CPU GEMV bench at 16 threads.
set -u
export PIPESHARD_COMMIT=3946c95
L=$OUT/logs; mkdir -p $L
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; lscpu | grep -E "Model name|Flags" | sed 's/Flags:.*/Flags: (see avx512 list)/'; grep -o 'avx512[a-z_0-9]*\|amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' '; echo; date -u; } > $L/machine.txt 2>&1
( timeout 20 ./exec-tests --test-threads 4 ; echo "exec-tests rc=$?" ) > $L/tests.log 2>&1
( PIPESHARD_GPU_CASES=tinyk timeout 40 ./gpu-tests --test-threads 1 ; echo "gpu-tests rc=$?" ) >> $L/tests.log 2>&1
( time timeout 100 ./pipeshard exec bench --threads 16 --cpu-only --cpu-bytes 512M --out $L/bench ; echo "bench rc=$?" ) > $L/bench.log 2>&1
cd $OUT && tar czf x.tgz logs && rm -rf logs
