#!/usr/bin/env python3
"""Reference logits from Hugging Face transformers for the random checkpoints of each family
(crates/engine/src/random_ckpt.rs), the golden files of crates/engine/tests/families.rs.

Usage (torch + transformers installed; the CI never runs this):
    MOELANE_FAMILY_CKPTS=/tmp/fam cargo test -p moelane-engine --test families -- write_checkpoints
    python3 scripts/hf_family_golden.py /tmp/fam/mixtral /tmp/fam/qwen3_moe /tmp/fam/qwen2_moe /tmp/fam/glm4_moe /tmp/fam/deepseek_v3 /tmp/fam/qwen3_moe_fp8 /tmp/fam/deepseek_v3_fp8 /tmp/fam/gpt_oss /tmp/fam/gpt_oss_mxfp4 crates/engine/tests/golden

Each checkpoint directory holds prompts.json (token ids); the files are named after the
directory (`<family>`, or `<family>_fp8` for an FP8 variant, which transformers reads here
dequantised: each weight times its block's weight_scale_inv, as f32). For each, writes hf_<family>.json
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
def dequantised(ckpt, out):
    """An FP8 checkpoint (weight_scale_inv per block) rewritten as f32, for transformers on
    the CPU: each weight times its block's scale."""
    from safetensors.torch import load_file, save_file
    import shutil
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    b0, b1 = cfg["quantization_config"]["weight_block_size"]
    del cfg["quantization_config"]
    t = load_file(os.path.join(ckpt, "model.safetensors"))
    w = {}
    for k, v in t.items():
        if k.endswith("_scale_inv"):
            continue
        s = t.get(k + "_scale_inv")
        if s is not None:
            r, c = v.shape
            full = s.float().repeat_interleave(b0, 0)[:r].repeat_interleave(b1, 1)[:, :c]
            v = v.float() * full
        w[k] = v.float().contiguous()
    os.makedirs(out, exist_ok=True)
    save_file(w, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
    for f in ("generation_config.json",):
        if os.path.exists(os.path.join(ckpt, f)):
            shutil.copy(os.path.join(ckpt, f), out)
    return out


for ckpt in sys.argv[1:-1]:
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    # named by the directory: <family> or <family>_fp8
    family = os.path.basename(os.path.normpath(ckpt))
    prompts = json.load(open(os.path.join(ckpt, "prompts.json")))
    src = ckpt
    if cfg.get("quantization_config", {}).get("quant_method") == "fp8":
        src = dequantised(ckpt, os.path.join(out, f"deq_{family}"))
    extra = {}
    if cfg.get("quantization_config", {}).get("quant_method") == "mxfp4":
        # gpt_oss as released: transformers widens the MXFP4 experts itself
        from transformers import Mxfp4Config
        src = ckpt
        extra["quantization_config"] = Mxfp4Config(dequantize=True)
    model, info = AutoModelForCausalLM.from_pretrained(
        src, dtype=torch.float32, attn_implementation="eager", output_loading_info=True, **extra)
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
