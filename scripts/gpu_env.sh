# Sourced by the device-call scripts (gpu_*.sh): results under $OUT, the GPU's name into
# $OUT/gpu.txt, and the release binary put where the test binaries look for it (they call
# the moelane binary by the path it was built at; scripts/gpu_build.sh recorded it).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
export MOELANE_CACHE=/tmp/moelane-cache NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
BIN=$(cat .gpu/bin_path)
mkdir -p "$(dirname "$BIN")" && cp .gpu/moelane "$BIN" && chmod +x "$BIN"
