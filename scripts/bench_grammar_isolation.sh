#!/usr/bin/env bash
# Free-text streams beside a request whose grammar's masks are costly (a schema pattern of
# ^a{100000}$): `moelane bench serve` tok/s and inter-token latency of the free users alone,
# then with one client sending the costly request back to back, alternated ROUNDS times.
# BINS="new:PATH base:PATH" compares binaries (each serves its own process); MODEL is a
# checkpoint directory (default: `moelane gen --preset mini` into /tmp/mini).
set -euo pipefail
BINS=${BINS:-"new:./target/release/moelane"}
MODEL=${MODEL:-/tmp/mini}
ROUNDS=${ROUNDS:-2}
USERS=${USERS:-1,4}
first_bin=${BINS%% *}; first_bin=${first_bin#*:}
[ -d "$MODEL" ] || "$first_bin" gen --preset mini --seed 1 --out "$MODEL" > /dev/null
costly='{"model":"m","prompt":"Say a","max_tokens":32,"temperature":0,
 "response_format":{"type":"json_schema","json_schema":{"name":"a","schema":{"type":"string","pattern":"^a{100000}$"}}}}'
for round in $(seq "$ROUNDS"); do
  for spec in $BINS; do
    name=${spec%%:*}; bin=${spec#*:}
    log=$(mktemp)
    "$bin" serve --model "$MODEL" --listen 127.0.0.1:0 --served-model-name m > "$log" 2>&1 &
    pid=$!
    for _ in $(seq 600); do grep -q "gateway listening on" "$log" && break; sleep 0.2; done
    url=$(grep -o "http://[0-9.:]*/v1" "$log" | head -1)
    for mode in alone beside; do
      loop=
      if [ "$mode" = beside ]; then
        ( while true; do curl -s -o /dev/null -H 'Content-Type: application/json' -d "$costly" "$url/completions" || true; done ) &
        loop=$!
        sleep 1
      fi
      echo "== round $round $name $mode"
      "$bin" bench serve --url "$url" --users "$USERS" --max-tokens 128 --requests 4 --duration 5 2>&1 | grep -vE "^\s*$|^(moelane|wrote|measured)" || true
      [ -n "$loop" ] && { kill "$loop" 2>/dev/null; wait "$loop" 2>/dev/null || true; }
    done
    kill "$pid"; wait "$pid" 2>/dev/null || true
    rm -f "$log"
  done
done
