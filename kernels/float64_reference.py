"""Differential attention and its gradients in float64 NumPy, written from the paper's equations.

The independent reference of the kernels' numerics: no JAX and no code shared with
`kernels.reference` or the kernels; the same layouts (`kernels.reference`'s docstring). The CPU
tests hold every implementation to it, and `benchmarks/attention.py --check` holds the real GPU
lowerings to it, on the host, with no program of its own to compile there, for every case: its
products are stacked matrix products (`@`, BLAS), not `np.einsum` loops.
"""

from __future__ import annotations

import numpy as np


def mask(t: int, s: int, causal: bool, seg: np.ndarray | None) -> np.ndarray:
    """(B|1, 1, T, S) boolean: causal (key j <= query i) if `causal`, and the same nonzero
    segment of `seg` (B, T) when given."""
    m = np.ones((seg.shape[0] if seg is not None else 1, t, s), bool)
    if causal:
        m &= np.arange(t)[:, None] >= np.arange(s)[None, :]
    if seg is not None:
        m &= (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0)
    return m[:, None]  # (B|1, 1, T, S)


def _t(x: np.ndarray) -> np.ndarray:
    """The last two axes swapped: the matrix transpose of a stack of matrices."""
    return x.swapaxes(-1, -2)


def _softmaxes(q, k, v, causal: bool, seg):
    """Per DIFF head, in float64: (Q1, Q2) and (K1, K2) (B, H, ·, d) with K of the head's kv
    group, V (B, H, S, 2d), the two softmax maps (B, H, T, S), the kv group of each head, the
    scale d^-1/2."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, h2, d = q.shape
    s, hkv = k.shape[1], v.shape[2]
    h, rep, scale = h2 // 2, h2 // 2 // hkv, d**-0.5
    g = np.arange(h) // rep  # kv group of each DIFF head
    qc = [q[:, :, 0::2].transpose(0, 2, 1, 3), q[:, :, 1::2].transpose(0, 2, 1, 3)]  # (B,H,T,d)
    kc = [k[:, :, 0::2][:, :, g].transpose(0, 2, 1, 3), k[:, :, 1::2][:, :, g].transpose(0, 2, 1, 3)]
    vh = v[:, :, g].transpose(0, 2, 1, 3)  # (B, H, S, 2d)
    keep = mask(t, s, causal, None if seg is None else np.asarray(seg))
    probs = []
    for c in range(2):
        sc = np.where(keep, (qc[c] @ _t(kc[c])) * scale, -np.inf)
        mx = np.max(sc, -1, keepdims=True)
        e = np.where(keep, np.exp(sc - np.where(np.isfinite(mx), mx, 0.0)), 0.0)
        z = e.sum(-1, keepdims=True)
        probs.append(np.where(z > 0, e / np.where(z > 0, z, 1.0), 0.0))
    return qc, kc, vh, probs, g, scale


def second_softmax_output(q, k, v, *, causal: bool, seg) -> np.ndarray:
    """O2 = softmax(Q2K2ᵀ/√d)·V (B, T, H, 2d) in float64, the branch λ scales (out = O1 − λ·O2,
    so dλ = −Σ dO·O2); layouts and `seg` as in `diff_attention`."""
    _, _, vh, probs, _, _ = _softmaxes(q, k, v, causal, seg)
    return (probs[1] @ vh).transpose(0, 2, 1, 3)


def diff_attention(q, k, v, lam: float, do, *, causal: bool, seg) -> tuple[np.ndarray, tuple]:
    """Differential attention in float64 and the gradients of Σ out·do: (out (B, T, H, 2d),
    (dq, dk, dv, dλ)) for q (B, T, 2H, d), k (B, S, 2Hkv, d), v (B, S, Hkv, 2d), dO (B, T, H, 2d)
    in the kernels' layout and `seg` (B, T) segment ids or None; from the definitions (the
    softmax Jacobian, no flash identities). A fully masked query row outputs zeros."""
    qc, kc, vh, probs, g, scale = _softmaxes(q, k, v, causal, seg)
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    h = q.shape[2] // 2
    dob = do.transpose(0, 2, 1, 3)  # (B, H, T, 2d)
    coef = [1.0, -float(lam)]
    a = probs[0] + coef[1] * probs[1]
    out = a @ vh
    dvh = _t(a) @ dob
    da = dob @ _t(vh)
    dlam = -np.sum((probs[1] @ vh) * dob)
    dq = np.zeros_like(q)
    dk = np.zeros_like(k)
    for c in range(2):
        dac = coef[c] * da
        ds = probs[c] * (dac - np.sum(dac * probs[c], -1, keepdims=True)) * scale
        dq[:, :, c::2] = (ds @ kc[c]).transpose(0, 2, 1, 3)
        dkh = _t(ds) @ qc[c]  # (B, H, S, d) per DIFF head, summed into its group
        for hh in range(h):
            dk[:, :, 2 * g[hh] + c] += dkh[:, hh]
    dv = np.zeros_like(v)
    for hh in range(h):
        dv[:, :, g[hh]] += dvh[:, hh]
    return out.transpose(0, 2, 1, 3), (dq, dk, dv, dlam)
