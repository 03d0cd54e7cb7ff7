#!/usr/bin/env bash
# One device call: GPU parity tests and GPU benchmarks, from binaries built on the development
# machine (see scripts/gpu_build.sh) and carried in .gpu/. Results and logs go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
# the test binaries call the moelane binary by the path it was built at (the release build
# of the same source and features stands in for it)
BIN=$(cat .gpu/bin_path)
mkdir -p "$(dirname "$BIN")" && cp .gpu/moelane "$BIN" && chmod +x "$BIN"
export MOELANE_CACHE=/tmp/moelane-cache
echo "== gpu_parity"; ./.gpu/gpu_parity --nocapture --test-threads 1 2>&1 | tee "$OUT/gpu_parity.log" | grep -E "SKIP|device|worst|test result|panicked"
echo "== gpu_lane"; ./.gpu/gpu_lane --nocapture --test-threads 1 2>&1 | tee "$OUT/gpu_lane.log" | grep -E "SKIP|identical|test result|panicked"
echo "== bench experts (mini)"
./.gpu/moelane gen --preset mini --seed 1 --out /tmp/mini >/dev/null 2>&1
./.gpu/moelane bench experts --model /tmp/mini --device cuda:0 --reps 200 2>&1 | tee "$OUT/bench_experts.txt"
echo "== lane: sidecar on cpu vs cuda:0 (mini, embedded lane)"
for dev in cpu cuda:0; do
  ./.gpu/moelane serve --model /tmp/mini --listen 127.0.0.1:18$([ $dev = cpu ] && echo 1 || echo 2)00 --sidecar-device $dev > "$OUT/serve-${dev/:/}.log" 2>&1 &
  pid=$!
  for i in $(seq 1 100); do grep -q "gateway listening" "$OUT/serve-${dev/:/}.log" && break; sleep 0.2; done
  url=http://127.0.0.1:18$([ $dev = cpu ] && echo 1 || echo 2)00/v1
  echo "-- sidecar $dev"
  ./.gpu/moelane bench serve --url $url --users 1,4 --requests 3 --max-tokens 128 --lane-stats 2>&1 | tee "$OUT/bench-serve-${dev/:/}.txt" | tail -4
  kill $pid; wait $pid 2>/dev/null
done
