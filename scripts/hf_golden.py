#!/usr/bin/env python3
"""Reference logits from Hugging Face transformers for the `tiny` synthetic checkpoint.

Usage (torch + transformers installed; the CI never runs this):
    cargo run --release -p moelane -- gen --preset tiny --seed 1 --out /tmp/tiny
    python3 scripts/hf_golden.py /tmp/tiny crates/engine/tests/golden

Writes hf_tiny.json (prompt ids, generated ids, shapes, checkpoint sha256) and
hf_tiny.f16 (little-endian float16 logits: for each prompt, every prefill position,
then every decode step). The Rust test crates/engine/tests/hf_parity.rs compares.
"""
import hashlib, json, sys, os
import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM
from tokenizers import Tokenizer

ckpt, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager")
model.eval()
tok = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
prompts = [
    "The agent called the tool search_files with the query",
    "Am frühen Morgen lag dichter Nebel über dem Fluss",
    "朝早く、川の上には濃い霧が立ちこめていて",
    "이른 아침 강 위에는 짙은 안개가 끼어 있었고",
    "fn main() { let args: Vec<String> = std::env::args().collect();",
]
DECODE = 8
blobs, meta = [], []
with torch.no_grad():
    for p in prompts:
        ids = tok.encode(p, add_special_tokens=False).ids
        x = torch.tensor([ids])
        o = model(input_ids=x, use_cache=True)
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
        arr = np.concatenate(logits, axis=0).astype("<f2")
        blobs.append(arr)
        meta.append({"prompt": p, "ids": ids, "generated": gen, "rows": int(arr.shape[0])})
sha = hashlib.sha256(open(os.path.join(ckpt, "model.safetensors"), "rb").read()).hexdigest()
vocab = int(blobs[0].shape[1])
np.concatenate(blobs, axis=0).tofile(os.path.join(out, "hf_tiny.f16"))
json.dump({"transformers": transformers.__version__, "torch": torch.__version__,
           "checkpoint_sha256": sha, "vocab": vocab, "decode": DECODE, "prompts": meta},
          open(os.path.join(out, "hf_tiny.json"), "w"), indent=1, ensure_ascii=False)
# what this transformers writes for qwen3_moe experts (fused or per-expert)
model.save_pretrained("/tmp/hf_saved_tiny")
from safetensors import safe_open
with safe_open("/tmp/hf_saved_tiny/model.safetensors", "pt") as f:
    keys = [k for k in f.keys() if "layers.0.mlp" in k]
print("saved expert keys (layer 0):", keys[:6], "...", len(keys))
print("wrote", out, "rows", sum(m["rows"] for m in meta), "vocab", vocab)
