#!/usr/bin/env bash
# The test command: installs what the tests need (nothing beyond cargo for the engine;
# the Python openai client for the gateway tests, into a virtual environment it makes;
# promtool for the metrics page), then runs the whole suite. A client that cannot be
# installed fails the run: the tests it serves must run, not skip.
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "scripts/test.sh: $*" >&2; exit 1; }

SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; fi
# apt-get install, refreshing the package lists once if the first attempt fails
apt_install() {
  command -v apt-get >/dev/null 2>&1 || return 1
  $SUDO apt-get install -y --no-install-recommends "$@" >/dev/null 2>&1 \
    || { $SUDO apt-get update >/dev/null 2>&1 \
         && $SUDO apt-get install -y --no-install-recommends "$@" >/dev/null 2>&1; }
}

# The Python openai client, in a virtual environment under target/ (ignored, kept between
# runs): Debian's system Python refuses a plain `pip install` (PEP 668).
command -v python3 >/dev/null 2>&1 || fail "python3 is needed (for the openai client tests)"
VENV=target/pyenv
if [ ! -x "$VENV/bin/python" ]; then
  rm -rf "$VENV"
  if ! python3 -m venv "$VENV" >/dev/null 2>&1; then
    rm -rf "$VENV"
    # Debian and Ubuntu ship venv (and ensurepip) in a separate package
    apt_install python3-venv || fail "python3 -m venv failed and python3-venv could not be installed"
    python3 -m venv "$VENV" || fail "python3 -m venv $VENV failed"
  fi
fi
if ! "$VENV/bin/python" -c "import openai" >/dev/null 2>&1; then
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check openai \
    || fail "could not install the Python openai client into $VENV"
  "$VENV/bin/python" -c "import openai" || fail "the openai client in $VENV does not import"
fi
# the Python anthropic client drives the Messages API (/v1/messages)
if ! "$VENV/bin/python" -c "import anthropic" >/dev/null 2>&1; then
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check anthropic \
    || fail "could not install the Python anthropic client into $VENV"
fi
# kubernetes-validate (with the Kubernetes schemas it ships) checks deploy/kubernetes offline
if ! "$VENV/bin/python" -c "import kubernetes_validate" >/dev/null 2>&1; then
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check kubernetes-validate \
    || fail "could not install kubernetes-validate into $VENV"
fi
MOELANE_PYTHON="$(pwd)/$VENV/bin/python"
export MOELANE_PYTHON

# Prometheus's promtool validates the /metrics page
if ! command -v promtool >/dev/null 2>&1; then
  apt_install prometheus || fail "could not install prometheus (promtool) through apt-get"
  command -v promtool >/dev/null 2>&1 || fail "prometheus is installed but promtool is not on PATH"
fi
MOELANE_PROMTOOL="$(command -v promtool)"
export MOELANE_PROMTOOL

# Docker Engine and Compose: the container test runs lanes across hosts (containers). Not
# installable from here (a daemon): the run fails without it unless MOELANE_SKIP_DOCKER=1
# says to skip that test (it then prints SKIPPED).
if [ "${MOELANE_SKIP_DOCKER:-0}" != 1 ]; then
  docker info >/dev/null 2>&1 \
    || fail "the container test needs a running Docker daemon (docker info failed); MOELANE_SKIP_DOCKER=1 skips it"
  docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null 2>&1 \
    || fail "the container test needs Docker Compose (docker compose or docker-compose)"
fi

cargo test --workspace --profile test "$@"

# The CPU engine on aarch64 (the GB300's host is ARM): its NEON kernels, the parity against
# transformers and across maps, cross-built and run under qemu-user (installed when missing).
if ! command -v qemu-aarch64 >/dev/null 2>&1 || ! command -v aarch64-linux-gnu-gcc >/dev/null 2>&1; then
  apt_install qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross \
    || fail "could not install qemu-user and the aarch64 cross compiler through apt-get"
fi
command -v rustup >/dev/null 2>&1 || fail "rustup is needed to add the aarch64-unknown-linux-gnu target"
rustup target list --installed | grep -qx aarch64-unknown-linux-gnu \
  || rustup target add aarch64-unknown-linux-gnu \
  || fail "could not add the aarch64-unknown-linux-gnu target (rustup target add)"
CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu" \
  cargo test --profile test --target aarch64-unknown-linux-gnu -p moelane-engine \
  --lib --test map_parity --test hf_parity --test families

# a short run of every fuzz target (a crash fails the test command)
scripts/fuzz.sh 10
