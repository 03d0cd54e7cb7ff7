# Sourced by the device-call scripts (gpu_*.sh): results under $OUT, the GPU's name into
# $OUT/gpu.txt, and the release binary put where the test binaries look for it (they call
# the moelane binary by the path it was built at; scripts/gpu_build.sh recorded it).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
export MOELANE_CACHE=/tmp/moelane-cache NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
BIN=$(cat .gpu/bin_path)
mkdir -p "$(dirname "$BIN")" && cp .gpu/moelane "$BIN" && chmod +x "$BIN"
# The GPU engine's and lane's tests (.gpu/ binaries from scripts/gpu_build.sh), logs in $OUT.
gpu_tests() {
  echo "== gpu_dense"; timeout 300 ./.gpu/gpu_dense --nocapture --test-threads 1 2>&1 | tee "$OUT/gpu_dense.log" | grep -E "SKIP|cosine|identical|test result|panicked"
  echo "== gpu_parity"; timeout 120 ./.gpu/gpu_parity --nocapture --test-threads 1 2>&1 | tee "$OUT/gpu_parity.log" | grep -E "SKIP|cosine|test result|panicked"
  echo "== gpu_lane"; timeout 200 ./.gpu/gpu_lane --nocapture --test-threads 1 2>&1 | tee "$OUT/gpu_lane.log" | grep -E "SKIP|identical|test result|panicked"
}
