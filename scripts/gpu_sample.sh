#!/usr/bin/env bash
# One device call for sampling on the GPU: the GPU tests on the new binaries (.gpu/,
# scripts/gpu_build.sh; SKIP_TESTS=1 skips them; gpu_dense's gpu_sampling_follows_the_host_rule
# checks top-k and top-p draws against the host's rule), then `bench decode` on station in
# bf16, greedy (the argmax) against every token drawn on the GPU (`--sample T,P,K`) without
# and with a top-k, alternated, ROUNDS times. Results under $OUT.
source "$(dirname "$0")/gpu_env.sh"
[ -n "${SKIP_TESTS:-}" ] || gpu_tests
for r in $(seq 1 "${ROUNDS:-1}"); do
  for s in greedy 0.7,0.95,0 0.7,0.95,20; do
    flag=$([ "$s" = greedy ] || echo "--sample $s")
    echo "== station one-gpu bf16: $s (round $r)"
    MOELANE_CUDA_WEIGHTS=bf16 timeout 240 ./.gpu/moelane bench decode --model station --placements one-gpu --batch ${BATCH:-1,16,64} --steps 16 --reps 3 $flag 2>&1 | grep -E "one-gpu|measured|rror" | tee -a "$OUT/station-${s//,/_}.txt"
  done
done
