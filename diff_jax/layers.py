"""Building blocks: RMSNorm, SwiGLU feed-forward, and the projection helper they share."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from diff_jax.config import ModelConfig


def dense(
    features: int,
    axes: tuple[str, str],
    *,
    dtype: jnp.dtype,
    std: float,
    name: str,
) -> nn.Dense:
    """A bias-free projection with a float32 kernel (in, out) named by logical `axes`."""
    return nn.Dense(
        features,
        use_bias=False,
        dtype=dtype,
        param_dtype=jnp.float32,
        kernel_init=nn.with_logical_partitioning(nn.initializers.normal(std), axes),
        name=name,
    )


def residual_out_std(cfg: ModelConfig) -> float:
    """Init std of the projections that write into the residual stream (attention output, MLP
    down): init_std/sqrt(2·num_layers) under `model.output_init=scaled` (GPT-2), else init_std."""
    if cfg.output_init == "scaled":
        return cfg.init_std / math.sqrt(2 * cfg.num_layers)
    return cfg.init_std


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · scale over the last axis; the core runs in float32. The scale
    starts at `scale_init` (1: the identity scale)."""

    eps: float = 1e-5
    dtype: jnp.dtype = jnp.float32
    axis_name: str = "norm"
    scale_init: float = 1.0  # not `init`: that is Module.init

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """x (..., D) -> (..., D) in `dtype`, with a learned scale (D,) float32."""
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.constant(self.scale_init),
                                                  (self.axis_name,)),
            (x.shape[-1],), jnp.float32,
        )
        xf = x.astype(jnp.float32)
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (normed.astype(self.dtype) * scale.astype(self.dtype)).astype(self.dtype)


class SwiGLU(nn.Module):
    """(swish(x W_gate) ∘ x W_up) W_down, no biases."""

    hidden_dim: int
    dtype: jnp.dtype = jnp.float32
    init_std: float = 0.02
    out_std: float = 0.02

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """x (B, T, E) -> (B, T, E) through a (B, T, hidden_dim) gated layer."""
        e = x.shape[-1]
        gate = dense(self.hidden_dim, ("embed", "mlp"), dtype=self.dtype, std=self.init_std,
                     name="w_gate")(x)
        up = dense(self.hidden_dim, ("embed", "mlp"), dtype=self.dtype, std=self.init_std,
                   name="w_up")(x)
        h = nn.with_logical_constraint(nn.silu(gate) * up, ("batch", "length", "act_mlp"))
        return dense(e, ("mlp", "embed"), dtype=self.dtype, std=self.out_std, name="w_down")(h)
