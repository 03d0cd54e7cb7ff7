#!/usr/bin/env bash
# The test command: installs what the tests need (nothing beyond cargo for the engine;
# the Python openai client for the gateway tests; promtool for the metrics page), then runs
# the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v python3 >/dev/null 2>&1; then
  if ! python3 -c "import openai" >/dev/null 2>&1; then
    python3 -m pip install --quiet --disable-pip-version-check openai >/dev/null 2>&1 \
      || echo "note: could not install the Python openai client; client tests will skip"
  fi
fi
# Prometheus's promtool validates the /metrics page (the test skips, saying so, without it)
if ! command -v promtool >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; fi
  { $SUDO apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1 \
    || { $SUDO apt-get update >/dev/null 2>&1 \
         && $SUDO apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1; }; } \
    || echo "note: could not install prometheus (promtool); the metrics page check will skip"
fi
cargo test --workspace --profile test "$@"
