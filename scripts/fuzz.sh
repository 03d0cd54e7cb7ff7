#!/usr/bin/env bash
# Runs every fuzz target (fuzz/fuzz_targets: the lane's frame decoder, rowmaps, config.json,
# safetensors checkpoints, the gateway's request validation, the tokenizer and detokeniser)
# for SECONDS each (default 10: the test command's short run; a
# longer one: scripts/fuzz.sh 3600). cargo-fuzz is installed when missing; its nightly flags
# run on the stable toolchain through RUSTC_BOOTSTRAP=1. A crash fails the run and leaves its
# input in fuzz/artifacts/TARGET/ (turn it into a test, then fix it). Prints executions per
# target.
set -euo pipefail
secs="${1:-10}"
cd "$(dirname "$0")/../fuzz"
command -v cargo-fuzz >/dev/null 2>&1 || cargo install --locked cargo-fuzz
export RUSTC_BOOTSTRAP=1
cargo fuzz build
for t in $(cargo fuzz list); do
  log="$(mktemp)"
  if ! cargo fuzz run "$t" -- -max_total_time="$secs" -rss_limit_mb=2048 -timeout=10 >"$log" 2>&1; then
    tail -40 "$log"
    echo "fuzz: $t found a crash (fuzz/artifacts/$t/)" >&2
    rm -f "$log"
    exit 1
  fi
  echo "fuzz: $t: $(grep -o 'Done [0-9]* runs in [0-9]* second(s)' "$log" | tail -1), no crash"
  rm -f "$log"
done
