"""Pure-jnp attention: the oracle every fused kernel must match.

Layouts (no copies needed between the model and the kernels):
  differential: q (B, T, 2H, d) with Q1 = sub-head 2h and Q2 = 2h+1; k (B, S, 2Hkv, d) paired the
  same way; v (B, S, Hkv, 2d). DIFF head h reads kv group h // (H // Hkv) (the `flash` pairing).
  standard: q (B, T, Hq, d), k and v (B, S, Hkv, d); query head j reads kv head j // (Hq // Hkv).

Masks: `causal` keeps key j for query i when j <= i (top-left aligned, as
`jax.nn.dot_product_attention`); `segment_ids` (B, T) keeps pairs in the same segment, and a query
or key with segment 0 (padding) sees nothing / is seen by nothing. A fully masked query row
outputs zeros.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

_NEG_INF = -1e30


def attention_mask(
    t: int,
    s: int,
    *,
    causal: bool,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
) -> jax.Array | None:
    """Boolean mask broadcastable to (B, 1, T, S); None when nothing is masked."""
    mask = None
    if causal:
        mask = (jnp.arange(t)[:, None] >= jnp.arange(s)[None, :])[None, None]
    if q_segment_ids is not None:
        if kv_segment_ids is None:
            kv_segment_ids = q_segment_ids
        same = q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :]
        seg = same & (q_segment_ids[:, None, :, None] != 0)
        mask = seg if mask is None else mask & seg
    return mask


def is_array(x: object) -> bool:
    """Whether `x` is an array: jax's, NumPy's or a tracer (not a list or a Python number)."""
    return hasattr(x, "dtype") and hasattr(x, "shape")


def kind_of(x: object) -> str:
    """What an error names `x` by: its dtype if it is an array, else its Python type."""
    return str(x.dtype) if is_array(x) else type(x).__name__


def check_causal(causal: object) -> bool:
    """`causal` as a Python bool (a NumPy bool is one); a TypeError for anything else: `bool()` of
    the string "False" or of an array ran the call causal, or by the array's value."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    return bool(causal)


def check_layout(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    num_components: int,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    lam: jax.Array | float | None = None,
    double_width_values: bool = False,
) -> None:
    """One ValueError naming the argument whose shape breaks the layouts above, if one does (a
    TypeError for q, k or v that is not a floating-point array).

    With nc = `num_components` (2: differential, 1: standard): q (B, T, H·nc, d),
    k (B, S, Hkv·nc, d), v (B, S, Hkv, dv) with Hkv dividing H, and dv = 2d if
    `double_width_values` (a DIFF head's value); `segment_ids` (B, T) and `kv_segment_ids` (B, S)
    (only with `segment_ids`), S == T when only `segment_ids` is given; `lam` a real number or
    a float array of shape () (a TypeError otherwise, a bool included).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        # an int array used to run, its output rounded to ints
        if not (is_array(x) and jnp.issubdtype(x.dtype, jnp.floating)):
            raise TypeError(f"{name} must be a floating-point array, got {kind_of(x)}")
        if x.ndim != 4:
            raise ValueError(f"{name} must be 4-D (batch, length, heads, width), got shape {x.shape}")
    nc = num_components
    b, t, hq, d = q.shape
    s, hk = k.shape[1], k.shape[2]
    if hq % nc or hk % nc:
        raise ValueError(f"differential attention needs even q and k head counts (sub-heads 2h, "
                         f"2h+1 are the two components), got q {q.shape}, k {k.shape}")
    h, hkv = hq // nc, hk // nc
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k must be (B, S, kv heads, d) with q's B = {b} and d = {d}, "
                         f"got {k.shape}")
    if v.shape[:3] != (b, s, hkv):
        raise ValueError(f"v must be (B, S, Hkv, dv) = ({b}, {s}, {hkv}, dv) to match q {q.shape} "
                         f"and k {k.shape}, got {v.shape}")
    if double_width_values and v.shape[3] != 2 * d:
        raise ValueError(f"v must be (B, S, Hkv, 2d) = {(b, s, hkv, 2 * d)}, got {v.shape}")
    if h % hkv:
        pairs = "; q holds 2H sub-heads and k 2Hkv (Q1, Q2 of head h at 2h, 2h+1)" if nc == 2 else ""
        raise ValueError(f"the query heads ({h}) must be a multiple of the kv heads ({hkv}): "
                         f"q {q.shape}, k {k.shape}{pairs}")
    for name, ids in (("segment_ids", segment_ids), ("kv_segment_ids", kv_segment_ids)):
        # float ids: the kernels would cast 0.5 to 0
        if ids is not None and not (is_array(ids) and jnp.issubdtype(ids.dtype, jnp.integer)):
            raise ValueError(f"{name} must be integers (0: padding), got {kind_of(ids)}")
    if segment_ids is not None:
        if segment_ids.shape != (b, t):
            raise ValueError(f"segment_ids must be (B, T) = {(b, t)}, got {segment_ids.shape}")
        if kv_segment_ids is None and s != t:
            raise ValueError(f"segment_ids (B, T) mask the keys too, so they need S == T; got "
                             f"T = {t}, S = {s}")
    if kv_segment_ids is not None:
        if segment_ids is None:
            raise ValueError("kv_segment_ids need the queries' segment_ids (B, T) too: without "
                             "them no segment mask is applied")
        if kv_segment_ids.shape != (b, s):
            raise ValueError(f"kv_segment_ids must be (B, S) = {(b, s)}, got "
                             f"{kv_segment_ids.shape}")
    if lam is not None:
        # "0.5" ran as 0.5 (jnp.asarray parses it) and True as 1
        if isinstance(lam, bool) or not (isinstance(lam, numbers.Real) or (
                is_array(lam) and jnp.issubdtype(lam.dtype, jnp.floating))):
            raise TypeError(f"lam must be a real number or a float array of shape (), got "
                            f"{kind_of(lam)}")
        if jnp.shape(lam) != ():
            raise ValueError(f"lam must be a scalar, got shape {jnp.shape(lam)}")


def _softmax(scores: jax.Array, mask: jax.Array | None) -> jax.Array:
    """float32 softmax over the last axis; masked entries get probability 0 (all-masked rows: 0)."""
    scores = scores.astype(jnp.float32)
    if mask is None:
        return jax.nn.softmax(scores, axis=-1)
    scores = jnp.where(mask, scores, _NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.where(mask, probs, 0.0)


MAX_LOGIT_BITS = 32
"""The widest `quantize_logits` width (`model.attn_logit_bits`, eval.py's `bits=`): float32
logits hold 24 bits, so wider widths change nothing, and from 129 bits 2^(bits−1) overflows
float32, the scale underflows to 0 and the logits round to integers."""


def quantize_logits(scores: jax.Array, mask: jax.Array | None, bits: int | jax.Array) -> jax.Array:
    """Absmax fake-quantization to signed `bits`-bit integers, one scale per (batch, score map).

    scale = max|s| / (2^(bits−1) − 1) over the unmasked entries of each (T, S) map; s -> round(s /
    scale)·scale. This is the dynamic post-training quantization of the paper's Figure 8.
    `bits` may be an int32 scalar array (traced: one compiled program serves every width), which
    the caller keeps in [2, MAX_LOGIT_BITS]; a Python int outside it is a ValueError.
    """
    if isinstance(bits, int) and not 2 <= bits <= MAX_LOGIT_BITS:
        raise ValueError(f"logit_bits must be in [2, {MAX_LOGIT_BITS}], got {bits}")
    absval = jnp.abs(scores) if mask is None else jnp.where(mask, jnp.abs(scores), 0.0)
    levels = 2.0 ** (bits - 1) - 1
    scale = jnp.max(absval, axis=(-2, -1), keepdims=True) / levels
    scale = jnp.where(scale > 0, scale, 1.0)
    return jnp.round(scores / scale) * scale


def diff_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lam: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    causal: bool = True,
    logit_bits: int | jax.Array | None = None,
    return_maps: bool = False,
) -> jax.Array | tuple[jax.Array, dict[str, jax.Array | None]]:
    """softmax(s·Q1K1ᵀ+M)·V − λ·softmax(s·Q2K2ᵀ+M)·V per DIFF head, s = d^-1/2; (B, T, H, 2d).

    `kv_segment_ids` (B, S) gives the keys their own segments (default: `segment_ids`);
    `logit_bits` fake-quantizes the scaled logits (`quantize_logits`). With `return_maps` also
    returns {"logits", "probs"}: (B, 2H, T, S) float32 in sub-head order (map 2h is A1 of head h,
    2h+1 its A2), and "mask" (broadcastable to (B, 1, T, S), or None).
    """
    check_layout(q, k, v, num_components=2, segment_ids=segment_ids,
                 kv_segment_ids=kv_segment_ids, lam=lam, double_width_values=True)
    b, t, two_h, d = q.shape
    _, s, two_hkv, _ = k.shape
    hkv = two_hkv // 2
    h = two_h // 2
    n_rep = h // hkv
    scale = d**-0.5
    # (B, T, Hkv, n_rep, 2, d) and (B, S, Hkv, 2, d): component c of head (g, r) meets K_c of group g.
    qg = q.reshape(b, t, hkv, n_rep, 2, d)
    kg = k.reshape(b, s, hkv, 2, d)
    scores = jnp.einsum(
        "btgrcd,bsgcd->bgrcts", qg, kg, preferred_element_type=jnp.float32,
        precision=jax.lax.Precision.HIGHEST,
    ) * scale
    mask = attention_mask(t, s, causal=causal, q_segment_ids=segment_ids,
                          kv_segment_ids=kv_segment_ids)
    if mask is not None:
        mask = mask[:, :, None, None]  # (B, 1, 1, 1, T, S)
    if logit_bits is not None:
        scores = quantize_logits(scores, mask, logit_bits)
    probs = _softmax(scores, mask)  # (B, Hkv, n_rep, 2, T, S)
    lam = jnp.asarray(lam, jnp.float32)
    diff = probs[:, :, :, 0] - lam * probs[:, :, :, 1]  # (B, Hkv, n_rep, T, S)
    out = jnp.einsum(
        "bgrts,bsge->btgre", diff, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )
    out = out.reshape(b, t, h, 2 * d).astype(q.dtype)
    if return_maps:
        maps = {"logits": scores.reshape(b, two_h, t, s), "probs": probs.reshape(b, two_h, t, s),
                "mask": None if mask is None else mask[:, :, 0, 0]}
        return out, maps
    return out


def attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    causal: bool = True,
    logit_bits: int | jax.Array | None = None,
    return_maps: bool = False,
) -> jax.Array | tuple[jax.Array, dict[str, jax.Array | None]]:
    """Standard (GQA) softmax attention, s = d^-1/2, float32 softmax; (B, T, Hq, dv).

    `kv_segment_ids`, `logit_bits` and `return_maps` as in `diff_attention_reference` (maps are
    (B, Hq, T, S)).
    """
    check_layout(q, k, v, num_components=1, segment_ids=segment_ids,
                 kv_segment_ids=kv_segment_ids)
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)  # query heads grouped by the kv head they read
    scores = jnp.einsum(
        "btgrd,bsgd->bgrts", qg, k, preferred_element_type=jnp.float32,
        precision=jax.lax.Precision.HIGHEST,
    ) * (d**-0.5)
    mask = attention_mask(t, s, causal=causal, q_segment_ids=segment_ids,
                          kv_segment_ids=kv_segment_ids)
    if mask is not None:
        mask = mask[:, :, None]  # (B, 1, 1, T, S)
    if logit_bits is not None:
        scores = quantize_logits(scores, mask, logit_bits)
    probs = _softmax(scores, mask)
    out = jnp.einsum(
        "bgrts,bsge->btgre", probs, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )
    out = out.reshape(b, t, hq, v.shape[-1]).astype(q.dtype)
    if return_maps:
        maps = {"logits": scores.reshape(b, hq, t, s), "probs": probs.reshape(b, hq, t, s),
                "mask": None if mask is None else mask[:, :, 0]}
        return out, maps
    return out
