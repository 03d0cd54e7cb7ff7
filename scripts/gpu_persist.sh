#!/usr/bin/env bash
# One device call for the persistent one-row step (kernels/step_one.cu): its bitwise test
# against the chain and the rest of gpu_dense (SKIP_TESTS=1: none; PARITY=1 adds
# gpu_parity), then `bench decode` on station, one GPU, MOELANE_CUDA_PERSIST=1 (the
# persistent kernel at batch 1) and 0 (the chain) alternated, ROUNDS rounds, for each of
# WEIGHTS (MOELANE_CUDA_WEIGHTS: bf16, stored = f32) and CONTEXTS (bench decode's
# --context). Results under $OUT.
source "$(dirname "$0")/gpu_env.sh"
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== gpu_dense"; timeout ${TEST_S:-300} ./.gpu/gpu_dense ${FILTER:-} --nocapture --test-threads 1 2>&1 | tee "$OUT/gpu_dense.log" | grep -E "SKIP|cosine|identical|persistent|test result|panicked"
  if [ -n "${PARITY:-}" ]; then
    echo "== gpu_parity"; timeout 120 ./.gpu/gpu_parity --nocapture --test-threads 1 2>&1 | tee "$OUT/gpu_parity.log" | grep -E "SKIP|cosine|test result|panicked"
  fi
fi
for r in $(seq 1 "${ROUNDS:-1}"); do
  for w in ${WEIGHTS:-bf16}; do
    for c in ${CONTEXTS:-0}; do
      for p in ${PERSISTS:-1 0}; do
        # VARIANTS: kernel folders .gpu/k_NAME (MOELANE_KERNELS_DIR) the persistent step also
        # runs with ("-": the embedded kernels)
        for v in $([ "$p" = 1 ] && echo "${VARIANTS:--}" || echo -); do
          kd=""; [ "$v" != - ] && kd="$(pwd)/.gpu/k_$v"
          echo "== station $w, context $c, MOELANE_CUDA_PERSIST=$p, kernels ${v}, round $r" | tee -a "$OUT/persist.txt"
          env ${kd:+MOELANE_KERNELS_DIR=$kd} MOELANE_CUDA_PERSIST=$p MOELANE_CUDA_WEIGHTS=$w timeout ${BENCH_S:-150} ./.gpu/moelane bench decode --model station --placements one-gpu --batch ${BATCH:-1,4,16,64} --steps 16 --reps 3 --context $c --json "$OUT/persist-$w-$c-$p-$v-$r.json" 2>&1 | grep -E "one-gpu|measured|rror|ended|panick|persist" | tee -a "$OUT/persist.txt"
        done
      done
    done
  done
done
