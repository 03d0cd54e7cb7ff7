#!/usr/bin/env bash
# One device call for the model families: the reference logits of each family's random
# checkpoint from transformers (scripts/hf_family_golden.py; the checkpoints are made here by
# `MOELANE_FAMILY_CKPTS=.gpu/fam cargo test -p moelane-engine --test families -- write_checkpoints`
# and carried in .gpu/fam), then the GPU tests and the station benchmark of the new binaries
# (scripts/gpu_compare.sh with ORDER=new unless told otherwise). Results under $OUT.
source "$(dirname "$0")/gpu_env.sh"
echo "== transformers golden"
timeout 300 python3 scripts/hf_family_golden.py .gpu/fam/mixtral .gpu/fam/qwen3_moe .gpu/fam/qwen2_moe .gpu/fam/glm4_moe "$OUT/golden" 2>&1 | tail -5
ls -la "$OUT/golden" 2>&1 | head
ORDER=${ORDER:-new} bash "$(dirname "$0")/gpu_compare.sh"
