"""Flash attention with one or two softmax components, Pallas Mosaic lowering (TPU).

Same operator and model-side layouts as `kernels.flash_gpu` (nc = 2 differential, nc = 1
standard). Mosaic wants the last two block dims to be multiples of (8, 128) or the full array, so
the wrapper works head-major internally: q (B, H·nc, Tp, d), k (B, Hkv·nc, Sp, d),
v (B, Hkv, Sp, dv), with T and S padded up to the tiles (tiles are multiples of 128); the
logsumexps are lane-dense (B, H, nc, Tp). Padded keys are masked; padded queries read zeros and
are sliced off.

Head widths: any multiples of 16, d ≤ 256 and dv ≤ 512, as they are. The q/k/v blocks span the
whole head dim, which Mosaic accepts at any width (d = 96, dv = 192 included: XLA:TPU stores
such arrays in 128-lane tiles anyway), so the operands are not padded here; compiled for a v5p,
padding them to 128 lanes saves no memory.

Grids put the reduction axis last ("arbitrary") and keep float32 accumulators in VMEM scratch:
forward (B, H, nq, nk); dK/dV (B, Hkv, nk, n_rep·nq), computed transposed, sᵀ = K·Qᵀ, so that
lse and δ broadcast as lane-dense rows; dQ (B, H, nq, nk), reading lse and δ as columns. Causal
runs skip fully masked tiles, and their index maps clamp to the last useful tile (dK/dV: the
first, or the last q tile when none is) so that no DMA is issued for skipped tiles.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import cost

NEG_INF = -1e30
LANES = 128
_NT = (((1,), (1,)), ((), ()))  # a·bᵀ
_NN = (((1,), (0,)), ((), ()))  # a·b


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _tile(requested: int, n: int) -> int:
    """The request rounded up to a multiple of 128 lanes, no larger than n rounded up."""
    return min(_round_up(requested, LANES), _round_up(n, LANES))


def _div(a, n: int):
    """a // n for non-negative traced int32 a (lax.div: no sign op, which Mosaic lowers only on TPU)."""
    return lax.div(a, jnp.int32(n))


def _rem(a, n: int):
    return lax.rem(a, jnp.int32(n))


def _dot(a, b, dims):
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _keep(q_pos, k_pos, q_seg, k_seg, *, causal, s, pad_s):
    """Keep-mask for broadcastable query/key positions and segment ids; None if all kept."""
    mask = None
    if causal:
        mask = q_pos >= k_pos
    if q_seg is not None:
        seg = (q_seg == k_seg) & (q_seg != 0)
        mask = seg if mask is None else mask & seg
    if pad_s:
        inb = k_pos < s
        mask = inb if mask is None else mask & inb
    return mask


def _head_major(x, n):
    """(B, N, G, e) -> (B, G, Np, e), the sequence axis padded with zeros to n."""
    x = jnp.swapaxes(x, 1, 2)
    return jnp.pad(x, ((0, 0), (0, 0), (0, n - x.shape[2]), (0, 0)))


def _seq_major(x, n):
    """(B, G, Np, e) -> (B, n, G, e)."""
    return jnp.swapaxes(x[:, :, :n], 1, 2)


def _fwd_kernel(*refs, nc, causal, has_seg, scale, bq, bk, s, pad_s):
    q_ref, k_ref, v_ref, lam_ref, *refs = refs
    qs_ref, ks_ref, *refs = refs if has_seg else (None, None, *refs)
    o_ref, *refs = refs
    o2_ref, lse_ref, *scratch = refs if nc == 2 else (None, *refs)
    m_ref, l_ref, acc_ref = scratch  # (nc, bq, 128), (nc, bq, 128), (nc, bq, dv) float32
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, NEG_INF, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def step():
        q_pos = i * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
        k_pos = j * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
        mask = _keep(q_pos, k_pos, qs_ref[...] if has_seg else None,
                     ks_ref[...] if has_seg else None, causal=causal, s=s, pad_s=pad_s)
        v = v_ref[...]  # (bk, dv)
        for c in range(nc):
            sc = _dot(q_ref[c], k_ref[c], _NT) * scale  # (bq, bk)
            if mask is not None:
                sc = jnp.where(mask, sc, NEG_INF)
            m_prev = m_ref[c][:, :1]  # (bq, 1)
            m = jnp.maximum(m_prev, jnp.max(sc, axis=1, keepdims=True))
            p = jnp.exp(sc - m)
            if mask is not None:
                p = jnp.where(mask, p, 0.0)
            alpha = jnp.exp(m_prev - m)
            l_ref[c] = jnp.broadcast_to(l_ref[c][:, :1] * alpha + jnp.sum(p, axis=1, keepdims=True),
                                        (bq, LANES))
            m_ref[c] = jnp.broadcast_to(m, (bq, LANES))
            acc_ref[c] = acc_ref[c] * alpha + _dot(p.astype(v.dtype), v, _NN)

    if causal:
        pl.when(j * bk <= i * bq + bq - 1)(step)
    else:
        step()

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        outs = []
        for c in range(nc):
            l = l_ref[c][:, :1]
            seen = l > 0.0  # False on fully masked rows: output 0
            safe = jnp.where(seen, l, 1.0)
            outs.append(jnp.where(seen, acc_ref[c] / safe, 0.0))
            lse = jnp.where(seen, m_ref[c][:, :1] + jnp.log(safe), 0.0)  # (bq, 1)
            lse_ref[pl.ds(c, 1), :] = jnp.transpose(jnp.broadcast_to(lse, (bq, LANES)))[:1]
        o = outs[0]
        if nc == 2:
            o = o - lam_ref[0] * outs[1]
            o2_ref[...] = outs[1].astype(o2_ref.dtype)
        o_ref[...] = o.astype(o_ref.dtype)


def _clamp_kv(i, j, *, causal, bq, bk):
    """Last kv tile a causal q tile i needs: later grid steps re-use its block (no DMA)."""
    return jnp.minimum(j, _div(i * bq + bq - 1, bk)) if causal else j


def fwd(q: jax.Array, k: jax.Array, v: jax.Array, lam: jax.Array, q_seg: jax.Array | None,
        kv_seg: jax.Array | None, *, nc: int, causal: bool, block_q: int, block_k: int,
        interpret: Any) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """Returns (o (B,T,H,dv), o2 (B,T,H,dv) or None, lse (B,H,nc,T) float32).

    q (B, T, H·nc, d), k (B, S, Hkv·nc, d), v (B, S, Hkv, dv), lam a float32 scalar (read
    when nc = 2), q_seg (B, T) and kv_seg (B, S) int32 or None.
    """
    b, t, hq, d = q.shape
    s, hkv, dv = k.shape[1], v.shape[2], v.shape[3]
    h, n_rep = hq // nc, hq // nc // hkv
    bq, bk = _tile(block_q, t), _tile(block_k, s)
    tp, sp = _round_up(t, bq), _round_up(s, bk)
    has_seg = q_seg is not None
    kv = functools.partial(_clamp_kv, causal=causal, bq=bq, bk=bk)
    in_specs = [
        pl.BlockSpec((None, nc, bq, d), lambda b_, h_, i, j: (b_, h_, i, 0)),
        pl.BlockSpec((None, nc, bk, d), lambda b_, h_, i, j: (b_, _div(h_, n_rep), kv(i, j), 0)),
        pl.BlockSpec((None, None, bk, dv), lambda b_, h_, i, j: (b_, _div(h_, n_rep), kv(i, j), 0)),
        pl.BlockSpec(memory_space=pltpu.SMEM),
    ]
    args = [_head_major(q, tp), _head_major(k, sp), _head_major(v, sp),
            lam.reshape(1).astype(jnp.float32)]
    if has_seg:
        in_specs += [pl.BlockSpec((None, bq, 1), lambda b_, h_, i, j: (b_, i, 0)),
                     pl.BlockSpec((None, 1, bk), lambda b_, h_, i, j: (b_, 0, kv(i, j)))]
        args += [jnp.pad(q_seg, ((0, 0), (0, tp - t)))[:, :, None],
                 jnp.pad(kv_seg, ((0, 0), (0, sp - s)))[:, None, :]]
    o_spec = pl.BlockSpec((None, None, bq, dv), lambda b_, h_, i, j: (b_, h_, i, 0))
    out_specs = [o_spec] * (2 if nc == 2 else 1) + [
        pl.BlockSpec((None, None, nc, bq), lambda b_, h_, i, j: (b_, h_, 0, i))]
    out_shape = [jax.ShapeDtypeStruct((b, h, tp, dv), q.dtype)] * (2 if nc == 2 else 1) + [
        jax.ShapeDtypeStruct((b, h, nc, tp), jnp.float32)]
    res = pl.pallas_call(
        functools.partial(_fwd_kernel, nc=nc, causal=causal, has_seg=has_seg, scale=d**-0.5,
                          bq=bq, bk=bk, s=s, pad_s=sp != s),
        grid=(b, h, tp // bq, sp // bk),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((nc, bq, LANES), jnp.float32),
                        pltpu.VMEM((nc, bq, LANES), jnp.float32),
                        pltpu.VMEM((nc, bq, dv), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        cost_estimate=cost.fwd(q, k, v, nc=nc, causal=causal, bq=bq, bk=bk),
        name=f"flash{nc}_fwd",
    )(*args)
    o, lse = _seq_major(res[0], t), res[-1][..., :t]
    o2 = _seq_major(res[1], t) if nc == 2 else None
    return o, o2, lse


def _dkdv_kernel(*refs, nc, causal, has_seg, scale, bq, bk, s, pad_s, nq):
    q_ref, k_ref, v_ref, lam_ref, *refs = refs
    qs_ref, ks_ref, *refs = refs if has_seg else (None, None, *refs)
    do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_acc, dv_acc = refs
    j, ri = pl.program_id(2), pl.program_id(3)
    i = _rem(ri, nq)

    @pl.when(ri == 0)
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    def step():
        # Transposed tiles (bk, bq): rows are keys, columns queries.
        k_pos = j * bk + lax.broadcasted_iota(jnp.int32, (bk, bq), 0)
        q_pos = i * bq + lax.broadcasted_iota(jnp.int32, (bk, bq), 1)
        mask = _keep(q_pos, k_pos, qs_ref[...] if has_seg else None,
                     ks_ref[...] if has_seg else None, causal=causal, s=s, pad_s=pad_s)
        do = do_ref[...]  # (bq, dv)
        dpt = _dot(v_ref[...], do, _NT)  # (bk, bq): dP1ᵀ
        pts = []
        for c in range(nc):
            pt = jnp.exp(_dot(k_ref[c], q_ref[c], _NT) * scale - lse_ref[pl.ds(c, 1), :])
            pts.append(pt if mask is None else jnp.where(mask, pt, 0.0))
        lam = lam_ref[0] if nc == 2 else None
        pv = pts[0] - lam * pts[1] if nc == 2 else pts[0]
        dv_acc[...] += _dot(pv.astype(do.dtype), do, _NN)
        for c in range(nc):
            dpc = dpt if c == 0 else -lam * dpt
            dst = pts[c] * (dpc - delta_ref[pl.ds(c, 1), :])
            dk_acc[c] += _dot(dst.astype(q_ref.dtype), q_ref[c], _NN)

    if causal:
        pl.when(i * bq + bq - 1 >= j * bk)(step)
    else:
        step()

    @pl.when(ri == pl.num_programs(3) - 1)
    def _finish():
        dk_ref[...] = (dk_acc[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _dq_kernel(*refs, nc, causal, has_seg, scale, bq, bk, s, pad_s):
    q_ref, k_ref, v_ref, lam_ref, *refs = refs
    qs_ref, ks_ref, *refs = refs if has_seg else (None, None, *refs)
    do_ref, stats_ref, dq_ref, dq_acc = refs
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

    def step():
        q_pos = i * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
        k_pos = j * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
        mask = _keep(q_pos, k_pos, qs_ref[...] if has_seg else None,
                     ks_ref[...] if has_seg else None, causal=causal, s=s, pad_s=pad_s)
        stats = stats_ref[...]  # (bq, 2·nc): lse_c then δ_c, as columns
        dp = _dot(do_ref[...], v_ref[...], _NT)  # (bq, bk)
        for c in range(nc):
            kc = k_ref[c]
            p = jnp.exp(_dot(q_ref[c], kc, _NT) * scale - stats[:, c:c + 1])
            if mask is not None:
                p = jnp.where(mask, p, 0.0)
            dpc = dp if c == 0 else -lam_ref[0] * dp
            ds = p * (dpc - stats[:, nc + c:nc + c + 1])
            dq_acc[c] += _dot(ds.astype(kc.dtype), kc, _NN)

    if causal:
        pl.when(j * bk <= i * bq + bq - 1)(step)
    else:
        step()

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = (dq_acc[...] * scale).astype(dq_ref.dtype)


def bwd(q: jax.Array, k: jax.Array, v: jax.Array, lam: jax.Array, q_seg: jax.Array | None,
        kv_seg: jax.Array | None, do: jax.Array, lse: jax.Array, delta: jax.Array, *, nc: int,
        causal: bool, block_q: int, block_k: int, block_q_bwd: int, block_k_bwd: int,
        interpret: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns (dq, dk, dv). lse, delta: (B, H, nc, T) float32; do (B, T, H, dv); the rest as
    in `fwd`."""
    del block_q, block_k
    b, t, hq, d = q.shape
    s, hkv, dv = k.shape[1], v.shape[2], v.shape[3]
    h, n_rep = hq // nc, hq // nc // hkv
    bq, bk = _tile(block_q_bwd, t), _tile(block_k_bwd, s)
    tp, sp = _round_up(t, bq), _round_up(s, bk)
    nq, nk = tp // bq, sp // bk
    has_seg = q_seg is not None
    common = dict(nc=nc, causal=causal, has_seg=has_seg, scale=d**-0.5, bq=bq, bk=bk, s=s,
                  pad_s=sp != s)
    costs = dict(nc=nc, causal=causal, bq=bq, bk=bk)
    qh, kh, vh, doh = _head_major(q, tp), _head_major(k, sp), _head_major(v, sp), _head_major(do, tp)
    pad_t = ((0, 0), (0, 0), (0, 0), (0, tp - t))
    lse, delta = jnp.pad(lse, pad_t), jnp.pad(delta, pad_t)  # (B, H, nc, Tp)
    lam = lam.reshape(1).astype(jnp.float32)
    if has_seg:
        q_seg = jnp.pad(q_seg, ((0, 0), (0, tp - t)))
        kv_seg = jnp.pad(kv_seg, ((0, 0), (0, sp - s)))

    # dK, dV over (batch, kv head, kv tile, (query head of the group, q tile)).
    def qi(j, ri):
        # Causal: skipped q tiles re-use the first one on or below the diagonal; a kv tile past
        # every query (S > T) has none and reads the last q tile, so the block stays in bounds.
        if not causal:
            return _rem(ri, nq)
        return jnp.minimum(jnp.maximum(_rem(ri, nq), _div(j * bk, bq)), nq - 1)

    def head(g, ri):
        return g * n_rep + _div(ri, nq)

    in_specs = [
        pl.BlockSpec((None, nc, bq, d), lambda b_, g, j, ri: (b_, head(g, ri), qi(j, ri), 0)),
        pl.BlockSpec((None, nc, bk, d), lambda b_, g, j, ri: (b_, g, j, 0)),
        pl.BlockSpec((None, None, bk, dv), lambda b_, g, j, ri: (b_, g, j, 0)),
        pl.BlockSpec(memory_space=pltpu.SMEM),
    ]
    args = [qh, kh, vh, lam]
    if has_seg:
        in_specs += [pl.BlockSpec((None, 1, bq), lambda b_, g, j, ri: (b_, 0, qi(j, ri))),
                     pl.BlockSpec((None, bk, 1), lambda b_, g, j, ri: (b_, j, 0))]
        args += [q_seg[:, None, :], kv_seg[:, :, None]]
    stat = pl.BlockSpec((None, None, nc, bq), lambda b_, g, j, ri: (b_, head(g, ri), 0, qi(j, ri)))
    in_specs += [pl.BlockSpec((None, None, bq, dv),
                              lambda b_, g, j, ri: (b_, head(g, ri), qi(j, ri), 0)), stat, stat]
    args += [doh, lse, delta]
    dkh, dvh = pl.pallas_call(
        functools.partial(_dkdv_kernel, nq=nq, **common),
        grid=(b, hkv, nk, n_rep * nq),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, nc, bk, d), lambda b_, g, j, ri: (b_, g, j, 0)),
                   pl.BlockSpec((None, None, bk, dv), lambda b_, g, j, ri: (b_, g, j, 0))],
        out_shape=[jax.ShapeDtypeStruct(kh.shape, k.dtype), jax.ShapeDtypeStruct(vh.shape, v.dtype)],
        scratch_shapes=[pltpu.VMEM((nc, bk, d), jnp.float32), pltpu.VMEM((bk, dv), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        cost_estimate=cost.dkdv(q, k, v, **costs),
        name=f"flash{nc}_dkdv",
    )(*args)

    # dQ over (batch, head, q tile, kv tile); lse and δ as columns (bq, 2·nc).
    kv = functools.partial(_clamp_kv, causal=causal, bq=bq, bk=bk)
    stats_col = jnp.swapaxes(jnp.concatenate([lse, delta], axis=2), 2, 3)  # (B, H, Tp, 2nc)
    in_specs = [
        pl.BlockSpec((None, nc, bq, d), lambda b_, h_, i, j: (b_, h_, i, 0)),
        pl.BlockSpec((None, nc, bk, d), lambda b_, h_, i, j: (b_, _div(h_, n_rep), kv(i, j), 0)),
        pl.BlockSpec((None, None, bk, dv), lambda b_, h_, i, j: (b_, _div(h_, n_rep), kv(i, j), 0)),
        pl.BlockSpec(memory_space=pltpu.SMEM),
    ]
    args = [qh, kh, vh, lam]
    if has_seg:
        in_specs += [pl.BlockSpec((None, bq, 1), lambda b_, h_, i, j: (b_, i, 0)),
                     pl.BlockSpec((None, 1, bk), lambda b_, h_, i, j: (b_, 0, kv(i, j)))]
        args += [q_seg[:, :, None], kv_seg[:, None, :]]
    in_specs += [pl.BlockSpec((None, None, bq, dv), lambda b_, h_, i, j: (b_, h_, i, 0)),
                 pl.BlockSpec((None, None, bq, 2 * nc), lambda b_, h_, i, j: (b_, h_, i, 0))]
    args += [doh, stats_col]
    dqh = pl.pallas_call(
        functools.partial(_dq_kernel, **common),
        grid=(b, h, nq, nk),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, nc, bq, d), lambda b_, h_, i, j: (b_, h_, i, 0)),
        out_shape=jax.ShapeDtypeStruct(qh.shape, q.dtype),
        scratch_shapes=[pltpu.VMEM((nc, bq, d), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        cost_estimate=cost.dq(q, k, v, **costs),
        name=f"flash{nc}_dq",
    )(*args)
    return _seq_major(dqh, t), _seq_major(dkh, s), _seq_major(dvh, s)
