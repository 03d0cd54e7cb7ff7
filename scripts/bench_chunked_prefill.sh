#!/usr/bin/env bash
# Streams beside long prompts: `moelane bench serve` tok/s and inter-token latency of USERS
# streaming users (from 127.0.0.1) alone, then with a client sending a prompt of LONG words
# (1,200: ~3,400 of mini's tokens; max_tokens 1) back to back from each address of FROMS
# (127.0.0.1: the users' own client; 127.0.0.2: another client, so the lane shares the
# steps' time between them), under each --max-step-tokens of STEPS (0: no bound, a prompt is
# one step), alternated ROUNDS times in one run; prints the long prompts' answer times too.
# ARGS: more serve flags (--primary-device cuda:0, say). MODEL: a checkpoint directory
# (default: `moelane gen --preset mini` into /tmp/mini).
set -euo pipefail
BIN=${BIN:-./target/release/moelane}
MODEL=${MODEL:-/tmp/mini}
ROUNDS=${ROUNDS:-2}
USERS=${USERS:-4}
STEPS=${STEPS:-"0 512"}
ARGS=${ARGS:-}
LONG=${LONG:-1200}
FROMS=${FROMS:-"127.0.0.2"}
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
    for mode in alone $(for f in $FROMS; do echo "beside:$f"; done); do
      loop=
      times=$(mktemp)
      if [ "$mode" != alone ]; then
        ( while true; do
            curl -s --interface "${mode#beside:}" -o /dev/null -w '%{http_code} %{time_total}\n' -H 'Content-Type: application/json' \
              --data-binary @"$body" "$url/completions" >> "$times" || true
          done ) &
        loop=$!
        sleep 1
      fi
      echo "== round $round max-step-tokens $st $mode"
      "$BIN" bench serve --url "$url" --users "$USERS" --max-tokens "${MAXTOK:-32}" --requests 1 --duration 10 2>&1 \
        | grep -vE "^\s*$|^(moelane|wrote|measured)" || true
      if [ -n "$loop" ]; then
        kill -STOP "$loop" 2>/dev/null; pkill -P "$loop" curl 2>/dev/null || true
        kill "$loop" 2>/dev/null; kill -CONT "$loop" 2>/dev/null || true
        wait "$loop" 2>/dev/null || true
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
