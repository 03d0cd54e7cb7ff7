#!/usr/bin/env bash
# One device call for the ipc link (one GPU): the ipc test of the GPU lane's tests, then
# `bench decode` on station with every expert on the GPU against the cold experts in a
# sidecar process on the same GPU through the device mailbox, side by side at batch
# 1/4/16/64. On one GPU the two processes' kernels run at once only under MPS (a daemon;
# the card's settings are left alone): each MODES entry ("off", "on") runs the test and
# the benchmark with the daemon stopped (the GPU time-slices the two processes) or
# started, then stopped again. WEIGHTS sets MOELANE_CUDA_WEIGHTS; PDLS="0 1" and ROUNDS=N
# alternate the link's launches without and with programmatic dependent launch. Results
# under $OUT.
source "$(dirname "$0")/gpu_env.sh"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mps_stop() { echo quit | nvidia-cuda-mps-control 2>/dev/null; sleep 1; }
trap mps_stop EXIT
for mode in ${MODES:-off on}; do
  if [ "$mode" = on ]; then
    if ! command -v nvidia-cuda-mps-control >/dev/null; then echo "no MPS here"; continue; fi
    mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
    nvidia-cuda-mps-control -d || { echo "MPS did not start"; continue; }
  fi
  echo "== MPS $mode" | tee -a "$OUT/ipc.txt"
  if [ -z "${SKIP_TESTS:-}" ]; then
    # time-sliced, the engine-level test only (the lane's 50 answers would take minutes)
    filter=ipc; [ "$mode" = off ] && filter=ipc_link
    echo "== gpu_lane $filter (MPS $mode)"; timeout 240 ./.gpu/gpu_lane $filter --nocapture --test-threads 1 2>&1 | tee "$OUT/gpu_ipc_$mode.log" | grep -E "SKIP|identical|sidecar:|test result|panicked"
  fi
  batch=${BATCH:-1,4,16,64}; [ "$mode" = off ] && batch=${BATCH_OFF:-1,16}
  # PDLS: the link's launches as programmatic dependents (1) or not (0), alternated
  for r in $(seq 1 "${ROUNDS:-1}"); do for pdl in ${PDLS:-1}; do
    echo "== station ${WEIGHTS:-stored}: one-gpu and gpu+ipc:0 (MPS $mode, MOELANE_IPC_PDL=$pdl, round $r)" | tee -a "$OUT/ipc.txt"
    MOELANE_IPC_PDL=$pdl MOELANE_CUDA_WEIGHTS=${WEIGHTS:-stored} timeout ${BENCH_S:-200} ./.gpu/moelane bench decode --model station --placements one-gpu,gpu+ipc:0 --batch $batch --steps 16 --reps 3 --json "$OUT/ipc-$mode-$pdl-$r.json" 2>&1 | grep -E "one-gpu|gpu\+ipc|measured|rror|ended" | tee -a "$OUT/ipc.txt"
  done; done
  [ "$mode" = on ] && mps_stop
done
