#!/usr/bin/env bash
# One device call for split decode attention: the GPU engine's tests, then station decode on
# one GPU at several context lengths with decode attention split into position ranges and,
# side by side in the same process, unsplit (--compare-split, rows "-1"). Binaries from
# scripts/gpu_build.sh in .gpu/.
source "$(dirname "$0")/gpu_env.sh"
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== gpu_dense"; timeout 200 ./.gpu/gpu_dense --nocapture --test-threads 1 2>&1 | tee "$OUT/gpu_dense.log" | grep -E "SKIP|cosine|identical|test result|panicked"
  echo "== gpu_parity"; timeout 200 ./.gpu/gpu_parity --nocapture --test-threads 1 2>&1 | tee "$OUT/gpu_parity.log" | grep -E "SKIP|cosine|test result|panicked"
fi
for ctx in ${CONTEXTS:-0 1024 3072}; do
  echo "== station one-gpu, context $ctx"
  timeout 200 ./.gpu/moelane bench decode --model station --placements one-gpu --batch ${BATCH:-1,4,16} --steps 16 --reps 3 --context $ctx --compare-split --json "$OUT/station-ctx$ctx.json" 2>&1 | grep -E "one-gpu|measured|rror" | tee -a "$OUT/station.txt"
done
