"""Cost estimates (`pl.CostEstimate`) for the flash kernels' `pallas_call`s, GPU and TPU alike.

A Pallas custom call counts 0 FLOPs in XLA's cost analysis unless it carries an estimate. These
count the work a kernel really does: the (q tile, kv tile) pairs it visits (a causal run skips
the tiles wholly above the diagonal, about half), with full tiles (bq × bk, ragged tails
included) and the widths of the arrays it multiplies (the Triton kernels' power-of-two padded
widths). FLOPs are the matmuls' (a multiply-add = 2), transcendentals the exps of the score
tiles, bytes the tiles loaded from and the arrays written to memory (segment ids not counted).

Arguments are the kernel's operands in the model layout: q (B, T, H·nc, d), k (B, S, Hkv·nc, d),
v (B, S, Hkv, dv); only their shapes and dtypes are read.
"""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl

F32 = 4  # bytes of the float32 logsumexp and δ rows


def visited_tiles(t: int, s: int, bq: int, bk: int, causal: bool) -> int:
    """(q tile i, kv tile j) pairs a kernel visits: all, or when causal those with
    j·bk ≤ i·bq + bq − 1 (a key at or before the tile's last query)."""
    nq, nk = pl.cdiv(t, bq), pl.cdiv(s, bk)
    if not causal:
        return nq * nk
    return sum(min(nk, (i * bq + bq - 1) // bk + 1) for i in range(nq))


def _dims(q, k, v, nc):
    b, t, hq, d = q.shape
    s, hkv, dv = k.shape[1], v.shape[2], v.shape[3]
    return b, t, s, hq // nc, hkv, d, dv, q.dtype.itemsize


def fwd(q: jax.Array, k: jax.Array, v: jax.Array, *, nc: int, causal: bool, bq: int,
        bk: int) -> pl.CostEstimate:
    """Forward: nc score tiles (2·d per pair each) and nc P·V products (2·dv each) per pair."""
    b, t, s, h, _, d, dv, isz = _dims(q, k, v, nc)
    tiles = b * h * visited_tiles(t, s, bq, bk, causal)
    pairs = tiles * bq * bk
    return pl.CostEstimate(
        flops=2 * pairs * nc * (d + dv),
        transcendentals=pairs * nc,
        bytes_accessed=isz * (b * t * h * nc * (d + dv) + tiles * bk * (nc * d + dv))
        + F32 * b * h * nc * t,
    )


def dkdv(q: jax.Array, k: jax.Array, v: jax.Array, *, nc: int, causal: bool, bq: int,
         bk: int) -> pl.CostEstimate:
    """dK/dV: dP = dO·Vᵀ and dV += (P1 − λP2)ᵀ·dO (2·dv each), nc recomputed scores and dKc
    products (2·d each) per pair; q, dO, lse and δ tiles are loaded per tile pair."""
    b, t, s, h, hkv, d, dv, isz = _dims(q, k, v, nc)
    tiles = b * h * visited_tiles(t, s, bq, bk, causal)
    pairs = tiles * bq * bk
    return pl.CostEstimate(
        flops=4 * pairs * (dv + nc * d),
        transcendentals=pairs * nc,
        bytes_accessed=tiles * bq * (isz * (nc * d + dv) + 2 * F32 * nc)
        + 2 * isz * b * s * hkv * (nc * d + dv),
    )


def dq(q: jax.Array, k: jax.Array, v: jax.Array, *, nc: int, causal: bool, bq: int,
       bk: int) -> pl.CostEstimate:
    """dQ: dP = dO·Vᵀ (2·dv) and nc recomputed scores and dQc products (2·d each) per pair."""
    b, t, s, h, _, d, dv, isz = _dims(q, k, v, nc)
    tiles = b * h * visited_tiles(t, s, bq, bk, causal)
    pairs = tiles * bq * bk
    return pl.CostEstimate(
        flops=2 * pairs * (dv + 2 * nc * d),
        transcendentals=pairs * nc,
        bytes_accessed=isz * (tiles * bk * (nc * d + dv) + b * t * h * (2 * nc * d + dv))
        + 2 * F32 * b * h * nc * t,
    )
