#!/usr/bin/env bash
# The test command: installs what the tests need (nothing beyond cargo for the engine;
# the Python openai client for the gateway tests), then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v python3 >/dev/null 2>&1; then
  if ! python3 -c "import openai" >/dev/null 2>&1; then
    python3 -m pip install --quiet --disable-pip-version-check openai >/dev/null 2>&1 \
      || echo "note: could not install the Python openai client; client tests will skip"
  fi
fi
cargo test --workspace --profile test "$@"
