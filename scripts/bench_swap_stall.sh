#!/usr/bin/env bash
# Serving never stops for a swap: the longest step (scheduler loop iteration, swap commands
# included) under the same load without swaps and with a swap of one hot/cold pair every
# ~50 ms. Usage: scripts/bench_swap_stall.sh [MODEL_DIR] [MAX_TOKENS] [REQUESTS]
set -euo pipefail
cd "$(dirname "$0")/.."
B=./target/release/moelane
MODEL=${1:-$HOME/.cache/moelane/mini-s1}
TOKENS=${2:-400}
REQS=${3:-3}
run() { # $1 = with swaps (0/1)
  local log; log=$(mktemp)
  $B serve --model "$MODEL" --listen 127.0.0.1:0 >"$log" 2>&1 & local pid=$!
  for _ in $(seq 300); do grep -q "gateway listening" "$log" && break; sleep 0.1; done
  local gw p
  gw=$(grep -m1 "gateway listening on " "$log" | sed 's/.*listening on //')
  p=$(grep -m1 "primary grpc://" "$log" | sed 's/.*grpc:\/\///; s/,.*//')
  local swp=""
  if [ "$1" = 1 ]; then
    python3 - "$B" "http://$p" "$MODEL/rowmap.json" <<'PY' & swp=$!
import json, random, subprocess, sys, time
b, p, mp = sys.argv[1:4]
m = json.load(open(mp)); random.seed(7); n = 0
while True:
    l = random.randrange(len(m["layers"])); L = m["layers"][l]
    h, c = random.choice(L["hot"]), random.choice(L["cold"])
    r = subprocess.run([b, "swap", "--primary", p, "--move", f"{l}:{h}:cold", "--move", f"{l}:{c}:hot"], capture_output=True, text=True)
    if r.returncode != 0: print(r.stderr, file=sys.stderr); break
    L["hot"].remove(h); L["cold"].remove(c); L["hot"].append(c); L["cold"].append(h); n += 1
    print(f"swaps {n}", flush=True); time.sleep(0.05)
PY
  fi
  $B bench serve --url "$gw" --users 1 --max-tokens "$TOKENS" --requests "$REQS" | tail -1
  [ -n "$swp" ] && kill $swp 2>/dev/null || true
  $B status --primary "http://$p" | grep -E "map epoch|longest step"
  kill $pid
}
echo "== without swaps"; run 0
echo "== with a swap every ~50 ms"; run 1 2>&1 | grep -v "^swaps" 
