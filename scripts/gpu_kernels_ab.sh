#!/usr/bin/env bash
# One device call comparing two sets of kernel sources with one binary (.gpu/moelane from
# scripts/gpu_build.sh): `MOELANE_KERNELS_DIR` points the binary at .gpu/kernels-base (a
# copy of another commit's kernels/, e.g. `mkdir -p .gpu/kernels-base && git archive BASE
# kernels | tar -x --strip-components=1 -C .gpu/kernels-base`) and at kernels/ (this
# tree's), alternated ROUNDS times in the order ORDER (default "new base"), station on one
# GPU at batch BATCH (default 1,4,16,64) in WEIGHTS (default bf16). With PROFILE=1, then the
# new kernels' per-kernel profile at batch 1 (kernels launched one by one, GPU-timed); with
# HOLLOW set, a `--hollow` run of the new kernels at batch 1 (see scripts/gpu_chain.sh).
# With TESTS=1 first the GPU engine's tests on the new kernels. Results under $OUT.
source "$(dirname "$0")/gpu_env.sh"
export MOELANE_CUDA_WEIGHTS=${WEIGHTS:-bf16}
if [ -n "${TESTS:-}" ]; then
  export MOELANE_KERNELS_DIR=$PWD/kernels
  gpu_tests
  unset MOELANE_KERNELS_DIR
fi
for r in $(seq 1 "${ROUNDS:-1}"); do
  for which in ${ORDER:-new base}; do
    dir=$PWD/kernels; [ "$which" = base ] && dir=$PWD/.gpu/kernels-base
    echo "== station one-gpu $MOELANE_CUDA_WEIGHTS: kernels $which (round $r)"
    MOELANE_KERNELS_DIR=$dir timeout 240 ./.gpu/moelane bench decode --model station --placements one-gpu --batch ${BATCH:-1,4,16,64} --steps 16 --reps 3 --json "$OUT/station-$which-$r.json" 2>&1 | grep -E "one-gpu|measured|rror" | tee -a "$OUT/station-$which.txt"
  done
done
if [ -n "${PROFILE:-}" ]; then
  echo "== station one-gpu batch 1: profile (new kernels)"
  MOELANE_KERNELS_DIR=$PWD/kernels timeout 240 ./.gpu/moelane bench decode --model station --placements one-gpu --batch 1 --steps 16 --reps 3 --profile 2>&1 | grep -E "one-gpu|measured|profile|rror" | tee -a "$OUT/profile.txt"
fi
if [ -n "${HOLLOW:-}" ]; then
  echo "== station one-gpu batch 1: hollow kernels (new kernels)"
  MOELANE_KERNELS_DIR=$PWD/kernels timeout 300 ./.gpu/moelane bench decode --model station --placements one-gpu --batch 1 --steps 16 --reps 3 --hollow "$HOLLOW" 2>&1 | grep -E "one-gpu|measured|rror" | tee -a "$OUT/hollow.txt"
fi
