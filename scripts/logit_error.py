#!/usr/bin/env python3
"""Logit error of the engine's weight and KV-cache formats against a float32
forward pass, or against another dump.

    python3 scripts/logit_error.py CHECKPOINT DUMP [DUMP...]
    python3 scripts/logit_error.py --against REFERENCE_DUMP DUMP [DUMP...]

Each DUMP is what ``cargo run --release --example dump_logits -- CHECKPOINT
DUMP --weights FORMAT`` wrote (f32 logits per position, and DUMP.ids.json).
The reference is Hugging Face transformers' Qwen3 in float32 (TF32 off) over
the checkpoint's own weights, on CUDA when there is a GPU, one forward pass
over the same ids. Prints one JSON line per dump: per-position relative rms
error ``||engine - ref|| / ||ref||`` (mean, p99, max), top-1 agreement and
the mean KL divergence of the engine's distribution from the reference's.
With ``--against`` the reference is another dump over the same ids (e.g. the
f16 KV cache's, against the int8 cache's); only numpy is needed then. A dump
taken after a ``--context`` prompt holds the positions after it.
"""

import json
import sys

import numpy as np


def reference_logits(checkpoint, ids, device):
    import torch
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    except TypeError:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32)
    model = model.to(device).eval()
    with torch.no_grad():
        return model(torch.tensor([ids], device=device)).logits[0].float()


def load_dump(dump):
    meta = json.load(open(dump + ".ids.json"))
    rows = len(meta["ids"]) - meta.get("context", 0)
    return meta, np.fromfile(dump, dtype="<f4").reshape(rows, meta["vocab_size"]).astype(np.float64)


def report(meta, eng, ref, against=None):
    rel = np.linalg.norm(eng - ref, axis=1) / np.linalg.norm(ref, axis=1)
    top1 = float((eng.argmax(1) == ref.argmax(1)).mean())

    def log_softmax(x):
        x = x - x.max(1, keepdims=True)
        return x - np.log(np.exp(x).sum(1, keepdims=True))

    log_p, log_q = log_softmax(ref), log_softmax(eng)
    kl = float((np.exp(log_p) * (log_p - log_q)).sum(1).mean())
    line = {
        "bench": "logit_error", "weights": meta.get("weights"), "kv_cache": meta.get("kv_cache", "f16"),
        "context": meta.get("context", 0), "positions": len(eng),
        "rms_rel_mean": float(rel.mean()), "rms_rel_p99": float(np.percentile(rel, 99)),
        "rms_rel_max": float(rel.max()), "top1_agreement": top1, "kl_mean": kl,
    }
    if against:
        line["against"] = against
    print(json.dumps(line), flush=True)


def main():
    if sys.argv[1] == "--against":
        ref_meta, ref = load_dump(sys.argv[2])
        for dump in sys.argv[3:]:
            meta, eng = load_dump(dump)
            assert meta["ids"] == ref_meta["ids"], f"{dump}: other ids than {sys.argv[2]}"
            report(meta, eng, ref, against=sys.argv[2])
        return
    checkpoint, dumps = sys.argv[1], sys.argv[2:]
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    refs = {}
    for dump in dumps:
        meta, eng = load_dump(dump)
        key = tuple(meta["ids"])
        if key not in refs:
            refs[key] = reference_logits(checkpoint, meta["ids"], device)[meta.get("context", 0):]
        report(meta, eng, refs[key].double().cpu().numpy())


if __name__ == "__main__":
    main()
