#!/usr/bin/env bash
# CPU emulation of the grouped routed-expert kernels (kernels.cu: moe_gate_up_grouped, moe_down_grouped), for
# machines without nvcc or a GPU: g++ compiles kernels.cu's helpers and the grouped section against shim.h,
# which runs a warp as 32 threads meeting at every shuffle; main.cpp launches both kernels over 3 bf16
# experts of hidden 512 / ffn 264 (row tails), 3 tokens, and checks the SwiGLU rows and the residual's change
# against a double-precision reference. It checks indexing and arithmetic, not NVRTC compilation or speed.
# Usage: scripts/grouped-experts-emu/run.sh (from the repository root; about 2 minutes on 2 cores).
set -euo pipefail
here=$(dirname "$0")
k=crates/exec/src/cuda/kernels.cu
grouped=$(grep -n '^// Grouped routed experts' "$k" | cut -d: -f1)
helpers=$(grep -n '^// h\[t, :\] = table' "$k" | head -1 | cut -d: -f1)
out=$(mktemp -d)
{
    echo "#include \"$(realpath "$here")/shim.h\""
    sed -n "1,$((helpers - 1))p" "$k" | sed '/asm(/d'
    echo '#define QMAX_T 8'
    sed -n "$((grouped - 1)),\$p" "$k" | sed 's/extern "C"//'
    cat "$here/main.cpp"
} > "$out/emu.cpp"
g++ -std=c++20 -O1 -w -DACT_BF16=1 -DKV_KIND=1 -DHEAD_DIM=128 "$out/emu.cpp" -o "$out/emu" -pthread
"$out/emu"
