#!/usr/bin/env bash
# One device call for a change to the GPU step: the GPU engine's tests on the new binaries
# (.gpu/, scripts/gpu_build.sh), then `bench decode` on station at batch 1/4/16/64 with the
# new binary and a reference binary (.gpu-base/moelane, built the same way from another
# commit) side by side, in the order ORDER (default "new base"), ROUNDS times. Set
# SKIP_TESTS=1 to run only the benchmark. Results under $OUT.
source "$(dirname "$0")/gpu_env.sh"
# the reference binary travels compressed (the carried paths share 64 MiB)
if [ -e .gpu-base/moelane.xz ] && [ ! -e .gpu-base/moelane ]; then xz -dk .gpu-base/moelane.xz; fi
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== gpu_dense"; timeout 240 ./.gpu/gpu_dense --nocapture --test-threads 1 2>&1 | tee "$OUT/gpu_dense.log" | grep -E "SKIP|cosine|identical|test result|panicked"
  echo "== gpu_parity"; timeout 120 ./.gpu/gpu_parity --nocapture --test-threads 1 2>&1 | tee "$OUT/gpu_parity.log" | grep -E "SKIP|cosine|test result|panicked"
  echo "== gpu_lane"; timeout 200 ./.gpu/gpu_lane --nocapture --test-threads 1 2>&1 | tee "$OUT/gpu_lane.log" | grep -E "SKIP|identical|test result|panicked"
fi
for r in $(seq 1 "${ROUNDS:-1}"); do
  for which in ${ORDER:-new base}; do
    bin=./.gpu/moelane; [ "$which" = base ] && bin=./.gpu-base/moelane
    echo "== station one-gpu: $which (round $r)"
    timeout 200 "$bin" bench decode --model station --placements one-gpu --batch ${BATCH:-1,4,16,64} --steps 16 --reps 3 --json "$OUT/station-$which-$r.json" 2>&1 | grep -E "one-gpu|measured|rror" | tee -a "$OUT/station-$which.txt"
  done
done
