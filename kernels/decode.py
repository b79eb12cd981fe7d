"""Single-query attention over a KV cache that reads only its filled part (pure jnp).

One new token per row attends to the first `lengths[b]` entries of a cache of capacity S. The
keys are visited chunk by chunk with online softmaxes (one per component), and the loop stops
after the last chunk that holds a filled entry of any row, so a step costs O(max filled length),
not O(S). Layouts as `kernels.reference`: differential q (B, 1, 2H, d), k (B, S, 2Hkv, d),
v (B, S, Hkv, 2d) with head h reading kv group h // (H / Hkv); standard q (B, 1, Hq, d),
k and v (B, S, Hkv, d). Scores, softmaxes and λ in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .reference import check_layout, is_array, kind_of

NEG_INF = -1e30
DEFAULT_CHUNK = 128


def decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lam: jax.Array | None,
    *,
    lengths: jax.Array,
    chunk: int = DEFAULT_CHUNK,
) -> jax.Array:
    """softmax(s·q·Kᵀ)·V over cache entries [0, lengths[b]) (λ given: the differential form).

    q (B, 1, H·nc, d), k (B, S, Hkv·nc, d), v (B, S, Hkv, dv), lengths (B,) int32 in [0, S]
    with nc = 2 and dv = 2d (a DIFF head's value) when `lam` is given, else nc = 1 and any dv.
    Returns (B, 1, H, dv) in q's dtype; a row with length 0 (every row of an empty cache,
    S = 0) outputs zeros. Entries at and past `lengths[b]` never reach row b's output, whatever
    they hold (NaN or Inf of an uninitialised, donated or reused cache included). Traced
    lengths cannot be checked: a length past S reads all S entries (as S would), a negative
    one none (zeros, as 0).
    """
    nc = 1 if lam is None else 2
    check_layout(q, k, v, num_components=nc, lam=lam, double_width_values=nc == 2)
    b, t, hq, d = q.shape
    s, hkv, dv = k.shape[1], v.shape[2], v.shape[3]
    if t != 1:
        raise ValueError(f"decode_attention takes one query per row, got T = {t}")
    if not (is_array(lengths) and jnp.issubdtype(lengths.dtype, jnp.integer)):  # 2.5 ran as 2
        raise ValueError(f"lengths must be (B,) integers, got {kind_of(lengths)}")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be (B,) = ({b},), got {lengths.shape}")
    if chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    if s == 0:  # an empty cache: every row has length 0
        return jnp.zeros((b, 1, hq // nc, dv), q.dtype)
    n_rep = hq // nc // hkv
    chunk = min(chunk, s)
    f32 = jnp.float32
    qg = q.reshape(b, hkv, n_rep, nc, d).astype(f32) * d**-0.5
    lengths = lengths.astype(jnp.int32)

    def body(j, carry):
        m, l, acc = carry  # (B, Hkv, R, nc), the same, (B, Hkv, R, nc, dv)
        lo = j * chunk
        start = jnp.minimum(lo, s - chunk)  # the last chunk may overlap the one before it
        kc = lax.dynamic_slice_in_dim(k, start, chunk, axis=1).reshape(b, chunk, hkv, nc, d)
        vc = lax.dynamic_slice_in_dim(v, start, chunk, axis=1)  # (B, C, Hkv, dv)
        pos = start + jnp.arange(chunk)
        valid = (pos[None, :] >= lo) & (pos[None, :] < lengths[:, None])  # (B, C)
        # p = 0 does not mask V: 0·NaN is NaN, and entries past a row's length may hold anything
        vc = jnp.where(valid[:, :, None, None], vc, 0)
        valid = valid[:, None, None, None, :]
        sc = jnp.einsum("bgrcd,bsgcd->bgrcs", qg, kc.astype(f32),
                        precision=lax.Precision.HIGHEST)
        sc = jnp.where(valid, sc, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
        p = jnp.where(valid, jnp.exp(sc - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        pv = jnp.einsum("bgrcs,bsge->bgrce", p, vc.astype(f32), precision=lax.Precision.HIGHEST)
        return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv

    n_chunks = (jnp.max(lengths) + chunk - 1) // chunk
    init = (jnp.full((b, hkv, n_rep, nc), NEG_INF, f32), jnp.zeros((b, hkv, n_rep, nc), f32),
            jnp.zeros((b, hkv, n_rep, nc, dv), f32))
    _, l, acc = lax.fori_loop(0, n_chunks, body, init)
    o = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    out = o[..., 0, :] if lam is None else o[..., 0, :] - jnp.asarray(lam, f32) * o[..., 1, :]
    return out.reshape(b, 1, hq // nc, dv).astype(q.dtype)
