#!/usr/bin/env bash
# One device call for batch-1 decode's chain of kernels: the GPU engine's tests, station
# decode on one GPU with weight rows preloaded before each kernel's wait, side by side with
# the preload off (rows "-p"), then at batch 1 hollow runs (rows "-h ...": kernels launched
# with their grid and no work): every kernel hollow ("all": the chain's floor), each kernel
# hollow ("K": what it adds to the full chain), and every kernel but one ("all+!K": what K
# costs alone in the chain). Binaries from
# scripts/gpu_build.sh in .gpu/.
source "$(dirname "$0")/gpu_env.sh"
if [ -z "${SKIP_TESTS:-}" ]; then
  gpu_tests
fi
echo "== station one-gpu: preload"
timeout 240 ./.gpu/moelane bench decode --model station --placements one-gpu --batch ${BATCH:-1,4,16,64} --steps 16 --reps 3 --compare-preload --json "$OUT/station-chain.json" 2>&1 | grep -E "one-gpu|measured|rror" | tee -a "$OUT/station.txt"
H=all
for k in norm_gemv_rows:qkv attention_decode gemv_rows:o norm_gemv_rows:router route_topk moe_up moe_down moe_combine; do H="$H,$k,all+!$k"; done
echo "== station one-gpu batch 1: hollow kernels"
timeout 200 ./.gpu/moelane bench decode --model station --placements one-gpu --batch 1 --steps 16 --reps 3 --hollow ${HOLLOW:-$H} --json "$OUT/station-hollow.json" 2>&1 | grep -E "one-gpu|measured|rror" | tee -a "$OUT/station.txt"
