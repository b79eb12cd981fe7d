"""Attention modules: DIFF V1 (reference-exact), DIFF V2, and the standard GQA baseline.

All three project, apply interleaved RoPE, and call the model's one attention op
(`diff_jax.attention_op.AttentionOp`: implementation, sharding, capture, decode); the
DIFF-specific parts around that call (λ, the per-head RMSNorm, the (1 − λ_init) scale, the V2
combine) live here. Weight layouts match the PyTorch
reference so that `diff_jax.interop` is a transpose.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from diff_jax.attention_op import AttentionOp
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


def _project_qkv(
    module: nn.Module,
    x: jax.Array,
    rope: Rope | None,
    positions: jax.Array | None,
    *,
    q_heads: int,
    k_heads: int,
    v_heads: int,
    v_width: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q (B,T,q_heads,d) and k (B,T,k_heads,d) after RoPE, v (B,T,v_heads,v_width): `module`'s
    q_proj/k_proj/v_proj, with d the configured (component) head width."""
    cfg: ModelConfig = module.config
    b, t, _ = x.shape
    d = cfg.resolved_head_dim
    proj = dict(dtype=jnp.dtype(cfg.dtype), std=cfg.init_std)
    q = dense(q_heads * d, ("embed", "heads"), name="q_proj", **proj)(x).reshape(b, t, q_heads, d)
    k = dense(k_heads * d, ("embed", "kv_heads"), name="k_proj", **proj)(x).reshape(b, t, k_heads, d)
    v = dense(v_heads * v_width, ("embed", "kv_heads"), name="v_proj", **proj)(x)
    cos, sin = _rope(cfg, t, d, rope, positions)
    q = nn.with_logical_constraint(apply_rope(q, cos, sin), ("batch", "length", "act_heads", "head_dim"))
    return q, apply_rope(k, cos, sin), v.reshape(b, t, v_heads, v_width)


def _out_std(cfg: ModelConfig) -> float:
    """Residual-branch output projections are scaled down by sqrt(2·layers) (GPT-2 style)."""
    return cfg.init_std / math.sqrt(2 * cfg.num_layers)


def _kv_cache(
    module: nn.Module, k: jax.Array, v: jax.Array, positions: jax.Array | None
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Write k, v (B, T, ...) into the module's cache at `positions[:, 0]` (per row).

    The cache length is the length of the `init` call's input. A call with T > 1 is a prefill
    from position 0: it attends within its own tokens. A call with T == 1 attends over the cache
    up to and including each row's position: returns the cache and the (B,) filled lengths
    (position + 1).
    """
    b, t = k.shape[:2]
    cache_k = module.variable("cache", "k", jnp.zeros, k.shape, k.dtype)
    cache_v = module.variable("cache", "v", jnp.zeros, v.shape, v.dtype)
    if module.is_initializing():
        return k, v, None
    if positions is None:
        raise ValueError("decoding needs explicit positions (B, T)")
    start = positions[:, 0].astype(jnp.int32)
    write = jax.vmap(lambda cache, new, i: jax.lax.dynamic_update_slice_in_dim(cache, new, i, 0))
    cache_k.value = write(cache_k.value, k, start)
    cache_v.value = write(cache_v.value, v, start)
    if t > 1:
        return k, v, None
    return cache_k.value, cache_v.value, start + 1


def _attend(
    module: AttentionBase,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    lam: jax.Array | None,
    segment_ids: jax.Array | None,
    positions: jax.Array | None,
) -> jax.Array:
    """The attention call of every module: cache, GQA pairing, then the model's attention op.

    `lam` selects differential attention (q (B,T,2H,d), k (B,S,2Hkv,d), v (B,S,Hkv,2d)); None
    selects standard attention. Maps the op returns (`AttentionOp.capture`) are sown as
    `intermediates/attention` for the analyses.
    """
    cfg: ModelConfig = module.config
    kv_lengths = None
    if module.decode:
        k, v, kv_lengths = _kv_cache(module, k, v, positions)
    if lam is not None and cfg.gqa_pairing == "naive" and k.shape[2] < q.shape[2]:
        # The naive reference repeats the 2·Hkv K sub-heads: Q sub-head j meets K sub-head
        # j // n_rep, and head h reads V head h // n_rep. Expanding to MHA expresses that
        # exactly in the `flash` layout the kernels take.
        n_rep = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, n_rep, axis=2), jnp.repeat(v, n_rep, axis=2)
    op = module.attention_op or AttentionOp.build(cfg)
    out, maps = op(q, k, v, lam, segment_ids=segment_ids, kv_lengths=kv_lengths)
    if maps is not None:
        module.sow("intermediates", "attention", maps)
    return out


class AttentionBase(nn.Module):
    """What every attention module is given: the model config, its 0-based layer index, whether
    it keeps a KV cache (see `_kv_cache`), and the attention op (None: built from the config,
    on the context mesh)."""

    config: ModelConfig
    depth: int
    decode: bool = False
    attention_op: AttentionOp | None = None


class MultiheadDiffAttn(AttentionBase):
    """DIFF attention V1: (softmax(Q1K1ᵀ/√d) − λ·softmax(Q2K2ᵀ/√d))·V, RMSNorm per head, ×(1−λ_init)."""

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
        q, k, v = _project_qkv(self, x, rope, positions, q_heads=2 * h, k_heads=2 * hkv,
                               v_heads=hkv, v_width=2 * d)
        vec = nn.with_logical_partitioning(nn.initializers.normal(0.1), ("head_dim",))
        lam = diff_lambda(
            *(self.param(n, vec, (d,), jnp.float32)
              for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")),
            self.depth,
        )
        o = _attend(self, q, k, v, lam=lam, segment_ids=segment_ids, positions=positions)  # (B, T, H, 2d)
        o = RMSNorm(eps=cfg.norm_eps, dtype=dtype, axis_name="head_dim", name="subln")(o)
        o = o * jnp.asarray(1.0 - lambda_init(self.depth), dtype)
        o = o.reshape(b, t, 2 * h * d)
        return dense(e, ("heads", "embed"), dtype=dtype, std=_out_std(cfg), name="out_proj")(o)


class MultiheadDiffAttnV2(AttentionBase):
    """DIFF attention V2: 2h query heads in one attention; out_i = O[2i] − sigmoid(x W_λᵀ)_i·O[2i+1]."""

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
        q, k, v = _project_qkv(self, x, rope, positions, q_heads=2 * h, k_heads=hkv, v_heads=hkv,
                               v_width=d)
        # (B, T, 2h, d); query heads 2i and 2i+1 share a kv group because h_kv divides h
        o = _attend(self, q, k, v, lam=None, segment_ids=segment_ids, positions=positions)
        lam = jax.nn.sigmoid(
            dense(h, ("embed", "heads"), dtype=dtype, std=cfg.init_std, name="lambda_proj")(x)
            .astype(jnp.float32)
        )  # (B, T, h)
        self.sow("intermediates", "lambda", lam)
        o = o.reshape(b, t, h, 2, d).astype(jnp.float32)
        o = (o[:, :, :, 0] - lam[..., None] * o[:, :, :, 1]).astype(dtype).reshape(b, t, h * d)
        return dense(e, ("heads", "embed"), dtype=dtype, std=_out_std(cfg), name="o_proj")(o)


class MultiheadAttention(AttentionBase):
    """The Transformer baseline: standard causal GQA softmax attention with interleaved RoPE."""

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
        q, k, v = _project_qkv(self, x, rope, positions, q_heads=h, k_heads=hkv, v_heads=hkv, v_width=d)
        o = _attend(self, q, k, v, lam=None, segment_ids=segment_ids, positions=positions)
        o = o.reshape(b, t, h * d)
        return dense(e, ("heads", "embed"), dtype=dtype, std=_out_std(cfg), name="out_proj")(o)


ATTENTION_MODULES: dict[str, type[AttentionBase]] = {
    "diff": MultiheadDiffAttn,
    "diff_v2": MultiheadDiffAttnV2,
    "transformer": MultiheadAttention,
}
