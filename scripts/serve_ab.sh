#!/usr/bin/env bash
# Two builds of moelane serving the same checkpoint, measured alternately in one run: for each
# round, each binary's `serve` is started alone and `moelane bench serve` (of the second
# binary) drives it at USERS users, then it stops. Prints one JSON line per binary and round
# (bench serve's summary) so the two are compared within the run (the machine is noisy).
# Usage: scripts/serve_ab.sh OLD_BINARY NEW_BINARY MODEL_DIR [USERS=1,4,64] [MAX_TOKENS=64]
#        [REQUESTS=4] [ROUNDS=2]
# Environment: SCHEMA=FILE sends every request with that JSON schema (bench serve
# --json-schema); OLD_ENV / NEW_ENV are set for the old / new server (e.g. OLD_ENV=
# "MOELANE_MASK_WORKER=0" with the same binary on both sides); each round also prints the
# server's grammar histograms from its /metrics (when it has any).
set -euo pipefail
OLD=$1 NEW=$2 MODEL=$3
USERS=${4:-1,4,64} TOKENS=${5:-64} REQS=${6:-4} ROUNDS=${7:-2}
T=$(mktemp -d)
pid=
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null || true; rm -rf "$T"; }
trap cleanup EXIT
for r in $(seq "$ROUNDS"); do
  for side in old new; do
    B=$OLD E=${OLD_ENV:-}; [ "$side" = new ] && B=$NEW E=${NEW_ENV:-}
    env $E "$B" serve --model "$MODEL" --listen 127.0.0.1:0 >"$T/serve" 2>&1 & pid=$!
    url=
    for _ in $(seq 600); do
      url=$(grep -m1 -o 'gateway listening on http://[0-9.:]*' "$T/serve" | sed 's/gateway listening on //' || true)
      [ -n "$url" ] && break
      sleep 0.1
    done
    [ -n "$url" ] || { cat "$T/serve"; echo "serve did not start" >&2; exit 1; }
    "$NEW" bench serve --url "$url/v1" --users "$USERS" --max-tokens "$TOKENS" --requests "$REQS" \
      ${SCHEMA:+--json-schema "$SCHEMA"} --json "$T/out.json" >/dev/null
    echo "{\"round\": $r, \"side\": \"$side\", \"runs\": $(cat "$T/out.json")}"
    curl -s "$url/metrics" | grep -E '^moelane_grammar_(step|mask)_seconds' || true
    kill "$pid"; wait "$pid" 2>/dev/null || true; pid=
  done
done
