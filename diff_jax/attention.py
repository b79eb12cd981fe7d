"""Attention modules: DIFF V1 (reference-exact), DIFF V2, and the standard GQA baseline.

All three project, apply interleaved RoPE, and call the model's one attention op
(`diff_jax.attention_op.AttentionOp`: implementation, sharding, capture, decode); the
DIFF-specific parts around that call (λ, the per-head RMSNorm, the (1 − λ_init) scale, the V2
combine) live here. Weight layouts match the PyTorch
reference so that `diff_jax.interop` is a transpose.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import linen as nn

from diff_jax.attention_op import AttentionOp
from diff_jax.config import ModelConfig
from diff_jax.layers import RMSNorm, dense, residual_out_std
from diff_jax.rope import apply_rope, rope_tables

Rope = tuple[jax.Array, jax.Array]  # RoPE (cos, sin), each (B or 1, T, d/2)


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """The widths of one attention layer, d the (component) head width.

    The module projects x (B, T, E) to q (B, T, q_heads, d), k (B, T, k_heads, d) and
    v (B, T, v_heads, v_width); the op returns (B, T, op_heads, v_width); the output projection
    reads (B, T, out_width).
    """

    head_dim: int
    q_heads: int
    k_heads: int
    v_heads: int
    v_width: int
    op_heads: int
    out_width: int

    @property
    def attention_widths(self) -> tuple[int, int]:
        """(W_qk, W_v): the summed widths of one token's query·key and value products."""
        return self.q_heads * self.head_dim, self.op_heads * self.v_width


LAMBDA_VECTORS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")  # DIFF V1's λ parameters


def lambda_init(depth: int | jax.Array, fixed: float | None = None) -> jax.Array | float:
    """λ_init of the layer at 0-based index `depth`: `fixed` when given (`model.lambda_init`, one
    value for every layer, as the paper's Table 6 ablates 0.8 and 0.5), else the paper's
    0.8 − 0.6·exp(−0.3·depth) (depth 0 gives 0.2); a float for an int depth, else an array
    shaped like `depth`."""
    if fixed is not None:
        return fixed if isinstance(depth, int) else jnp.full_like(depth, fixed, jnp.float32)
    if isinstance(depth, int):
        return 0.8 - 0.6 * math.exp(-0.3 * depth)
    return 0.8 - 0.6 * jnp.exp(-0.3 * depth)


def diff_lambda(lambda_q1: jax.Array, lambda_k1: jax.Array, lambda_q2: jax.Array,
                lambda_k2: jax.Array, init: float) -> jax.Array:
    """The re-parameterised λ of one layer, a float32 scalar () from the four (d,) vectors and
    the layer's λ_init (`lambda_init`): exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + init."""
    f32 = jnp.float32
    l1 = jnp.exp(jnp.sum(lambda_q1.astype(f32) * lambda_k1.astype(f32)))
    l2 = jnp.exp(jnp.sum(lambda_q2.astype(f32) * lambda_k2.astype(f32)))
    return l1 - l2 + init


def _rope(cfg: ModelConfig, t: int, dim: int, rope: Rope | None, positions: jax.Array | None) -> Rope:
    if rope is not None:
        return rope
    if positions is None:
        positions = jnp.arange(t)
    return rope_tables(positions, dim, cfg.rope_theta)


def _project_qkv(
    module: AttentionBase, x: jax.Array, rope: Rope | None, positions: jax.Array | None,
    layout: HeadLayout,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x (B, T, E) -> q (B, T, q_heads, d) and k (B, T, k_heads, d) after RoPE, and
    v (B, T, v_heads, v_width): `module`'s q_proj / k_proj / v_proj for `layout`."""
    cfg: ModelConfig = module.config
    b, t, _ = x.shape
    d = layout.head_dim
    proj = dict(dtype=jnp.dtype(cfg.dtype), std=cfg.init_std)
    q = dense(layout.q_heads * d, ("embed", "heads"), name="q_proj", **proj)(x)
    k = dense(layout.k_heads * d, ("embed", "kv_heads"), name="k_proj", **proj)(x)
    v = dense(layout.v_heads * layout.v_width, ("embed", "kv_heads"), name="v_proj", **proj)(x)
    cos, sin = _rope(cfg, t, d, rope, positions)
    q = apply_rope(q.reshape(b, t, layout.q_heads, d), cos, sin)
    q = nn.with_logical_constraint(q, ("batch", "length", "act_heads", "head_dim"))
    k = apply_rope(k.reshape(b, t, layout.k_heads, d), cos, sin)
    return q, k, v.reshape(b, t, layout.v_heads, layout.v_width)


def _kv_cache(
    module: nn.Module, k: jax.Array, v: jax.Array, positions: jax.Array | None,
    segment_ids: jax.Array | None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Write k, v (B, T, ...) into the module's cache at `positions[:, 0]` (per row).

    The cache's rows and length are those of the `init` call's input (B, S); a call with other
    rows or T > S is a ValueError, and so are `segment_ids`: a row of the cache is one sequence
    (its entries keep no segments, so a later step could not honour them). A call with T > 1 is
    a prefill from position 0: it attends within its own tokens, never to the cache, so a prefill
    from another position (a prompt fed in chunks) is not supported: its tokens would not see the
    earlier ones. A call with T == 1 attends over the cache up to and including each row's
    position p: returns the cache and the (B,) filled lengths (p + 1). p must be in [0, S):
    positions are traced, so this cannot be an error; `dynamic_update_slice` clamps a write
    past the end onto the last entry, and `_attend` makes such a row's output NaN. `generate`
    sizes the cache to the longest prompt + max_new_tokens.
    """
    if segment_ids is not None:
        raise ValueError("segment_ids must be None with a KV cache (decode=True): each row of the "
                         "cache is one sequence, and its entries keep no segments")
    b, t = k.shape[:2]
    cache_k = module.variable("cache", "k", jnp.zeros, k.shape, k.dtype)
    cache_v = module.variable("cache", "v", jnp.zeros, v.shape, v.dtype)
    if module.is_initializing():
        return k, v, None
    capacity = cache_k.value.shape[:2]
    if b != capacity[0] or t > capacity[1]:
        raise ValueError(f"the KV cache holds {capacity[0]} rows of {capacity[1]} positions (the "
                         f"input `init` was called with); this call has {b} rows of {t} tokens")
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
        k, v, kv_lengths = _kv_cache(module, k, v, positions, segment_ids)
    if lam is not None and cfg.gqa_pairing == "naive" and k.shape[2] < q.shape[2]:
        # The naive reference repeats the 2·Hkv K sub-heads: Q sub-head j meets K sub-head
        # j // n_rep, and head h reads V head h // n_rep. Expanding to MHA expresses that
        # exactly in the `flash` layout the kernels take.
        n_rep = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, n_rep, axis=2), jnp.repeat(v, n_rep, axis=2)
    op = module.attention_op or AttentionOp.build(cfg)
    if module.decode and op.logit_bits is not None:
        raise ValueError("model.attn_logit_bits must be null with a KV cache (decode=True): its "
                         "absmax scale spans each whole score map, and a decode step sees one "
                         "query row of it (eval.py task=quant measures the full forward)")
    out, maps = op(q, k, v, lam, segment_ids=segment_ids, kv_lengths=kv_lengths)
    if kv_lengths is not None:  # a step's position outside the cache [0, S): NaN, not the
        # finite but wrong result of dynamic_update_slice's clamped write (traced: no error)
        inside = (kv_lengths >= 1) & (kv_lengths <= k.shape[1])
        out = jnp.where(inside[:, None, None, None], out, jnp.nan)
    if maps is not None:
        module.sow("intermediates", "attention", maps)
    return out


class AttentionBase(nn.Module):
    """x (B, T, E) -> (B, T, E): projections, RoPE, the model's attention op, `combine`, and the
    output projection; a subclass says how wide each part is (`layout`) and what `combine` does.

    Given: the model config, the 0-based layer index, whether it keeps a KV cache (see
    `_kv_cache`), and the attention op (None: built from the config, on the context mesh).
    """

    config: ModelConfig
    depth: int
    decode: bool = False
    attention_op: AttentionOp | None = None

    SUB_HEADS: ClassVar[int] = 1  # query sub-heads per configured head
    DIFFERENTIAL: ClassVar[bool] = False  # the op computes A1 − λ·A2 (λ a layer scalar)
    OUTPUT_PROJ: ClassVar[str] = "out_proj"  # the output projection's parameter name

    @classmethod
    def layout(cls, config: ModelConfig) -> HeadLayout:
        """The widths of this module for `config`."""
        h, kv, d = config.num_heads, config.kv_heads, config.resolved_head_dim
        pair = 2 if cls.DIFFERENTIAL else 1  # K1/K2 components and the [V1 | V2] width
        q_heads = cls.SUB_HEADS * h
        return HeadLayout(head_dim=d, q_heads=q_heads, k_heads=pair * kv, v_heads=kv,
                          v_width=pair * d, op_heads=h if cls.DIFFERENTIAL else q_heads,
                          out_width=h * pair * d)

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        *,
        rope: Rope | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """x (B, T, E) -> (B, T, E). `rope`: (cos, sin) tables (B or 1, T, d/2) (None: from
        `positions` (B, T), default 0..T-1); `segment_ids` (B, T) as in `AttentionOp`."""
        cfg = self.config
        q, k, v = _project_qkv(self, x, rope, positions, self.layout(cfg))
        o = self.combine(x, q, k, v, segment_ids=segment_ids, positions=positions)
        return dense(x.shape[-1], ("heads", "embed"), dtype=jnp.dtype(cfg.dtype),
                     std=residual_out_std(cfg), name=self.OUTPUT_PROJ)(o)

    def combine(self, x: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, *,
                segment_ids: jax.Array | None, positions: jax.Array | None) -> jax.Array:
        """Attention of the projected q, k, v (see `layout`) -> (B, T, out_width)."""
        o = _attend(self, q, k, v, lam=None, segment_ids=segment_ids, positions=positions)
        return o.reshape(*x.shape[:2], -1)


class MultiheadDiffAttn(AttentionBase):
    """DIFF attention V1: (softmax(Q1K1ᵀ/√d) − λ·softmax(Q2K2ᵀ/√d))·V, RMSNorm per head, ×(1−λ_init).

    q (B, T, 2H, d) with sub-heads 2h, 2h+1 = Q1, Q2 of head h; k (B, T, 2Hkv, d); v (B, T, Hkv, 2d).
    """

    SUB_HEADS: ClassVar[int] = 2
    DIFFERENTIAL: ClassVar[bool] = True

    def combine(self, x: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, *,
                segment_ids: jax.Array | None, positions: jax.Array | None) -> jax.Array:
        """(B, T, 2H·d): the differential heads, normalised (unless `model.head_norm` is false)
        and scaled by (1 − λ_init)."""
        cfg = self.config
        d, dtype = cfg.resolved_head_dim, jnp.dtype(cfg.dtype)
        # model.learn_lambda=false: the vectors start at zero (λ = λ_init) and get no gradient
        # (zero is a stationary point, exp(q·k)'s gradient being exp(q·k)·k; the stop holds λ
        # where train.init_from sets it)
        vec_init = nn.initializers.normal(0.1) if cfg.learn_lambda else nn.initializers.zeros
        vec = nn.with_logical_partitioning(vec_init, ("head_dim",))
        vectors = [self.param(n, vec, (d,), jnp.float32) for n in LAMBDA_VECTORS]
        if not cfg.learn_lambda:
            vectors = [jax.lax.stop_gradient(v) for v in vectors]
        init = lambda_init(self.depth, cfg.lambda_init)
        lam = diff_lambda(*vectors, init)
        o = _attend(self, q, k, v, lam=lam, segment_ids=segment_ids, positions=positions)  # (B, T, H, 2d)
        if cfg.head_norm:  # false: the paper's "w/o GroupNorm" ablation, the scale kept
            o = RMSNorm(eps=cfg.norm_eps, dtype=dtype, axis_name="head_dim",
                        scale_init=cfg.subln_init, name="subln")(o)
        # the constant in float32 and one rounding, as PyTorch's bf16 · Python float (bfloat16
        # holds 1 − λ_init only to ~4e-3: 0.5293 becomes 0.5273 at depth 2, a bias every token)
        o = (o.astype(jnp.float32) * (1.0 - init)).astype(dtype)
        return o.reshape(*x.shape[:2], -1)


class MultiheadDiffAttnV2(AttentionBase):
    """DIFF attention V2: 2h query heads in one attention; out_i = O[2i] − sigmoid(x W_λᵀ)_i·O[2i+1].

    q (B, T, 2h, d); k, v (B, T, Hkv, d); query heads 2i and 2i+1 share a kv group (Hkv divides h).
    """

    SUB_HEADS: ClassVar[int] = 2
    OUTPUT_PROJ: ClassVar[str] = "o_proj"

    def combine(self, x: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, *,
                segment_ids: jax.Array | None, positions: jax.Array | None) -> jax.Array:
        """(B, T, h·d): head pairs combined with the per-token λ (sown as `intermediates/lambda`),
        each head RMS-normalised when `model.v2_head_norm` (an ablation)."""
        cfg = self.config
        b, t, _ = x.shape
        h, d, dtype = cfg.num_heads, cfg.resolved_head_dim, jnp.dtype(cfg.dtype)
        o = _attend(self, q, k, v, lam=None, segment_ids=segment_ids, positions=positions)  # (B, T, 2h, d)
        lam = jax.nn.sigmoid(
            dense(h, ("embed", "heads"), dtype=dtype, std=cfg.init_std, name="lambda_proj")(x)
            .astype(jnp.float32)
        )  # (B, T, h)
        self.sow("intermediates", "lambda", lam)
        o = o.reshape(b, t, h, 2, d).astype(jnp.float32)
        o = o[:, :, :, 0] - lam[..., None] * o[:, :, :, 1]  # (B, T, h, d) float32
        if cfg.v2_head_norm:
            o = RMSNorm(eps=cfg.norm_eps, dtype=dtype, axis_name="head_dim",
                        scale_init=cfg.subln_init, name="subln")(o)
        return o.astype(dtype).reshape(b, t, h * d)


class MultiheadAttention(AttentionBase):
    """The Transformer baseline: standard causal GQA softmax attention with interleaved RoPE.

    q (B, T, H, d); k, v (B, T, Hkv, d).
    """
