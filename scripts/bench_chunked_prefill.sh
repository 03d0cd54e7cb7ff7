#!/usr/bin/env bash
# Streams beside long prompts: `moelane bench serve` tok/s and inter-token latency of USERS
# streaming users alone, then with one client sending a LONG-token prompt (max_tokens 1)
# back to back (1,200 words: ~3,400 of mini's tokens), under each --max-step-tokens of STEPS (0: no bound, a prompt is one step),
# alternated ROUNDS times in one run. Also prints the long prompts' answer times (p50, max).
# ARGS: more serve flags (--primary-device cuda:0, say). MODEL is a checkpoint directory (default: `moelane gen --preset mini` into /tmp/mini).
set -euo pipefail
BIN=${BIN:-./target/release/moelane}
MODEL=${MODEL:-/tmp/mini}
ROUNDS=${ROUNDS:-2}
USERS=${USERS:-4}
STEPS=${STEPS:-"0 512"}
ARGS=${ARGS:-}
LONG=${LONG:-1200}
[ -d "$MODEL" ] || "$BIN" gen --preset mini --seed 1 --out "$MODEL" > /dev/null
body=$(mktemp)
words=$(for i in $(seq "$LONG"); do printf 'w%d ' $((i % 97)); done)
printf '{"model":"m","prompt":"%s","max_tokens":1,"temperature":0}' "$words" > "$body"
for round in $(seq "$ROUNDS"); do
  for st in $STEPS; do
    log=$(mktemp)
    "$BIN" serve --model "$MODEL" --listen 127.0.0.1:0 --served-model-name m \
      --max-step-tokens "$st" $ARGS > "$log" 2>&1 &
    pid=$!
    for _ in $(seq 600); do grep -q "gateway listening on" "$log" && break; sleep 0.2; done
    url=$(grep -o "http://[0-9.:]*/v1" "$log" | head -1)
    for mode in alone beside; do
      loop=
      times=$(mktemp)
      if [ "$mode" = beside ]; then
        ( while true; do
            curl -s -o /dev/null -w '%{http_code} %{time_total}\n' -H 'Content-Type: application/json' \
              --data-binary @"$body" "$url/completions" >> "$times" || true
          done ) &
        loop=$!
        sleep 1
      fi
      echo "== round $round max-step-tokens $st $mode"
      "$BIN" bench serve --url "$url" --users "$USERS" --max-tokens "${MAXTOK:-32}" --requests 1 --duration 10 2>&1 \
        | grep -vE "^\s*$|^(moelane|wrote|measured)" || true
      if [ -n "$loop" ]; then
        kill "$loop" 2>/dev/null; wait "$loop" 2>/dev/null || true
        awk '$1 != 200 {bad++} $1 == 200 {print $2}' "$times" | sort -n \
          | awk -v bad="$(awk '$1 != 200' "$times" | wc -l)" '{v[NR]=$1} END {printf "long prompts: %d answered, p50 %.2f s, max %.2f s; %d failed\n", NR, v[int((NR+1)/2)], v[NR], bad}'
      fi
      rm -f "$times"
    done
    kill "$pid"; wait "$pid" 2>/dev/null || true
    rm -f "$log"
  done
done
rm -f "$body"
