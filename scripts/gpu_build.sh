#!/usr/bin/env bash
# Builds what scripts/gpu_run.sh runs on the GPU machine into .gpu/ (git-ignored; name it in
# the device call's carry): the release binary and the GPU test binaries, with --features cuda.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu
cargo build --release -p moelane --features cuda
cp target/release/moelane .gpu/moelane
pick() { # the newest executable test binary of a test target
  ls -t target/debug/deps/"$1"-* | grep -v '\.d$' | head -1
}
cargo test --profile test -p moelane-engine --features cuda --test gpu_parity --no-run
cp "$(pick gpu_parity)" .gpu/gpu_parity
cargo test --profile test -p moelane-engine --features cuda --test gpu_dense --no-run
cp "$(pick gpu_dense)" .gpu/gpu_dense
cargo test --profile test -p moelane --features cuda --test gpu_lane --no-run
cp "$(pick gpu_lane)" .gpu/gpu_lane
echo "$(pwd)/target/debug/moelane" > .gpu/bin_path
# debug info would not fit the device call's 64 MiB
strip --strip-debug .gpu/moelane .gpu/gpu_parity .gpu/gpu_dense .gpu/gpu_lane
ls -la .gpu
