#!/usr/bin/env bash
# One device call: the GPU engine's tests and `moelane bench decode` (mini with the Hugging Face
# reference in the same run, then station), from binaries built by scripts/gpu_build.sh and
# carried in .gpu/. Results and logs go to $OUT. Usage: bash scripts/gpu_decode.sh [PLACEMENTS]
# (PLACEMENTS for station, default one-gpu,gpu+cpu; add gpu+cuda:1 on a two-GPU machine).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
PL=${1:-one-gpu,gpu+cpu}
export MOELANE_CACHE=/tmp/moelane-cache
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
nproc | sed 's/^/cpus: /' | tee -a "$OUT/gpu.txt"
BIN=$(cat .gpu/bin_path)   # the test binaries start moelane from the path it was built at
mkdir -p "$(dirname "$BIN")" && cp .gpu/moelane "$BIN" && chmod +x "$BIN"
echo "== gpu_dense"; timeout 120 ./.gpu/gpu_dense --nocapture --test-threads 1 2>&1 | tee "$OUT/gpu_dense.log" | grep -E "SKIP|cosine|identical|test result|panicked"
echo "== gpu_parity"; timeout 60 ./.gpu/gpu_parity --nocapture --test-threads 1 2>&1 | grep -E "SKIP|worst|test result|panicked" | tee "$OUT/gpu_parity.log"
echo "== gpu_lane"; timeout 150 ./.gpu/gpu_lane --nocapture --test-threads 1 2>&1 | grep -E "SKIP|identical|test result|panicked" | tee "$OUT/gpu_lane.log"
./.gpu/moelane gen --preset mini --seed 1 --out /tmp/mini >/dev/null 2>&1
echo "== bench decode mini (one-gpu = all hot; gpu+cpu = the fitted map, cold on the CPU)"
timeout 150 ./.gpu/moelane bench decode --model /tmp/mini --placements one-gpu,gpu+cpu --batch 1,4,16,64 --steps 32 --reps 3 --compare-launches --json "$OUT/decode-mini.json" 2>&1 | tee "$OUT/decode-mini.txt"
echo "== Hugging Face transformers, same checkpoint, same GPU"
PYTHONUNBUFFERED=1 timeout 120 python3 scripts/hf_decode_bench.py /tmp/mini --batch 1,4,16,64 --steps 32 --json "$OUT/hf-mini.json" 2>&1 | grep -v Warning | tee "$OUT/hf-mini.txt"
echo "== bench decode station ($PL)"
timeout 240 ./.gpu/moelane bench decode --model station --placements "$PL" --batch 1,4,16,64 --steps 16 --reps 3 --compare-launches --json "$OUT/decode-station.json" 2>&1 | tee "$OUT/decode-station.txt"
