#!/usr/bin/env bash
# Builds, on a machine without a GPU, the release binaries the GPU machine runs: the CLI and the exec GPU test
# binary and exec's unit tests, xz-compressed into .bin/ (git-ignored; name it in the device tool's `carry`). Then, on the GPU machine:
#   bash scripts/gpu-check.sh          (tests + transformers comparison + exec runs, logs under $OUT)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .bin
# Where cargo builds (a worktree may share another checkout's, CARGO_TARGET_DIR).
target=${CARGO_TARGET_DIR:-target}
# Cargo re-copies a fresh build's binary only where it is missing: with a target shared by two checkouts the
# other's could stay in its place (session 20).
rm -f "$target"/release/pipeshard "$target"/release/examples/ring_wait "$target"/release/examples/launch_pace \
  "$target"/release/examples/cpu_experts_beside_launches
cargo build --release -p pipeshard-cli
cp "$target"/release/pipeshard .bin/pipeshard
exe=$(cargo test --release -p pipeshard-exec --test gpu --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys; print([j["executable"] for j in map(json.loads, sys.stdin) if j.get("reason")=="compiler-artifact" and j.get("executable") and j["target"]["name"]=="gpu"][-1])')
cp "$exe" .bin/exec-gpu-tests
# exec's unit tests: on the GPU machine they check the AVX-512 kernels the development machines may lack.
unit=$(cargo test --release -p pipeshard-exec --lib --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys; print([j["executable"] for j in map(json.loads, sys.stdin) if j.get("reason")=="compiler-artifact" and j.get("executable") and j["target"]["kind"]==["lib"]][-1])')
cp "$unit" .bin/exec-unit-tests
# The CPU expert block's bench (crates/exec/benches/experts.rs), for gpu-check.sh's "experts" part.
bench=$(cargo bench -p pipeshard-exec --bench experts --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys; print([j["executable"] for j in map(json.loads, sys.stdin) if j.get("reason")=="compiler-artifact" and j.get("executable") and j["target"]["name"]=="experts"][-1])')
cp "$bench" .bin/exec-experts-bench
# The ring-wait experiment (crates/exec/examples/ring_wait.rs), for gpu-check.sh's "ringwait" part.
cargo build --release -p pipeshard-exec --example ring_wait
cp "$target"/release/examples/ring_wait .bin/exec-ring-wait
# The launch-pace experiment (crates/profiler/examples/launch_pace.rs), for gpu-check.sh's "launchpace" part.
cargo build --release -p pipeshard-profiler --example launch_pace
cp "$target"/release/examples/launch_pace .bin/launch-pace
# The CPU experts beside launches experiment, for gpu-check.sh's "besidelaunch" part.
cargo build --release -p pipeshard-profiler --example cpu_experts_beside_launches
cp "$target"/release/examples/cpu_experts_beside_launches .bin/cpu-experts-beside-launches
bins=(.bin/pipeshard .bin/exec-gpu-tests .bin/exec-unit-tests .bin/exec-experts-bench .bin/exec-ring-wait .bin/launch-pace
  .bin/cpu-experts-beside-launches)
strip "${bins[@]}"
# Compressed (~6 MB instead of ~20): the device tool carries at most 64 MiB with the tracked tree.
xz -T0 -f "${bins[@]}"
# The binaries' commit, `-dirty` when built with uncommitted changes (outside results/ and profiles/, as
# `pipeshard`'s own provenance counts them).
dirty=$(git status --porcelain -- . ':!results' ':!profiles' | grep -q . && echo -dirty || true)
echo "$(git rev-parse --short=12 HEAD)$dirty" > .bin/commit
ls -la .bin
