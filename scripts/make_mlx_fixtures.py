#!/usr/bin/env python3
"""Generate end-to-end Qwen3 fixtures with MLX (mlx-lm) reference greedy tokens.

For every case this writes, under ``<out>/<case>/``:

* ``config.json``        -- a Hugging Face style Qwen3 config;
* ``model.safetensors``  -- BF16 weights with Hugging Face tensor names;
* ``expected.json``      -- the greedy tokens mlx-lm's Qwen3 produces (CPU,
  every parameter cast to float32, float32 logits, mlx-lm KV cache), plus
  per-step margins so a consumer knows where near-ties start.

Weights are built so that the engine's int8 conversion (one f32 scale per
group of 64 input elements, scale = absmax / 127, round to nearest, shorter
last group) is LOSSLESS:

* every linear weight, the embedding table and lm_head hold values
  ``q * 2**-k`` with integer ``q`` in [-127, 127] and one ``k`` per row;
* every 32-wide block along the input (last) dimension, including a partial
  last block, holds one value equal to +-127 * 2**-k, so every 64-group, and
  the shorter last group too, has absmax = 127 * 2**-k and so the engine's
  scale absmax / 127 is exactly 2**-k and w / scale is exactly q.

Those values have at most 7 significant bits and so are exact in bf16.

The ``int4_*`` cases are for the engine's 4-bit layers (``--weights int4``:
one bf16 scale per group of 64, the value of largest magnitude / -8, as
llama.cpp's Q4_0): their layers' linear weights hold ``q * 2**-k`` with
``q`` in [-8, 7] and every 32-wide block holding both -8 and 7, so each
group's scale is exactly 2**-k; the embedding (and lm_head) stay
int8-exact as above.
Norm weights are ``1 + 0.2 * normal`` rounded to bf16.

Each case tries a short deterministic sequence of seeds and keeps the first
whose greedy chain has no near-tie (margin < 0.01) and does not collapse; if
none qualifies within the attempt budget it keeps the one whose first
near-tie comes latest.  The seed used is recorded in expected.json.

Besides the int8 round-trip assertion, the script re-runs every chosen case
through an independent float64 numpy implementation of Qwen3 (full-sequence
recompute, no cache) and checks that it agrees with MLX's tokens.

Usage: python3 scripts/make_mlx_fixtures.py --out tests/fixtures/mlx
Pinned dependencies: scripts/requirements-fixtures.txt
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model
from safetensors import TensorSpec, serialize_file

NEAR_TIE = 0.01
GROUP = 64  # engine's int8 group size
FORCE_BLOCK = 32  # one +-127 per 32-wide block
Q_STD = 40.0  # std of the (pre-clip) integer mantissas
# Embedding / lm_head row std = EMBED_LOGIT_STD / sqrt(hidden): logits have
# std ~2.  o_proj / down_proj rows get RESID_GAIN / sqrt(fan_in): the layers'
# residual updates must dwarf the token embedding, otherwise a tied random
# model mostly predicts its own input token and greedy decode collapses into
# one repeated id.  (Only the ratio of the two matters, thanks to RMSNorm.)
EMBED_LOGIT_STD = 2.0
RESID_GAIN = 8.0
MAX_ATTEMPTS = 40
SEED_STRIDE = 7919

BASE = dict(hidden=128, heads=4, kv_heads=2, head_dim=64, inter=256, vocab=1000,
            layers=2, tied=True, stored_head=False)

CASES = [
    dict(BASE, name="gqa2_hd64", seed=1001, prompt_len=7, new=32),
    dict(BASE, name="gqa4_hd128", seed=1002, hidden=256, heads=8, kv_heads=2,
         head_dim=128, inter=384, vocab=1024, prompt_len=5, new=32),
    dict(BASE, name="mqa_hd64", seed=1003, kv_heads=1, vocab=777,
         prompt_len=6, new=32),
    dict(BASE, name="untied_head", seed=1004, inter=192, tied=False,
         prompt_len=6, new=32),
    dict(BASE, name="prompt_1tok", seed=1005, prompt_len=1, new=32),
    dict(BASE, name="prompt_300tok", seed=1006, layers=3, prompt_len=300, new=16),
    dict(BASE, name="odd_dims", seed=1007, hidden=96, heads=3, kv_heads=1,
         head_dim=32, inter=160, vocab=555, prompt_len=9, new=24),
    dict(BASE, name="tied_with_stored_head", seed=1008, stored_head=True,
         prompt_len=4, new=16),
    dict(BASE, name="int4_gqa2_hd64", seed=1101, int4=True, prompt_len=7, new=32),
    dict(BASE, name="int4_gqa4_hd128", seed=1102, int4=True, hidden=256, heads=8,
         kv_heads=2, head_dim=128, inter=384, vocab=1024, prompt_len=5, new=32),
    dict(BASE, name="int4_odd_dims", seed=1107, int4=True, hidden=96, heads=3,
         kv_heads=1, head_dim=32, inter=160, vocab=555, prompt_len=9, new=24),
]
INT4_Q_STD = 3.0  # std of the (pre-clip) int4 mantissas


# ----------------------------------------------------------------------------
# weights
# ----------------------------------------------------------------------------

def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 -> bf16 (round to nearest even), return uint16 bit patterns."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return b.astype(np.uint16)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def quantizable_matrix(rng: np.random.Generator, rows: int, cols: int,
                       target_std: float) -> np.ndarray:
    """[rows, cols] float32 of q * 2**-k, one k per row, one |q|=127 per 32-block."""
    q = np.clip(np.rint(rng.normal(0.0, Q_STD, size=(rows, cols))), -127, 127)
    for start in range(0, cols, FORCE_BLOCK):
        width = min(FORCE_BLOCK, cols - start)
        pos = start + rng.integers(0, width, size=rows)
        sign = np.where(rng.random(rows) < 0.5, -127.0, 127.0)
        q[np.arange(rows), pos] = sign
    row_std = np.sqrt(np.mean(q * q, axis=1))
    k = np.rint(np.log2(row_std / target_std)).astype(np.int64)
    w = np.ldexp(q, -k[:, None]).astype(np.float32)
    assert np.all(np.abs(q) <= 127)
    return w


def int4_matrix(rng: np.random.Generator, rows: int, cols: int,
                target_std: float) -> np.ndarray:
    """[rows, cols] float32 of q * 2**-k, q in [-8, 7], one k per row, every
    32-block holding both -8 and 7."""
    q = np.clip(np.rint(rng.normal(0.0, INT4_Q_STD, size=(rows, cols))), -8, 7)
    for start in range(0, cols, FORCE_BLOCK):
        width = min(FORCE_BLOCK, cols - start)
        assert width >= 2
        lo = start + rng.integers(0, width, size=rows)
        hi = start + (lo - start + 1 + rng.integers(0, width - 1, size=rows)) % width
        q[np.arange(rows), lo] = -8.0
        q[np.arange(rows), hi] = 7.0
    row_std = np.sqrt(np.mean(q * q, axis=1))
    k = np.rint(np.log2(row_std / target_std)).astype(np.int64)
    return np.ldexp(q, -k[:, None]).astype(np.float32)


def norm_weight(rng: np.random.Generator, n: int) -> np.ndarray:
    w = (1.0 + 0.2 * rng.normal(size=n)).astype(np.float32)
    return bf16_bits_to_f32(f32_to_bf16_bits(w))


def build_weights(c: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    H, nh, nkv, hd, I, V = (c["hidden"], c["heads"], c["kv_heads"], c["head_dim"],
                            c["inter"], c["vocab"])
    layer = int4_matrix if c.get("int4") else quantizable_matrix
    lin = lambda rows, cols: layer(rng, rows, cols, cols ** -0.5)
    w: dict[str, np.ndarray] = {}
    w["model.embed_tokens.weight"] = quantizable_matrix(
        rng, V, H, EMBED_LOGIT_STD / np.sqrt(H))
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight(rng, H)
        w[p + "self_attn.q_proj.weight"] = lin(nh * hd, H)
        w[p + "self_attn.k_proj.weight"] = lin(nkv * hd, H)
        w[p + "self_attn.v_proj.weight"] = lin(nkv * hd, H)
        w[p + "self_attn.o_proj.weight"] = layer(
            rng, H, nh * hd, RESID_GAIN * (nh * hd) ** -0.5)
        w[p + "self_attn.q_norm.weight"] = norm_weight(rng, hd)
        w[p + "self_attn.k_norm.weight"] = norm_weight(rng, hd)
        w[p + "post_attention_layernorm.weight"] = norm_weight(rng, H)
        w[p + "mlp.gate_proj.weight"] = lin(I, H)
        w[p + "mlp.up_proj.weight"] = lin(I, H)
        w[p + "mlp.down_proj.weight"] = layer(
            rng, H, I, RESID_GAIN * I ** -0.5)
    w["model.norm.weight"] = norm_weight(rng, H)
    if not c["tied"]:
        w["lm_head.weight"] = quantizable_matrix(rng, V, H, EMBED_LOGIT_STD / np.sqrt(H))
    elif c["stored_head"]:
        w["lm_head.weight"] = w["model.embed_tokens.weight"].copy()
    return w


def is_int8_converted(name: str) -> bool:
    return not name.endswith("norm.weight")


def assert_int8_lossless(name: str, w: np.ndarray) -> None:
    """Emulate the engine: per 64-group scale = absmax/127 (f32), q = round(w/scale)."""
    w = w.astype(np.float32)
    cols = w.shape[-1]
    for start in range(0, cols, GROUP):
        g = w[:, start:start + GROUP]
        absmax = np.max(np.abs(g), axis=1, keepdims=True).astype(np.float32)
        assert np.all(absmax > 0), name
        scale = (absmax / np.float32(127.0)).astype(np.float32)
        q = np.rint(g / scale).astype(np.float32)
        assert np.all(np.abs(q) <= 127), name
        deq = (q * scale).astype(np.float32)
        if not np.array_equal(deq, g):
            raise AssertionError(f"int8 conversion of {name} is lossy at group {start}")


def write_safetensors(path: Path, weights: dict[str, np.ndarray]) -> None:
    keep = []
    specs = {}
    for name in sorted(weights):
        w = weights[name]
        bits = np.ascontiguousarray(f32_to_bf16_bits(w))
        # everything we store must be exactly representable in bf16
        assert np.array_equal(bf16_bits_to_f32(bits), w.astype(np.float32)), name
        keep.append(bits)
        specs[name] = TensorSpec(dtype="bfloat16", shape=list(w.shape),
                                 data_ptr=bits.ctypes.data, data_len=bits.nbytes)
    serialize_file(specs, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o644)  # serialize_file creates the file 0600


def check_safetensors_header(path: Path, weights: dict[str, np.ndarray]) -> None:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    assert set(header) == set(weights), path
    for name, info in header.items():
        assert info["dtype"] == "BF16", (name, info["dtype"])
        assert info["shape"] == list(weights[name].shape), name


# ----------------------------------------------------------------------------
# config
# ----------------------------------------------------------------------------

def make_config(c: dict) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "head_dim": c["head_dim"],
        "hidden_act": "silu",
        "hidden_size": c["hidden"],
        "initializer_range": 0.02,
        "intermediate_size": c["inter"],
        "max_position_embeddings": 4096,
        "max_window_layers": c["layers"],
        "num_attention_heads": c["heads"],
        "num_hidden_layers": c["layers"],
        "num_key_value_heads": c["kv_heads"],
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": c["tied"],
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": c["vocab"],
    }


# ----------------------------------------------------------------------------
# MLX reference
# ----------------------------------------------------------------------------

def mlx_greedy(case_dir: Path, prompt: list[int], steps: int):
    model, _ = load_model(case_dir)  # strict load, mlx-lm's Qwen3 + sanitize
    model.set_dtype(mx.float32)
    model.eval()
    for name, p in _flatten_params(model.parameters()):
        assert p.dtype == mx.float32, (name, p.dtype)
    cache = make_prompt_cache(model)
    step_logits = []
    tokens = []
    logits = model(mx.array([prompt], dtype=mx.int32), cache=cache)[0, -1]
    for s in range(steps):
        assert logits.dtype == mx.float32
        mx.eval(logits)
        l = np.array(logits, dtype=np.float32)
        tok = int(np.argmax(l))
        step_logits.append(l)
        tokens.append(tok)
        if s + 1 < steps:
            logits = model(mx.array([[tok]], dtype=mx.int32), cache=cache)[0, -1]
    return tokens, step_logits


def _flatten_params(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten_params(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _flatten_params(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


def margins_of(step_logits: list[np.ndarray]) -> list[float]:
    out = []
    for l in step_logits:
        l64 = l.astype(np.float64)
        top2 = np.sort(l64)[-2:]
        rms = np.sqrt(np.mean(l64 * l64))
        out.append(float((top2[1] - top2[0]) / rms))
    return out


def collapsed(tokens: list[int]) -> bool:
    """True if the chain settles into (nearly) one repeated id early or late."""
    return len(set(tokens[:8])) < 4 or len(set(tokens[len(tokens) // 2:])) < 4


# ----------------------------------------------------------------------------
# independent float64 numpy reference (full recompute, no cache)
# ----------------------------------------------------------------------------

def np_rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def np_rope(x, positions, theta):
    # x: [heads, T, d]; non-"traditional" (rotate-half, NeoX) layout
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = positions[:, None].astype(np.float64) * inv[None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def np_forward_last(c: dict, cfg: dict, w: dict[str, np.ndarray], ids: list[int]):
    W = {k: v.astype(np.float64) for k, v in w.items()}
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    nh, nkv, hd = c["heads"], c["kv_heads"], c["head_dim"]
    T = len(ids)
    pos = np.arange(T)
    x = W["model.embed_tokens.weight"][ids]
    mask = np.triu(np.full((T, T), -np.inf), k=1)
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        h = np_rmsnorm(x, W[p + "input_layernorm.weight"], eps)
        q = (h @ W[p + "self_attn.q_proj.weight"].T).reshape(T, nh, hd).transpose(1, 0, 2)
        k = (h @ W[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, hd).transpose(1, 0, 2)
        v = (h @ W[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, hd).transpose(1, 0, 2)
        q = np_rope(np_rmsnorm(q, W[p + "self_attn.q_norm.weight"], eps), pos, theta)
        k = np_rope(np_rmsnorm(k, W[p + "self_attn.k_norm.weight"], eps), pos, theta)
        rep = nh // nkv
        k = np.repeat(k, rep, axis=0)
        v = np.repeat(v, rep, axis=0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)
        o = (s @ v).transpose(1, 0, 2).reshape(T, nh * hd)
        x = x + o @ W[p + "self_attn.o_proj.weight"].T
        h = np_rmsnorm(x, W[p + "post_attention_layernorm.weight"], eps)
        g = h @ W[p + "mlp.gate_proj.weight"].T
        u = h @ W[p + "mlp.up_proj.weight"].T
        x = x + (g / (1.0 + np.exp(-g)) * u) @ W[p + "mlp.down_proj.weight"].T
    h = np_rmsnorm(x[-1], W["model.norm.weight"], eps)
    head = W["model.embed_tokens.weight"] if c["tied"] else W["lm_head.weight"]
    return head @ h


def np_check(c, cfg, w, prompt, tokens, step_logits, margins):
    """Teacher-forced on MLX's chain; returns max |logit diff| / rms."""
    worst = 0.0
    ids = list(prompt)
    for s, tok in enumerate(tokens):
        ref = np_forward_last(c, cfg, w, ids)
        rms = np.sqrt(np.mean(ref * ref))
        diff = np.max(np.abs(ref - step_logits[s].astype(np.float64))) / rms
        worst = max(worst, float(diff))
        if margins[s] >= NEAR_TIE and int(np.argmax(ref)) != tok:
            raise AssertionError(f"{c['name']}: numpy f64 disagrees with MLX at step {s}")
        ids.append(tok)
    if worst > 1e-3:
        raise AssertionError(f"{c['name']}: numpy f64 vs MLX logits differ by {worst:.3g} rms")
    return worst


def is_layer_linear(name: str) -> bool:
    return name.startswith("model.layers.") and not name.endswith("norm.weight")


def assert_int4_lossless(name: str, w: np.ndarray) -> None:
    """Emulate the engine's int4 conversion: per 64-group scale = the value of
    largest magnitude / -8 rounded to bf16, q = round(w / scale) within [-8, 7]."""
    w = w.astype(np.float32)
    for start in range(0, w.shape[-1], GROUP):
        g = w[:, start:start + GROUP]
        big = g[np.arange(g.shape[0]), np.argmax(np.abs(g), axis=1)][:, None]
        scale = bf16_bits_to_f32(f32_to_bf16_bits((big / np.float32(-8.0)).astype(np.float32)))
        assert np.all(scale != 0), name
        q = np.rint(g / scale).astype(np.float32)
        assert np.all((q >= -8) & (q <= 7)), name
        if not np.array_equal((q * scale).astype(np.float32), g):
            raise AssertionError(f"int4 conversion of {name} is lossy at group {start}")


# ----------------------------------------------------------------------------

def run_case(c: dict, out: Path, verbose: bool):
    case_dir = out / c["name"]
    best = None
    for attempt in range(MAX_ATTEMPTS):
        seed = c["seed"] + SEED_STRIDE * attempt
        rng = np.random.default_rng(seed)
        weights = build_weights(c, rng)
        prompt = [int(t) for t in rng.integers(0, c["vocab"], size=c["prompt_len"])]
        cfg = make_config(c)

        if case_dir.exists():
            shutil.rmtree(case_dir)
        case_dir.mkdir(parents=True)
        (case_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        write_safetensors(case_dir / "model.safetensors", weights)

        tokens, step_logits = mlx_greedy(case_dir, prompt, c["new"])
        margins = margins_of(step_logits)
        first_tie = next((i for i, m in enumerate(margins) if m < NEAR_TIE), None)
        # eos is ignored while decoding, but a consumer truncates at it: keep
        # it out of the chain so the whole chain gets compared.
        eos_free = cfg["eos_token_id"] not in tokens
        ok = first_tie is None and not collapsed(tokens) and eos_free
        score = (not collapsed(tokens), eos_free,
                 c["new"] if first_tie is None else first_tie)
        if verbose:
            print(f"  {c['name']} seed {seed}: first_near_tie={first_tie} "
                  f"collapsed={collapsed(tokens)} min_margin={min(margins):.4f}",
                  file=sys.stderr)
        if best is None or score > best[0]:
            best = (score, seed)
        if ok:
            break
    else:
        seed = best[1]
        print(f"  {c['name']}: no clean seed in {MAX_ATTEMPTS} attempts, using {seed}",
              file=sys.stderr)
        # regenerate the best one
        rng = np.random.default_rng(seed)
        weights = build_weights(c, rng)
        prompt = [int(t) for t in rng.integers(0, c["vocab"], size=c["prompt_len"])]
        cfg = make_config(c)
        shutil.rmtree(case_dir)
        case_dir.mkdir(parents=True)
        (case_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        write_safetensors(case_dir / "model.safetensors", weights)
        tokens, step_logits = mlx_greedy(case_dir, prompt, c["new"])
        margins = margins_of(step_logits)
        first_tie = next((i for i, m in enumerate(margins) if m < NEAR_TIE), None)

    # sanity checks on the chosen weights
    for name, w in weights.items():
        if c.get("int4") and is_layer_linear(name):
            assert_int4_lossless(name, w)
        elif is_int8_converted(name):
            assert_int8_lossless(name, w)
    check_safetensors_header(case_dir / "model.safetensors", weights)
    assert cfg["eos_token_id"] < c["vocab"] and cfg["bos_token_id"] < c["vocab"]
    np_err = np_check(c, cfg, weights, prompt, tokens, step_logits, margins)

    l0 = step_logits[0]
    top5 = np.argsort(-l0, kind="stable")[:5]
    expected = {
        "case": c["name"],
        "weights": "int4" if c.get("int4") else "int8",
        "seed": seed,
        "prompt_ids": prompt,
        "generated_ids": tokens,
        "eos_token_id": cfg["eos_token_id"],
        "margins": [round(m, 6) for m in margins],
        "first_near_tie": first_tie,
        "top5_first_step": [[int(i), float(l0[i])] for i in top5],
        "mlx_version": importlib.metadata.version("mlx"),
        "mlx_lm_version": importlib.metadata.version("mlx-lm"),
    }
    (case_dir / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    return dict(case=c, seed=seed, tokens=tokens, first_tie=first_tie,
                min_margin=min(margins), np_err=np_err,
                size=(case_dir / "model.safetensors").stat().st_size)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="tests/fixtures/mlx")
    ap.add_argument("--only", nargs="*", help="case names to (re)generate")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()

    mx.set_default_device(mx.cpu)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for c in CASES:
        if args.only and c["name"] not in args.only:
            continue
        results.append(run_case(c, out, args.verbose))

    print(f"mlx {importlib.metadata.version('mlx')}, "
          f"mlx-lm {importlib.metadata.version('mlx-lm')}, device {mx.default_device()}")
    hdr = (f"{'case':24} {'H':>4} {'nh':>3} {'kv':>3} {'hd':>4} {'I':>4} {'V':>5} "
           f"{'L':>2} {'tied':>5} {'P':>4} {'N':>3} {'seed':>6} {'tie@':>5} "
           f"{'minmarg':>8} {'np_err':>8} {'bytes':>7}  first 8 ids")
    print(hdr)
    for r in results:
        c = r["case"]
        tied = "yes+h" if c["stored_head"] else ("yes" if c["tied"] else "no")
        print(f"{c['name']:24} {c['hidden']:>4} {c['heads']:>3} {c['kv_heads']:>3} "
              f"{c['head_dim']:>4} {c['inter']:>4} {c['vocab']:>5} {c['layers']:>2} "
              f"{tied:>5} {c['prompt_len']:>4} {c['new']:>3} {r['seed']:>6} "
              f"{str(r['first_tie']):>5} {r['min_margin']:>8.4f} {r['np_err']:>8.1e} "
              f"{r['size']:>7}  {r['tokens'][:8]}")


if __name__ == "__main__":
    main()
