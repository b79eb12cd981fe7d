"""Attention modules: DIFF V1 (reference-exact), DIFF V2, and the standard GQA baseline.

All three project, apply interleaved RoPE, and call one attention function from `kernels`
(selected by `model.attention_impl`); the DIFF-specific parts around that call (λ, the per-head
RMSNorm, the (1 − λ_init) scale, the V2 combine) live here. Weight layouts match the PyTorch
reference so that `diff_jax.interop` is a transpose.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import linen as nn

import kernels
from diff_jax.config import ModelConfig
from diff_jax.layers import RMSNorm, dense
from diff_jax.rope import apply_rope, rope_tables

Rope = tuple[jax.Array, jax.Array]


def lambda_init(depth: int | jax.Array) -> jax.Array | float:
    """λ_init = 0.8 − 0.6·exp(−0.3·depth), 0-based layer index (depth 0 gives 0.2)."""
    if isinstance(depth, int):
        return 0.8 - 0.6 * math.exp(-0.3 * depth)
    return 0.8 - 0.6 * jnp.exp(-0.3 * depth)


def diff_lambda(lambda_q1, lambda_k1, lambda_q2, lambda_k2, depth: int) -> jax.Array:
    """The re-parameterised λ of one layer, a float32 scalar."""
    f32 = jnp.float32
    l1 = jnp.exp(jnp.sum(lambda_q1.astype(f32) * lambda_k1.astype(f32)))
    l2 = jnp.exp(jnp.sum(lambda_q2.astype(f32) * lambda_k2.astype(f32)))
    return l1 - l2 + lambda_init(depth)


def _rope(cfg: ModelConfig, t: int, dim: int, rope: Rope | None, positions: jax.Array | None) -> Rope:
    if rope is not None:
        return rope
    if positions is None:
        positions = jnp.arange(t)
    return rope_tables(positions, dim, cfg.rope_theta)


def _out_std(cfg: ModelConfig) -> float:
    """Residual-branch output projections are scaled down by sqrt(2·layers) (GPT-2 style)."""
    return cfg.init_std / math.sqrt(2 * cfg.num_layers)


class MultiheadDiffAttn(nn.Module):
    """DIFF attention V1: (softmax(Q1K1ᵀ/√d) − λ·softmax(Q2K2ᵀ/√d))·V, RMSNorm per head, ×(1−λ_init)."""

    config: ModelConfig
    depth: int

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        *,
        rope: Rope | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        cfg = self.config
        b, t, e = x.shape
        h, hkv, d = cfg.num_heads, cfg.kv_heads, cfg.resolved_head_dim
        dtype = jnp.dtype(cfg.dtype)
        proj = dict(dtype=dtype, std=cfg.init_std)
        q = dense(2 * h * d, ("embed", "heads"), name="q_proj", **proj)(x).reshape(b, t, 2 * h, d)
        k = dense(2 * hkv * d, ("embed", "kv_heads"), name="k_proj", **proj)(x)
        k = k.reshape(b, t, 2 * hkv, d)
        v = dense(2 * hkv * d, ("embed", "kv_heads"), name="v_proj", **proj)(x)
        v = v.reshape(b, t, hkv, 2 * d)
        cos, sin = _rope(cfg, t, d, rope, positions)
        q = nn.with_logical_constraint(apply_rope(q, cos, sin), ("batch", "length", "act_heads", "head_dim"))
        k = apply_rope(k, cos, sin)

        vec = nn.with_logical_partitioning(nn.initializers.normal(0.1), ("head_dim",))
        lam = diff_lambda(
            *(self.param(n, vec, (d,), jnp.float32)
              for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")),
            self.depth,
        )
        if cfg.gqa_pairing == "naive" and hkv < h:
            # The naive reference repeats the 2·Hkv K sub-heads: Q sub-head j meets K sub-head
            # j // n_rep, and head h reads V head h // n_rep. Expanding to MHA expresses that
            # exactly in the `flash` layout the kernel takes.
            n_rep = h // hkv
            k, v = jnp.repeat(k, n_rep, axis=2), jnp.repeat(v, n_rep, axis=2)
        o = kernels.diff_attention(
            q, k, v, lam, segment_ids=segment_ids, causal=True, impl=cfg.attention_impl
        )  # (B, T, H, 2d)
        o = RMSNorm(eps=cfg.norm_eps, dtype=dtype, axis_name="head_dim", name="subln")(o)
        o = o * jnp.asarray(1.0 - lambda_init(self.depth), dtype)
        o = o.reshape(b, t, 2 * h * d)
        return dense(e, ("heads", "embed"), dtype=dtype, std=_out_std(cfg), name="out_proj")(o)


class MultiheadDiffAttnV2(nn.Module):
    """DIFF attention V2: 2h query heads in one attention; out_i = O[2i] − sigmoid(x W_λᵀ)_i·O[2i+1]."""

    config: ModelConfig
    depth: int

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        *,
        rope: Rope | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        cfg = self.config
        b, t, e = x.shape
        h, hkv, d = cfg.num_heads, cfg.kv_heads, cfg.resolved_head_dim
        dtype = jnp.dtype(cfg.dtype)
        proj = dict(dtype=dtype, std=cfg.init_std)
        q = dense(2 * h * d, ("embed", "heads"), name="q_proj", **proj)(x).reshape(b, t, 2 * h, d)
        k = dense(hkv * d, ("embed", "kv_heads"), name="k_proj", **proj)(x).reshape(b, t, hkv, d)
        v = dense(hkv * d, ("embed", "kv_heads"), name="v_proj", **proj)(x).reshape(b, t, hkv, d)
        cos, sin = _rope(cfg, t, d, rope, positions)
        q = nn.with_logical_constraint(apply_rope(q, cos, sin), ("batch", "length", "act_heads", "head_dim"))
        k = apply_rope(k, cos, sin)
        o = kernels.dot_product_attention(
            q, k, v, segment_ids=segment_ids, causal=True, impl=cfg.attention_impl
        )  # (B, T, 2h, d); query heads 2i and 2i+1 share a kv group because h_kv divides h
        lam = jax.nn.sigmoid(
            dense(h, ("embed", "heads"), name="lambda_proj", **proj)(x).astype(jnp.float32)
        )  # (B, T, h)
        o = o.reshape(b, t, h, 2, d).astype(jnp.float32)
        o = (o[:, :, :, 0] - lam[..., None] * o[:, :, :, 1]).astype(dtype).reshape(b, t, h * d)
        return dense(e, ("heads", "embed"), dtype=dtype, std=_out_std(cfg), name="o_proj")(o)


class MultiheadAttention(nn.Module):
    """The Transformer baseline: standard causal GQA softmax attention with interleaved RoPE."""

    config: ModelConfig
    depth: int

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        *,
        rope: Rope | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        cfg = self.config
        b, t, e = x.shape
        h, hkv, d = cfg.num_heads, cfg.kv_heads, cfg.resolved_head_dim
        dtype = jnp.dtype(cfg.dtype)
        proj = dict(dtype=dtype, std=cfg.init_std)
        q = dense(h * d, ("embed", "heads"), name="q_proj", **proj)(x).reshape(b, t, h, d)
        k = dense(hkv * d, ("embed", "kv_heads"), name="k_proj", **proj)(x).reshape(b, t, hkv, d)
        v = dense(hkv * d, ("embed", "kv_heads"), name="v_proj", **proj)(x).reshape(b, t, hkv, d)
        cos, sin = _rope(cfg, t, d, rope, positions)
        q = nn.with_logical_constraint(apply_rope(q, cos, sin), ("batch", "length", "act_heads", "head_dim"))
        k = apply_rope(k, cos, sin)
        o = kernels.dot_product_attention(
            q, k, v, segment_ids=segment_ids, causal=True, impl=cfg.attention_impl
        ).reshape(b, t, h * d)
        return dense(e, ("heads", "embed"), dtype=dtype, std=_out_std(cfg), name="out_proj")(o)


ATTENTION_MODULES: dict[str, type[nn.Module]] = {
    "diff": MultiheadDiffAttn,
    "diff_v2": MultiheadDiffAttnV2,
    "transformer": MultiheadAttention,
}
