#!/usr/bin/env bash
# One device call: the GPU engine's tests, then station decode on one GPU with the GEMVs' L2
# prefetch (MOELANE_CUDA_PREFETCH) off and on, side by side, a per-kernel profile, and an
# Nsight Compute pass over one decode step's kernels (each kernel alone: its duration and DRAM
# bytes). Binaries from scripts/gpu_build.sh, carried in .gpu/.
source "$(dirname "$0")/gpu_env.sh"
echo "== gpu_dense"; timeout 150 ./.gpu/gpu_dense --nocapture --test-threads 1 2>&1 | tee "$OUT/gpu_dense.log" | grep -E "SKIP|cosine|identical|test result|panicked"
echo "== gpu_lane"; timeout 150 ./.gpu/gpu_lane --nocapture --test-threads 1 2>&1 | tee "$OUT/gpu_lane.log" | grep -E "SKIP|identical|test result|panicked"
for pf in 0 1; do
  echo "== station one-gpu: L2 prefetch $pf"
  MOELANE_CUDA_PREFETCH=$pf timeout 120 ./.gpu/moelane bench decode --model station --placements one-gpu --batch ${BATCH:-1,4,16,64} --steps 16 --reps 3 --json "$OUT/station-p$pf.json" 2>&1 | grep -E "one-gpu   |measured" | tee -a "$OUT/station.txt"
done
echo "== profile (launched one by one)"
timeout 120 ./.gpu/moelane bench decode --model station --placements one-gpu --batch 1 --steps 8 --reps 1 --profile 2>&1 | grep -E "profile" | tee "$OUT/profile.txt"
if command -v ncu >/dev/null 2>&1; then
  echo "== ncu: one decode step's kernels, batch 1"
  MOELANE_CUDA_GRAPHS=0 timeout 200 ncu -k regex:"norm_gemv|moe_|attention_decode|gemv_rows|route" --launch-skip 420 --launch-count 7 --csv --page raw \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size \
    ./.gpu/moelane bench decode --model station --placements one-gpu --batch 1 --steps 4 --reps 1 > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
  python3 - "$OUT/ncu.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if r]
hdr = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
if hdr is None:
    print("no ncu rows"); sys.exit()
h, u = rows[hdr], rows[hdr + 1]
col = lambda n: h.index(n)
names = ["gpu__time_duration.sum", "dram__bytes_read.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed", "launch__grid_size"]
print("units:", [u[col(n)] for n in names])
for r in rows[hdr + 2:]:
    try:
        print(f"{r[col('Kernel Name')][:22]:22} " + "  ".join(f"{r[col(n)]:>10}" for n in names))
    except Exception as e:
        print("row?", e, r[:6])
PY
fi
