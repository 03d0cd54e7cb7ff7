#!/usr/bin/env bash
# One device call for the next-layer guesses (MOELANE_CUDA_GUESS, see docs/ARCHITECTURE.md):
# gpu_dense's next_layer_guesses_change_no_result (SKIP_TESTS=1 skips it; FULL_TESTS=1 runs
# every GPU test instead), then `bench decode` on station in bf16 at batch 1 and 4 (4 does not
# guess: the call's control), without and with guesses alternated, ROUNDS times; with
# guesses the bench prints how many of the picks the guesses named. Results under $OUT.
source "$(dirname "$0")/gpu_env.sh"
if [ -n "${FULL_TESTS:-}" ]; then
  gpu_tests
elif [ -z "${SKIP_TESTS:-}" ]; then
  echo "== gpu_dense next_layer_guesses"
  timeout 300 ./.gpu/gpu_dense --nocapture --test-threads 1 next_layer_guesses 2>&1 | tee "$OUT/gpu_dense_guess.log" | grep -E "SKIP|named|test result|panicked"
fi
for r in $(seq 1 "${ROUNDS:-1}"); do
  for g in 0 1; do
    echo "== station one-gpu ${WEIGHTS:-bf16}: MOELANE_CUDA_GUESS=$g (round $r)"
    MOELANE_CUDA_GUESS=$g MOELANE_CUDA_WEIGHTS=${WEIGHTS:-bf16} timeout 240 ./.gpu/moelane bench decode --model station --placements one-gpu --batch ${BATCH:-1,4} --steps 16 --reps ${REPS:-3} 2>&1 | grep -E "one-gpu|measured|guesses|rror" | tee -a "$OUT/station-guess$g.txt"
  done
done
