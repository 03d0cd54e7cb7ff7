#!/usr/bin/env python3
"""Reference logits from Hugging Face transformers for the random checkpoints of each family
(crates/engine/src/random_ckpt.rs), the golden files of crates/engine/tests/families.rs.

Usage (torch + transformers installed; the CI never runs this):
    MOELANE_FAMILY_CKPTS=/tmp/fam cargo test -p moelane-engine --test families -- write_checkpoints
    python3 scripts/hf_family_golden.py /tmp/fam/mixtral /tmp/fam/qwen3_moe /tmp/fam/qwen2_moe /tmp/fam/glm4_moe crates/engine/tests/golden

Each checkpoint directory holds prompts.json (token ids). For each, writes hf_<family>.json
(prompt ids, transformers' greedy continuation, checkpoint sha256, versions) and
hf_<family>.f16 (little-endian float16 logits: for each prompt, every prefill position, then
every decode step). It also saves the model again with this transformers (save_pretrained)
under <out>/saved_<family> and checks that copy's logits equal the original's, so the test
can load the layout this version writes.
"""
import hashlib, json, os, sys
import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

DECODE = 6


def run(model, prompts):
    blobs, meta = [], []
    with torch.no_grad():
        for ids in prompts:
            o = model(input_ids=torch.tensor([ids]), use_cache=True)
            logits = [o.logits[0].float().numpy()]
            past = o.past_key_values
            nxt = int(o.logits[0, -1].argmax())
            gen = []
            for _ in range(DECODE):
                gen.append(nxt)
                o = model(input_ids=torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past = o.past_key_values
                logits.append(o.logits[0].float().numpy())
                nxt = int(o.logits[0, -1].argmax())
            arr = np.concatenate(logits, axis=0)
            blobs.append(arr)
            meta.append({"ids": ids, "generated": gen, "rows": int(arr.shape[0])})
    return blobs, meta


out = sys.argv[-1]
os.makedirs(out, exist_ok=True)
for ckpt in sys.argv[1:-1]:
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    family = cfg["model_type"]
    prompts = json.load(open(os.path.join(ckpt, "prompts.json")))
    model, info = AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    # every weight must come from the file: a missing one would be random-initialised
    bad = {k: v for k, v in info.items() if v}
    if bad:
        sys.exit(f"{family}: loading {ckpt}: {bad}")
    model.eval()
    blobs, meta = run(model, prompts)
    saved = os.path.join(out, f"saved_{family}")
    model.save_pretrained(saved)
    again = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32, attn_implementation="eager").eval()
    blobs2, _ = run(again, prompts)
    same = all(np.array_equal(a, b) for a, b in zip(blobs, blobs2))
    sha = hashlib.sha256(open(os.path.join(ckpt, "model.safetensors"), "rb").read()).hexdigest()
    np.concatenate(blobs, axis=0).astype("<f2").tofile(os.path.join(out, f"hf_{family}.f16"))
    json.dump({"transformers": transformers.__version__, "torch": torch.__version__,
               "family": family, "checkpoint_sha256": sha, "vocab": int(blobs[0].shape[1]),
               "decode": DECODE, "saved_copy_identical": bool(same), "prompts": meta},
              open(os.path.join(out, f"hf_{family}.json"), "w"), indent=1)
    print(family, "rows", sum(m["rows"] for m in meta), "saved copy identical:", same)
