#!/usr/bin/env bash
# One device call for the weights' dtype on the GPU: the GPU engine's tests on the new
# binaries (.gpu/, scripts/gpu_build.sh; SKIP_TESTS=1 skips them), then `bench decode` with
# the weights as the checkpoint stores them (bf16) and widened to f32
# (MOELANE_CUDA_WEIGHTS=f32), side by side in one binary, ROUNDS times: on the mini
# checkpoint (bf16 on disk) and on station (generated in f32; MOELANE_CUDA_WEIGHTS=bf16
# rounds it to bf16 at upload). Results under $OUT.
source "$(dirname "$0")/gpu_env.sh"
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== gpu_dense"; timeout 300 ./.gpu/gpu_dense --nocapture --test-threads 1 2>&1 | tee "$OUT/gpu_dense.log" | grep -E "SKIP|cosine|identical|bytes of weights|test result|panicked"
  echo "== gpu_parity"; timeout 120 ./.gpu/gpu_parity --nocapture --test-threads 1 2>&1 | tee "$OUT/gpu_parity.log" | grep -E "SKIP|cosine|test result|panicked"
  echo "== gpu_lane"; timeout 200 ./.gpu/gpu_lane --nocapture --test-threads 1 2>&1 | tee "$OUT/gpu_lane.log" | grep -E "SKIP|identical|test result|panicked"
fi
./.gpu/moelane gen --preset mini --seed 1 --out /tmp/mini >/dev/null 2>&1
for r in $(seq 1 "${ROUNDS:-1}"); do
  for w in stored f32; do
    echo "== mini one-gpu: weights $w (round $r)"
    MOELANE_CUDA_WEIGHTS=$w timeout 200 ./.gpu/moelane bench decode --model /tmp/mini --placements one-gpu --batch ${BATCH:-1,4,16,64} --steps 32 --reps 3 2>&1 | grep -E "one-gpu|measured|rror" | tee -a "$OUT/mini-$w.txt"
  done
  for w in bf16 f32; do
    echo "== station one-gpu: weights $w (round $r)"
    MOELANE_CUDA_WEIGHTS=$w timeout 240 ./.gpu/moelane bench decode --model station --placements one-gpu --batch ${BATCH:-1,4,16,64} --steps 16 --reps 3 2>&1 | grep -E "one-gpu|measured|rror" | tee -a "$OUT/station-$w.txt"
  done
done
