#!/usr/bin/env bash
# Runs one fuzz target's built binary for SECONDS on its committed corpus (new inputs go to work/TARGET).
# Usage: fuzz/run.sh TARGET SECONDS [LIBFUZZER FLAGS, e.g. -dict=json.dict]   (build first: cargo +nightly fuzz build -s none [--features experiment])
set -euo pipefail
cd "$(dirname "$0")"
t=$1
bin=${BIN_DIR:-target/x86_64-unknown-linux-gnu/release}/$t
mkdir -p "work/$t" "artifacts/$t" logs
exec "$bin" "work/$t" "corpus/$t" -artifact_prefix="artifacts/$t/" -max_total_time="$2" \
  -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 "${@:3}" >"logs/$t.log" 2>&1
