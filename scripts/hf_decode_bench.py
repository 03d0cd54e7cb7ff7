#!/usr/bin/env python3
"""Hugging Face transformers decode speed on a moelane checkpoint, the reference point of
`moelane bench decode` (run on the GPU machine, same GPU, same checkpoint; the CI never runs it).

Usage: python3 scripts/hf_decode_bench.py CHECKPOINT_DIR [--batch 1,4,16,64] [--steps 32]
Prints one line per batch size: decode tokens/s (generate of steps+1 tokens minus generate of
1 token, so the prefill is not counted), greedy, f32, the model's default attention.
Prompts: the first 16 tokens of the language prompts, so no row needs padding.
"""
import argparse, json, os, time
import torch
import transformers
from transformers import AutoModelForCausalLM
from tokenizers import Tokenizer

ap = argparse.ArgumentParser()
ap.add_argument("ckpt")
ap.add_argument("--batch", default="1,4,16,64")
ap.add_argument("--steps", type=int, default=32)
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--json")
a = ap.parse_args()
dev = "cuda"
model = AutoModelForCausalLM.from_pretrained(a.ckpt, dtype=torch.float32).to(dev).eval()
tok = Tokenizer.from_file(os.path.join(a.ckpt, "tokenizer.json"))
texts = [
    "The agent called the tool search_files with the query and then read every file it found",
    "Am frühen Morgen lag dichter Nebel über dem Fluss, und die Boote blieben am Ufer",
    "朝早く、川の上には濃い霧が立ちこめていて、舟は岸につながれたままだった",
    "이른 아침 강 위에는 짙은 안개가 끼어 있었고 배들은 강가에 묶여 있었다",
    "fn main() { let args: Vec<String> = std::env::args().collect(); println!(\"{}\", args.len()); }",
]
ids = [tok.encode(t, add_special_tokens=False).ids[:16] for t in texts]
ids = [x for x in ids if len(x) == 16]
print(f"transformers {transformers.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}, "
      f"attention {model.config._attn_implementation}")
out = []
for b in [int(x) for x in a.batch.split(",")]:
    x = torch.tensor([ids[i % len(ids)] for i in range(b)], device=dev)
    mask = torch.ones_like(x)
    def gen(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, use_cache=True, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    gen(4)  # warm-up
    rates = []
    for _ in range(a.reps):
        t1 = gen(1)
        tn = gen(a.steps + 1)
        rates.append(b * a.steps / max(tn - t1, 1e-9))
    rates.sort()
    r = rates[len(rates) // 2]
    print(f"hf batch {b:>3}: {r:10.1f} tok/s  {1e3 * b / r:8.3f} ms/step")
    out.append({"batch": b, "tokens_per_s": r})
if a.json:
    json.dump({"transformers": transformers.__version__, "results": out}, open(a.json, "w"), indent=1)
