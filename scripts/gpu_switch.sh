#!/usr/bin/env bash
# One device call for a step switch: the GPU tests (SKIP_TESTS=1: none; else gpu_dense, or
# the gpu_tests function's three with ALL_TESTS=1), then `bench decode` on station, one GPU,
# for each of VARIANTS alternated, ROUNDS rounds. A variant is NAME or NAME:VAR=V,VAR2=V2
# (environment for that run; VAR `kernels` names a folder .gpu/k_DIR of kernel sources,
# through MOELANE_KERNELS_DIR). Results under $OUT/switch.txt and one JSON a run.
#   VARIANTS="chain persist:MOELANE_CUDA_PERSIST=1 old:kernels=old" BATCH=1,4 bash scripts/gpu_switch.sh
source "$(dirname "$0")/gpu_env.sh"
if [ -z "${SKIP_TESTS:-}" ]; then
  if [ -n "${ALL_TESTS:-}" ]; then
    gpu_tests
  else
    echo "== gpu_dense"; timeout ${TEST_S:-300} ./.gpu/gpu_dense ${FILTER:-} --nocapture --test-threads 1 2>&1 | tee "$OUT/gpu_dense.log" | grep -E "SKIP|cosine|identical|taken|test result|panicked"
  fi
fi
for r in $(seq 1 "${ROUNDS:-2}"); do
  for v in ${VARIANTS:-on}; do
    name=${v%%:*}; envs=(); [ "$v" != "$name" ] && IFS=, read -ra envs <<< "${v#*:}"
    set --
    for e in "${envs[@]}"; do
      case "$e" in
        kernels=*) set -- "$@" "MOELANE_KERNELS_DIR=$(pwd)/.gpu/k_${e#kernels=}" ;;
        *) set -- "$@" "$e" ;;
      esac
    done
    echo "== station ${WEIGHTS:-bf16}, context ${CONTEXT:-0}, $name ($*), round $r" | tee -a "$OUT/switch.txt"
    env "$@" MOELANE_CUDA_WEIGHTS=${WEIGHTS:-bf16} timeout ${BENCH_S:-150} ./.gpu/moelane bench decode --model station --placements one-gpu --batch ${BATCH:-1,4,16,64} --steps 16 --reps 3 --context ${CONTEXT:-0} --json "$OUT/switch-$name-$r.json" 2>&1 | grep -E "one-gpu|measured|rror|ended|panick" | tee -a "$OUT/switch.txt"
  done
done
