"""Attention kernels for diff-jax: differential attention and standard (GQA) attention.

Two entry points, each with three implementations (`impl`):
  "xla"     the pure-jnp oracle of `kernels.reference` (the only one that can also return the
            attention maps, quantize the logits, or give the keys their own segments, as the
            analyses and single-token decoding need);
  "pallas"  the fused flash kernel of `kernels.flash` (on NVIDIA GPUs Mosaic GPU from Hopper on
            and Triton before — `gpu_target` names the generation when exporting; Mosaic on
            TPU; the Pallas interpreter on CPU);
  "cudnn"   `jax.nn.dot_product_attention(implementation="cudnn")` (NVIDIA GPUs, bf16/fp16); the
            differential operator runs as one call with 4H heads (Q_c, K_c against each d-wide half
            of V), the FlashDiff_2 route, because cuDNN needs V as wide as K.

`decode_attention` is one-token attention over a KV cache that reads only the cache's filled
part (pure jnp, any platform).

Choosing among them for a platform, and wrapping the kernels for a device mesh, is the caller's
job (`diff_jax.attention_op.AttentionOp`): nothing here names a mesh axis.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from .decode import decode_attention
from .flash import MAX_HEAD_DIM, BlockSizes, flash_attention, supports_head_dim
from .hopper import target as gpu_target
from .reference import (attention_mask, attention_reference, check_causal, check_layout,
                               diff_attention_reference, is_array)

__all__ = ["IMPLS", "MAX_HEAD_DIM", "BlockSizes", "decode_attention", "diff_attention",
           "dot_product_attention", "four_call_diff_attention", "gpu_target", "supports_head_dim"]

IMPLS: tuple[str, ...] = ("xla", "pallas", "cudnn")
_HALF = (jnp.bfloat16, jnp.float16)


def _check(impl: str, arrays: dict[str, Any], causal: bool, *, oracle_only: dict[str, Any]) -> bool:
    """`causal` as a Python bool (a NumPy bool is one), after one clear error for an unknown impl,
    a `causal` that is no bool, an oracle-only option given to a kernel, or a floating-point q,
    k or v (`arrays`) that cuDNN does not take (what is no float array is `check_layout`'s
    TypeError)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    causal = check_causal(causal)  # causal="no" was causal
    used = [name for name, value in oracle_only.items()  # np.False_ counted as given
            if value is not None and not (isinstance(value, (bool, np.bool_)) and not value)]
    if impl != "xla" and used:
        raise ValueError(f"{', '.join(used)} exist only on the xla path (impl='xla'), not {impl!r}")
    if impl != "cudnn":
        return causal
    floats = {name: x.dtype for name, x in arrays.items()
              if is_array(x) and jnp.issubdtype(x.dtype, jnp.floating)}
    if any(dtype not in _HALF for dtype in floats.values()) or len(set(floats.values())) > 1:
        got = ", ".join(f"{name} {jnp.dtype(dtype).name}" for name, dtype in floats.items())
        raise ValueError(f"impl='cudnn' needs q, k and v in one of bfloat16 or float16, got {got}")
    return causal


def diff_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lam: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    causal: bool = True,
    impl: str = "pallas",
    interpret: Any = None,
    block_sizes: BlockSizes | None = None,
    kv_segment_ids: jax.Array | None = None,
    logit_bits: int | jax.Array | None = None,
    return_maps: bool = False,
) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
    """Differential attention, (B, T, H, 2d); see `kernels.reference` for layouts and masks.

    q (B, T, 2H, d), k (B, S, 2Hkv, d), v (B, S, Hkv, 2d), lam a float32 scalar, segment_ids
    (B, T) int32 with 0 = padding. `interpret=None` interprets the Pallas kernel only on CPU.
    `kv_segment_ids`, `logit_bits` and `return_maps` (then returns (out, maps)) are oracle
    options: impl="xla" only.
    """
    causal = _check(impl, {"q": q, "k": k, "v": v}, causal, oracle_only={
        "kv_segment_ids": kv_segment_ids, "logit_bits": logit_bits, "return_maps": return_maps})
    if lam is None:
        raise ValueError("diff_attention needs lam (λ), a float32 scalar; standard attention is "
                         "dot_product_attention")
    check_layout(q, k, v, num_components=2, segment_ids=segment_ids,
                 kv_segment_ids=kv_segment_ids, lam=lam, double_width_values=True)
    if impl == "xla":
        return diff_attention_reference(q, k, v, lam, segment_ids=segment_ids,
                                        kv_segment_ids=kv_segment_ids, causal=causal,
                                        logit_bits=logit_bits, return_maps=return_maps)
    if impl == "pallas":
        return flash_attention(q, k, v, lam, num_components=2, segment_ids=segment_ids,
                               causal=causal, block_sizes=block_sizes, interpret=interpret)
    return four_call_diff_attention(q, k, v, lam, _cudnn_attend(segment_ids, causal))


def four_call_diff_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lam: jax.Array,
    attend: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
) -> jax.Array:
    """Differential attention from a standard attention whose V is as wide as K (FlashDiff_2).

    `attend(q, k, v)` takes q (B, T, N, d), k and v (B, S, K, d) with query head n reading kv
    head n // (N / K) (`jax.nn.dot_product_attention`'s GQA). Query heads are ordered
    (component c, half j, head h) and kv heads (c, j, group g), so head (c, j, h) meets K_c of
    group h // n_rep and the j-th d-wide half of V: one call with 4H heads gives P_c·V_j.
    """
    check_layout(q, k, v, num_components=2, lam=lam, double_width_values=True)
    b, t, two_h, d = q.shape
    s, hkv = k.shape[1], v.shape[2]
    h = two_h // 2
    qc = jnp.moveaxis(q.reshape(b, t, h, 2, d), 3, 2)  # (B, T, c, H, d)
    kc = jnp.moveaxis(k.reshape(b, s, hkv, 2, d), 3, 2)  # (B, S, c, Hkv, d)
    vj = jnp.moveaxis(v.reshape(b, s, hkv, 2, d), 3, 2)  # (B, S, j, Hkv, d)
    q4 = jnp.broadcast_to(qc[:, :, :, None], (b, t, 2, 2, h, d)).reshape(b, t, 4 * h, d)
    k4 = jnp.broadcast_to(kc[:, :, :, None], (b, s, 2, 2, hkv, d)).reshape(b, s, 4 * hkv, d)
    v4 = jnp.broadcast_to(vj[:, :, None], (b, s, 2, 2, hkv, d)).reshape(b, s, 4 * hkv, d)
    o = attend(q4, k4, v4).reshape(b, t, 2, 2, h, d)  # (B, T, c, j, H, d)
    o = jnp.moveaxis(o, 4, 2).reshape(b, t, h, 2, 2 * d)  # (B, T, H, c, 2d): [P_c·V_0, P_c·V_1]
    lam = jnp.asarray(lam, jnp.float32)
    out = o[:, :, :, 0].astype(jnp.float32) - lam * o[:, :, :, 1].astype(jnp.float32)
    return out.astype(q.dtype)


def _cudnn_attend(segment_ids: jax.Array | None, causal: bool):
    """`attend(q, k, v)` on cuDNN with the reference's segment semantics (see `reference`)."""

    def attend(q, k, v):
        mask = None
        if segment_ids is not None:
            t = q.shape[1]
            mask = attention_mask(t, t, causal=False, q_segment_ids=segment_ids)  # (B, 1, T, T)
            # Padding rows attend to themselves only (finite output, no NaN in the backward) and
            # are zeroed below, which is the reference's "fully masked rows output 0".
            mask = mask | ((segment_ids == 0)[:, None, :, None] & jnp.eye(t, dtype=bool)[None, None])
        out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                           implementation="cudnn")
        if segment_ids is not None:
            out = jnp.where((segment_ids != 0)[:, :, None, None], out, jnp.zeros_like(out))
        return out

    return attend


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    causal: bool = True,
    impl: str = "xla",
    interpret: Any = None,
    block_sizes: BlockSizes | None = None,
    kv_segment_ids: jax.Array | None = None,
    logit_bits: int | jax.Array | None = None,
    return_maps: bool = False,
) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
    """Standard GQA softmax attention, q (B, T, Hq, d), k/v (B, S, Hkv, d) -> (B, T, Hq, d).

    impl: "xla" (oracle), "pallas" (the fused flash kernel with one softmax), "cudnn" (GPU,
    bf16/fp16 only). Oracle-only options as in `diff_attention`.
    """
    causal = _check(impl, {"q": q, "k": k, "v": v}, causal, oracle_only={
        "kv_segment_ids": kv_segment_ids, "logit_bits": logit_bits, "return_maps": return_maps})
    if impl == "xla":
        return attention_reference(q, k, v, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                                   causal=causal, logit_bits=logit_bits, return_maps=return_maps)
    if impl == "pallas":
        return flash_attention(q, k, v, num_components=1, segment_ids=segment_ids, causal=causal,
                               block_sizes=block_sizes, interpret=interpret)
    check_layout(q, k, v, num_components=1, segment_ids=segment_ids)
    return _cudnn_attend(segment_ids, causal)(q, k, v)

