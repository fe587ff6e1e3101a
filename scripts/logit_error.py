#!/usr/bin/env python3
"""Logit error of the engine's weight formats against a float32 forward pass.

    python3 scripts/logit_error.py CHECKPOINT DUMP [DUMP...]

Each DUMP is what ``cargo run --release --example dump_logits -- CHECKPOINT
DUMP --weights FORMAT`` wrote (f32 logits per position, and DUMP.ids.json).
The reference is Hugging Face transformers' Qwen3 in float32 (TF32 off) over
the checkpoint's own weights, on CUDA when there is a GPU, one forward pass
over the same ids. Prints one JSON line per dump: per-position relative rms
error ``||engine - ref|| / ||ref||`` (mean, p99, max), top-1 agreement and
the mean KL divergence of the engine's distribution from the reference's.
"""

import json
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def reference_logits(checkpoint, ids, device):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    except TypeError:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32)
    model = model.to(device).eval()
    with torch.no_grad():
        return model(torch.tensor([ids], device=device)).logits[0].float()


def main():
    checkpoint, dumps = sys.argv[1], sys.argv[2:]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    refs = {}
    for dump in dumps:
        meta = json.load(open(dump + ".ids.json"))
        ids, vocab = meta["ids"], meta["vocab_size"]
        key = tuple(ids)
        if key not in refs:
            refs[key] = reference_logits(checkpoint, ids, device)
        ref = refs[key]
        eng = torch.from_numpy(np.fromfile(dump, dtype="<f4").reshape(len(ids), vocab)).to(device)
        rel = ((eng - ref).norm(dim=1) / ref.norm(dim=1)).double().cpu().numpy()
        top1 = (eng.argmax(dim=1) == ref.argmax(dim=1)).double().mean().item()
        log_p, log_q = torch.log_softmax(ref.double(), 1), torch.log_softmax(eng.double(), 1)
        kl = (log_p.exp() * (log_p - log_q)).sum(1).mean().item()
        print(json.dumps({
            "bench": "logit_error", "weights": meta.get("weights"), "positions": len(ids),
            "rms_rel_mean": float(rel.mean()), "rms_rel_p99": float(np.percentile(rel, 99)),
            "rms_rel_max": float(rel.max()), "top1_agreement": top1, "kl_mean": kl,
        }), flush=True)


if __name__ == "__main__":
    main()
