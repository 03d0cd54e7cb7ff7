#!/usr/bin/env bash
# One device call on a two-GPU machine: the engine and lane tests (the NCCL lane among them), then
# `moelane bench decode` on station with the cold tier on the second GPU in this process
# (gpu+cuda:1) and in a sidecar process over NCCL (gpu+nccl:1), side by side. Binaries from
# scripts/gpu_build.sh, carried in .gpu/. Results and logs go to $OUT.
# Usage: bash scripts/gpu_nccl.sh [PLACEMENTS] [BATCHES]
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
PL=${1:-gpu+cuda:1,gpu+nccl:1}
BATCH=${2:-1,4,16,64}
export MOELANE_CACHE=/tmp/moelane-cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
nvidia-smi topo -m 2>&1 | head -4 | tee -a "$OUT/gpu.txt"
BIN=$(cat .gpu/bin_path)   # the test binaries start moelane from the path it was built at
mkdir -p "$(dirname "$BIN")" && cp .gpu/moelane "$BIN" && chmod +x "$BIN"
echo "== gpu_dense"; timeout 150 ./.gpu/gpu_dense --nocapture --test-threads 1 2>&1 | tee "$OUT/gpu_dense.log" | grep -E "SKIP|cosine|identical|PTX|test result|panicked"
echo "== gpu_lane"; timeout 240 ./.gpu/gpu_lane --nocapture --test-threads 1 2>&1 | tee "$OUT/gpu_lane.log" | grep -E "SKIP|identical|test result|panicked|nccl|NCCL" | head -40
echo "== bench decode station ($PL)"
timeout 300 ./.gpu/moelane bench decode --model station --placements "$PL" --batch "$BATCH" --steps 16 --reps 3 --json "$OUT/decode-nccl.json" 2>&1 | tee "$OUT/decode-nccl.txt"
