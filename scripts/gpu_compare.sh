#!/usr/bin/env bash
# One device call for a change to the GPU step: the GPU engine's tests on the new binaries
# (.gpu/, scripts/gpu_build.sh), then `bench decode` on station at batch 1/4/16/64 with the
# new binary and a reference binary (.gpu-base/moelane, built the same way from another
# commit) side by side, in the order ORDER (default "new base"), ROUNDS times. Set
# SKIP_TESTS=1 to run only the benchmark. In ORDER, "fuse" is the new binary with
# MOELANE_CUDA_FUSE=1 (its fused small-batch kernels on). WEIGHTS sets
# MOELANE_CUDA_WEIGHTS (e.g. bf16). With PROFILE=1, then the new binary's per-kernel
# profile at batch 1 (with FUSE=1, its fused kernels on). Results under $OUT.
source "$(dirname "$0")/gpu_env.sh"
# the reference binary travels compressed (the carried paths share 64 MiB)
if [ -e .gpu-base/moelane.xz ] && [ ! -e .gpu-base/moelane ]; then xz -dk .gpu-base/moelane.xz; fi
if [ -z "${SKIP_TESTS:-}" ]; then
  gpu_tests
fi
for r in $(seq 1 "${ROUNDS:-1}"); do
  for which in ${ORDER:-new base}; do
    bin=./.gpu/moelane; [ "$which" = base ] && bin=./.gpu-base/moelane
    fuse=0; [ "$which" = fuse ] && fuse=1
    echo "== station one-gpu ${WEIGHTS:-stored}: $which (round $r)"
    MOELANE_CUDA_FUSE=$fuse MOELANE_CUDA_WEIGHTS=${WEIGHTS:-stored} timeout 200 "$bin" bench decode --model station --placements one-gpu --batch ${BATCH:-1,4,16,64} --steps 16 --reps 3 --json "$OUT/station-$which-$r.json" 2>&1 | grep -E "one-gpu|measured|rror" | tee -a "$OUT/station-$which.txt"
  done
done
if [ -n "${PROFILE:-}" ]; then
  echo "== station one-gpu batch 1: profile (new)"
  MOELANE_CUDA_FUSE=${FUSE:-0} MOELANE_CUDA_WEIGHTS=${WEIGHTS:-stored} timeout 200 ./.gpu/moelane bench decode --model station --placements one-gpu --batch 1 --steps 16 --reps 3 --profile 2>&1 | grep -E "one-gpu|measured|profile|rror" | tee -a "$OUT/profile.txt"
fi
