"""Rotary position embedding, GPT-J interleaved pairs (2i, 2i+1), as the reference applies it."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_tables(positions: jax.Array, dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin tables (..., dim/2) float32 for integer `positions` (...), frequencies θ^(−2i/dim)."""
    if dim % 2:
        raise ValueError(f"RoPE needs an even head dim, got {dim}")
    inv_freq = theta ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)  # (dim/2,)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x (B, T, N, dim) by tables (T, dim/2) or (B or 1, T, dim/2) (any other shape: a
    ValueError); math in float32.

    out[2i] = x[2i]·cos_i − x[2i+1]·sin_i,  out[2i+1] = x[2i]·sin_i + x[2i+1]·cos_i.
    """
    b, t, n, dim = x.shape
    fits = ((t, dim // 2), (1, t, dim // 2), (b, t, dim // 2))
    if dim % 2 or sin.shape != cos.shape or cos.shape not in fits:
        raise ValueError(
            f"RoPE tables {cos.shape}/{sin.shape} do not fit x {x.shape}: need (T, {dim // 2}) or "
            f"(B or 1, T, {dim // 2}) with T = {t}, B = {b} (from `positions` (B, T), one per token)"
        )
    if cos.ndim == 2:
        cos, sin = cos[None], sin[None]
    cos = cos[:, :, None, :].astype(jnp.float32)  # (B|1, T, 1, dim/2)
    sin = sin[:, :, None, :].astype(jnp.float32)
    pairs = x.astype(jnp.float32).reshape(b, t, n, dim // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return rotated.reshape(b, t, n, dim).astype(x.dtype)
