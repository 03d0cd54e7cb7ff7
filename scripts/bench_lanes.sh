#!/usr/bin/env bash
# Serving benchmark of one checkpoint on every link kind, side by side in one run:
# the embedded lane (in-process sidecar), a two-process lane over shared memory and one
# over TCP (sidecar process + primary process + gateway process each).
# Usage: scripts/bench_lanes.sh [MODEL_DIR] [USERS] [MAX_TOKENS] [REQUESTS]
set -euo pipefail
cd "$(dirname "$0")/.."
B=./target/release/moelane
MODEL=${1:-$HOME/.cache/moelane/mini-s1}
USERS=${2:-1,4}
TOKENS=${3:-400}
REQS=${4:-3}
[ -x "$B" ] || cargo build --release -p moelane
[ -d "$MODEL" ] || $B gen --preset mini --seed 1 --out "$MODEL"
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; }
trap cleanup EXIT
wait_line() { # file pattern -> rest of line
  for _ in $(seq 600); do
    if grep -q "$2" "$1" 2>/dev/null; then grep -m1 "$2" "$1" | sed "s/.*$2//"; return; fi
    sleep 0.1
  done
  echo "timeout waiting for $2 in $1" >&2; exit 1
}
T=$(mktemp -d)
$B serve --model "$MODEL" --listen 127.0.0.1:0 >"$T/serve" 2>&1 & pids+=($!)
$B lane --role sidecar --model "$MODEL" --listen 127.0.0.1:0 >"$T/side" 2>&1 & pids+=($!)
CTRL=$(wait_line "$T/side" "sidecar control ")
for link in shm tcp; do
  $B lane --role primary --model "$MODEL" --listen 127.0.0.1:0 --sidecar "$CTRL" --link $link >"$T/p_$link" 2>&1 & pids+=($!)
  P=$(wait_line "$T/p_$link" "primary grpc " | cut -d, -f1)
  $B lane --role gateway --model "$MODEL" --listen 127.0.0.1:0 --lane "$P" >"$T/g_$link" 2>&1 & pids+=($!)
done
E=$(wait_line "$T/serve" "gateway listening on ")
S=$(wait_line "$T/g_shm" "gateway listening on ")
C=$(wait_line "$T/g_tcp" "gateway listening on ")
echo "== machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
$B bench link --iters 20000
for pair in "embedded $E" "shm $S" "tcp $C"; do
  set -- $pair
  echo "== $1 lane ($2)"
  $B bench serve --url "$2" --users "$USERS" --max-tokens "$TOKENS" --requests "$REQS"
done
