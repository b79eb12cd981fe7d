"""Float64 NumPy attention written straight from the paper's equations and the reference layout.

Independent of diff_jax and kernels: loops over heads, explicit masks, weights in the PyTorch
(out, in) layout under the reference's state_dict names. Used as the oracle in tests.
"""

from __future__ import annotations

import numpy as np


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Interleaved (GPT-J) rotary: pairs (2i, 2i+1) of x (B, T, N, d) rotated by tables (T, d/2)."""
    out = x.copy()
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
    out[..., 1::2] = x[..., 0::2] * s + x[..., 1::2] * c
    return out


def rope_tables(t: int, d: int, theta: float = 10000.0, offset: int = 0):
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.arange(offset, offset + t, dtype=np.float64)[:, None] * inv[None]
    return np.cos(ang), np.sin(ang)


def mask(t: int, segment_ids: np.ndarray | None, b: int) -> np.ndarray:
    """(B, T, T) boolean: causal, same segment, and no padding (segment 0)."""
    m = np.tril(np.ones((t, t), bool))[None].repeat(b, 0)
    if segment_ids is not None:
        seg = segment_ids
        m &= (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0)
    return m


def softmax(scores: np.ndarray, m: np.ndarray) -> np.ndarray:
    scores = np.where(m, scores, -np.inf)
    mx = np.max(scores, axis=-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    e = np.where(m, np.exp(scores - mx), 0.0)
    z = e.sum(-1, keepdims=True)
    return np.divide(e, z, out=np.zeros_like(e), where=z > 0)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def lambda_init(depth: int) -> float:
    return 0.8 - 0.6 * np.exp(-0.3 * depth)


def diff_v1(sd, x, cos, sin, *, num_heads, num_kv_heads, depth, pairing="flash", segment_ids=None,
            fixed_lambda_init=None, head_norm=True):
    """DIFF attention V1 output (B, T, E) and the maps A1, A2 (B, H, T, T); λ_init is
    `fixed_lambda_init` when given, else the depth schedule; `head_norm` False skips the
    per-head RMSNorm (the (1 − λ_init) scale stays)."""
    sd = {k: np.asarray(v, np.float64) for k, v in sd.items()}
    x = np.asarray(x, np.float64)
    b, t, e = x.shape
    h, hkv = num_heads, num_kv_heads
    d = e // h // 2
    n_rep = h // hkv
    q = rope((x @ sd["q_proj.weight"].T).reshape(b, t, 2 * h, d), cos, sin)
    k = rope((x @ sd["k_proj.weight"].T).reshape(b, t, 2 * hkv, d), cos, sin)
    v = (x @ sd["v_proj.weight"].T).reshape(b, t, hkv, 2 * d)
    init = lambda_init(depth) if fixed_lambda_init is None else fixed_lambda_init
    lam = (np.exp(np.dot(sd["lambda_q1"], sd["lambda_k1"]))
           - np.exp(np.dot(sd["lambda_q2"], sd["lambda_k2"])) + init)
    m = mask(t, segment_ids, b)
    heads, a1s, a2s = [], [], []
    for hd in range(h):
        if pairing == "flash":
            g = hd // n_rep
            k1, k2, vh = k[:, :, 2 * g], k[:, :, 2 * g + 1], v[:, :, g]
        else:  # naive: Q sub-head j meets K sub-head j // n_rep; V head hd // n_rep
            k1, k2, vh = k[:, :, (2 * hd) // n_rep], k[:, :, (2 * hd + 1) // n_rep], v[:, :, hd // n_rep]
        s1 = np.einsum("btd,bsd->bts", q[:, :, 2 * hd], k1) / np.sqrt(d)
        s2 = np.einsum("btd,bsd->bts", q[:, :, 2 * hd + 1], k2) / np.sqrt(d)
        a1, a2 = softmax(s1, m), softmax(s2, m)
        o = np.einsum("bts,bse->bte", a1 - lam * a2, vh)
        o = (rmsnorm(o, sd["subln.weight"]) if head_norm else o) * (1 - init)
        heads.append(o)
        a1s.append(a1)
        a2s.append(a2)
    out = np.concatenate(heads, axis=-1) @ sd["out_proj.weight"].T
    return out, np.stack(a1s, 1), np.stack(a2s, 1), lam


def diff_v2(sd, x, cos, sin, *, num_heads, num_kv_heads, head_dim, segment_ids=None,
            head_norm=False):
    """DIFF attention V2 output (B, T, E); `head_norm` RMS-normalises each head's difference
    with `subln.weight` (model.v2_head_norm)."""
    sd = {k: np.asarray(v, np.float64) for k, v in sd.items()}
    x = np.asarray(x, np.float64)
    b, t, e = x.shape
    h, hkv, d = num_heads, num_kv_heads, head_dim
    group = 2 * h // hkv
    q = rope((x @ sd["q_proj.weight"].T).reshape(b, t, 2 * h, d), cos, sin)
    k = rope((x @ sd["k_proj.weight"].T).reshape(b, t, hkv, d), cos, sin)
    v = (x @ sd["v_proj.weight"].T).reshape(b, t, hkv, d)
    lam = 1 / (1 + np.exp(-(x @ sd["lambda_proj.weight"].T)))  # (B, T, h)
    m = mask(t, segment_ids, b)
    outs = []
    for j in range(2 * h):
        s = np.einsum("btd,bsd->bts", q[:, :, j], k[:, :, j // group]) / np.sqrt(d)
        outs.append(np.einsum("bts,bsd->btd", softmax(s, m), v[:, :, j // group]))
    heads = [outs[2 * i] - lam[:, :, i:i + 1] * outs[2 * i + 1] for i in range(h)]
    if head_norm:
        heads = [rmsnorm(o, sd["subln.weight"]) for o in heads]
    return np.concatenate(heads, -1) @ sd["o_proj.weight"].T


def standard(sd, x, cos, sin, *, num_heads, num_kv_heads, segment_ids=None):
    sd = {k: np.asarray(v, np.float64) for k, v in sd.items()}
    x = np.asarray(x, np.float64)
    b, t, e = x.shape
    h, hkv = num_heads, num_kv_heads
    d = e // h
    q = rope((x @ sd["q_proj.weight"].T).reshape(b, t, h, d), cos, sin)
    k = rope((x @ sd["k_proj.weight"].T).reshape(b, t, hkv, d), cos, sin)
    v = (x @ sd["v_proj.weight"].T).reshape(b, t, hkv, d)
    m = mask(t, segment_ids, b)
    outs = []
    for j in range(h):
        g = j // (h // hkv)
        s = np.einsum("btd,bsd->bts", q[:, :, j], k[:, :, g]) / np.sqrt(d)
        outs.append(np.einsum("bts,bsd->btd", softmax(s, m), v[:, :, g]))
    return np.concatenate(outs, -1) @ sd["out_proj.weight"].T


def random_state_dict(shapes: dict, seed: int) -> dict:
    """Random reference tensors: projections ~ N(0, 1/in), λ vectors ~ N(0, 0.1²), norm ~ 1 ± 0.1."""
    rng = np.random.default_rng(seed)
    sd = {}
    for k, shape in shapes.items():
        if k.startswith("lambda_") and len(shape) == 1:
            sd[k] = rng.normal(0, 0.1, shape)
        elif k == "subln.weight":
            sd[k] = 1 + rng.normal(0, 0.1, shape)
        else:
            sd[k] = rng.normal(0, shape[1] ** -0.5, shape)
    return {k: v.astype(np.float32) for k, v in sd.items()}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
