#!/usr/bin/env bash
# CPU check of the tiled expert kernels' weight loader (kernels.cu: te_load_w8), for machines without a GPU:
# g++ compiles kernels.cu's exact per-element dequantisers (qval, kval, k23val), the tiled section's helpers
# and main.cpp against a few shims (f16 → f32 in software), and main.cpp checks that the loader's eight-value
# paths (q8_0, q4_0, q4_K, q6_K) give, bit for bit, the per-element dequantisation rounded to bf16 and f16, over
# random blocks (random scale bits: NaN and infinity included) at every offset of two super-blocks.
# Usage: scripts/tiled-experts-emu/run.sh (from the repository root; a few seconds).
set -euo pipefail
here=$(dirname "$0")
k=crates/exec/src/cuda/kernels.cu
# Lines from the first line matching $1 up to (not including) the first later line matching $2.
span() { awk -v a="$1" -v b="$2" '$0 ~ a {on = 1} on && $0 ~ b && !($0 ~ a) {exit} on' "$k"; }
out=$(mktemp -d)
for act in 1 0; do
    {
        echo "#include \"$(realpath "$here")/shim.h\""
        span '^typedef unsigned short u16' '^#if KV_KIND' | grep -v 'asm('
        span '^typedef unsigned char u8' '^// Decode GEMV'
        span '^#define QK_K 256' '^// Four bytes'
        span '^__device__ __forceinline__ int q3k_scale' '^// The 8-bit activations'
        span '^// Weight formats of the routed-expert kernels' '^// Grouped routed experts'
        span '^#define TE_ROWS' '^// acc\[j\] = the 16'
        cat "$here/main.cpp"
    } > "$out/emu$act.cpp"
    g++ -std=c++20 -O1 -w -ffp-contract=off -DACT_BF16=$act "$out/emu$act.cpp" -o "$out/emu$act"
    "$out/emu$act"
done
