"""Attention kernels for diff-jax: differential attention and standard (GQA) attention.

`diff_attention` is the one entry point for the fused two-softmax operator: `impl="xla"` is the
pure-jnp oracle in `kernels.reference`, `impl="pallas"` the fused flash kernel of `kernels.flash`
(Triton on GPU, Mosaic on TPU, interpreted on CPU), `impl="auto"` the kernel on GPU/TPU and the
oracle on CPU. `dot_product_attention` is the standard attention used by V2 and the Transformer
baseline. `shard_attention` wraps either for sharded `jit` (Mosaic kernels need `shard_map`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from kernels.flash import BlockSizes, flash_attention
from kernels.reference import attention_mask, attention_reference, diff_attention_reference

__all__ = ["BlockSizes", "diff_attention", "dot_product_attention", "shard_attention"]

DIFF_IMPLS = ("xla", "pallas", "auto")
STANDARD_IMPLS = ("xla", "cudnn", "pallas", "auto")


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
) -> jax.Array:
    """Differential attention, (B, T, H, 2d); see `kernels.reference` for layouts and masks.

    q (B, T, 2H, d), k (B, S, 2Hkv, d), v (B, S, Hkv, 2d), lam a float32 scalar, segment_ids
    (B, T) int32 with 0 = padding. `interpret=None` interprets the kernel only on CPU.
    """
    if impl not in DIFF_IMPLS:
        raise ValueError(f"diff_attention impl must be one of {DIFF_IMPLS}, got {impl!r}")

    def xla():
        return diff_attention_reference(q, k, v, lam, segment_ids=segment_ids, causal=causal)

    def pallas():
        return flash_attention(q, k, v, lam, num_components=2, segment_ids=segment_ids,
                               causal=causal, block_sizes=block_sizes, interpret=interpret)

    if impl == "xla":
        return xla()
    if impl == "pallas":
        return pallas()
    return lax.platform_dependent(cuda=pallas, rocm=pallas, tpu=pallas, default=xla)


def _cudnn_attention(q, k, v, segment_ids, causal):
    """`jax.nn.dot_product_attention` on cuDNN with the reference's segment semantics."""
    mask = None
    if segment_ids is not None:
        t = q.shape[1]
        mask = attention_mask(t, t, causal=False, q_segment_ids=segment_ids)  # (B, 1, T, T)
        # Padding rows attend to themselves only (finite output, no NaN in the backward) and are
        # zeroed below, which is the reference's "fully masked rows output 0".
        pad = (segment_ids == 0)[:, None, :, None] & jnp.eye(t, dtype=bool)[None, None]
        mask = mask | pad
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                       implementation="cudnn")
    if segment_ids is not None:
        out = jnp.where((segment_ids != 0)[:, :, None, None], out, jnp.zeros_like(out))
    return out


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
) -> jax.Array:
    """Standard GQA softmax attention, q (B, T, Hq, d), k/v (B, S, Hkv, d) -> (B, T, Hq, d).

    impl: "xla" (oracle), "cudnn" (GPU, bf16/fp16 only), "pallas" (the fused flash kernel with one
    softmax), "auto" (cuDNN on GPU for bf16/fp16, else xla; the Mosaic kernel on TPU; xla on CPU).
    """
    if impl not in STANDARD_IMPLS:
        raise ValueError(f"dot_product_attention impl must be one of {STANDARD_IMPLS}, got {impl!r}")

    def xla():
        return attention_reference(q, k, v, segment_ids=segment_ids, causal=causal)

    def cudnn():
        return _cudnn_attention(q, k, v, segment_ids, causal)

    def pallas():
        return flash_attention(q, k, v, num_components=1, segment_ids=segment_ids, causal=causal,
                               block_sizes=block_sizes, interpret=interpret)

    if impl == "xla":
        return xla()
    if impl == "cudnn":
        if q.dtype not in (jnp.bfloat16, jnp.float16):
            raise ValueError(f"impl='cudnn' needs bfloat16 or float16 inputs, got {q.dtype}")
        return cudnn()
    if impl == "pallas":
        return pallas()
    gpu = cudnn if q.dtype in (jnp.bfloat16, jnp.float16) else xla
    return lax.platform_dependent(cuda=gpu, tpu=pallas, default=xla)


def shard_attention(
    fn: Callable[..., jax.Array],
    mesh: Mesh,
    *,
    batch_axes: str | tuple[str, ...] | None = "data",
    head_axis: str | None = "tensor",
    num_kv_heads: int | None = None,
) -> Callable[..., jax.Array]:
    """Wrap `fn(q, k, v, *scalars, segment_ids=None)` in `jax.shard_map` over batch and heads.

    q/k/v are (B, T, heads, e) sharded as P(batch_axes, None, head_axis, None); the output too.
    Extra positional arguments (λ) are replicated. kv heads are replicated when `num_kv_heads`
    does not divide by the head-axis size (MQA). Sub-head pairs (2h, 2h+1) stay on one shard
    because shards split the head axis into contiguous blocks.
    """
    n_head_shards = mesh.shape[head_axis] if head_axis else 1
    kv_axis = head_axis if (num_kv_heads is None or num_kv_heads % n_head_shards == 0) else None
    act = P(batch_axes, None, head_axis, None)
    kv = P(batch_axes, None, kv_axis, None)

    def wrapped(q, k, v, *scalars, segment_ids=None):
        seg_spec = () if segment_ids is None else (P(batch_axes, None),)
        in_specs = (act, kv, kv) + (P(),) * len(scalars) + seg_spec

        def body(q, k, v, *rest):
            seg = rest[len(scalars)] if segment_ids is not None else None
            return fn(q, k, v, *rest[: len(scalars)], segment_ids=seg)

        args = (q, k, v, *scalars) + (() if segment_ids is None else (segment_ids,))
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=act,
                             check_vma=False)(*args)

    return wrapped
