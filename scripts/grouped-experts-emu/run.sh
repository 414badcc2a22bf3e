#!/usr/bin/env bash
# CPU emulation of the grouped routed-expert kernels (kernels.cu: moe_gate_up_grouped*, moe_down_grouped*), for
# machines without nvcc or a GPU: g++ compiles kernels.cu's helpers, its exact per-element dequantisers and the
# grouped section against shim.h, which runs a warp as 32 threads meeting at every shuffle; main.cpp launches
# both kernels over 3 experts, 3 tokens, in bf16 (hidden 512 / ffn 264: row tails) and in q8_0, q4_0 (ffn 160:
# tails), q4_k and q6_k (rows of two super-blocks), and checks the SwiGLU rows and the residual's change against
# a double-precision reference on the same weights (dequantised element by element with `te_val`). It checks
# indexing and arithmetic, not NVRTC compilation or speed.
# Usage: scripts/grouped-experts-emu/run.sh (from the repository root; a few minutes on 2 cores).
set -euo pipefail
here=$(dirname "$0")
k=crates/exec/src/cuda/kernels.cu
helpers=$(grep -n '^// h\[t, :\] = table' "$k" | head -1 | cut -d: -f1)
# The function of kernels.cu whose first line starts with $1, through its closing brace.
fn() { awk -v s="$1" 'index($0, s) == 1 { p = 1 } p { print } p && /^}/ { exit }' "$k"; }
out=$(mktemp -d)
{
    echo "#include \"$(realpath "$here")/shim.h\""
    sed -n "1,$((helpers - 1))p" "$k" | sed '/asm(/d'
    echo 'typedef unsigned char u8;'
    echo '#define QMAX_T 8'
    echo '#define QK_K 256'
    fn 'template <int Q4> __device__ __forceinline__ float qval'
    fn '__device__ __forceinline__ void q4k_scale_min'
    fn 'template <int Q6> __device__ __forceinline__ float kval'
    fn '__device__ __forceinline__ int q3k_scale'
    fn 'template <int Q3> __device__ __forceinline__ float k23val'
    # From the formats' helpers to the end of the grouped section.
    sed -n '/^\/\/ Weight formats of the routed-expert kernels/,/^\/\/ One-token decode GEMV/p' "$k" |
        sed '/^\/\/ One-token decode GEMV/d' | sed 's/extern "C"//'
    cat "$here/main.cpp"
} > "$out/emu.cpp"
g++ -std=c++20 -O1 -w -DACT_BF16=1 -DKV_KIND=1 -DHEAD_DIM=128 "$out/emu.cpp" -o "$out/emu" -pthread
"$out/emu"
