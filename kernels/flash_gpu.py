"""Flash attention with one or two softmax components, Pallas Triton lowering (GPU).

One kernel family serves both operators (see `kernels.flash`):
  nc = 2: differential attention, O = P1·V − λ·P2·V (q sub-heads 2h, 2h+1; k sub-heads 2g, 2g+1);
  nc = 1: standard attention, O = P·V.
Layouts are the model's, no copies (but for the lane padding below): q (B, T, H·nc, d),
k (B, S, Hkv·nc, d), v (B, S, Hkv, dv), segment ids (B, T) / (B, S); head h reads kv group
g = h // (H // Hkv).

Head widths: any multiples of 16, d ≤ 256 and dv ≤ 512. Triton tiles must be powers of two, so
the wrappers zero-pad the head dims of q, k, v (and dO) to the next power of two (d = 96 -> 128,
dv = 192 -> 256) and slice the outputs and gradients back; the kernels see only power-of-two
widths. Zero lanes are exact: they add 0 to q·k, and the extra output columns are dropped. The
softmax scale is the true d^-1/2, passed to the kernels. Padding costs a copy of the operands
and results, O(T·d) next to the kernels' O(T²·d) work, and only when a width is not a power of
two; masked lane loads would avoid it at the price of a lane mask on every load and store in the
kernels (and NaN-padded blocks under the interpreter).

Triton rules honoured here: every loaded tile is a power of two (block_q, block_k, d, dv), and
Triton does no bounds checks, so ragged tails are loaded and stored with masks. The kv and
whole-sequence q operands are given blocks padded up to a multiple of the tile, which makes the
CPU interpreter (which pads partial blocks) index the same rows as the GPU.

Forward: one pass over K/V tiles per (batch, head, q tile) with nc online softmaxes that share
each V tile. Backward: a dK/dV kernel per (batch, kv head, kv tile) that loops over the group's
query heads and q tiles, and a dQ kernel per (batch, head, q tile); both recompute P from the
saved logsumexps. δ (rowsum(dO∘O_c) with the λ terms) is computed outside, by XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import cost

NEG_INF = -1e30


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _tile(requested: int, n: int) -> int:
    """Power-of-two tile ≤ requested (rounded down), no larger than n rounded up to a power of
    two, ≥ 16."""
    return max(16, min(1 << (requested.bit_length() - 1), pl.next_power_of_2(n)))


def lanes(n: int) -> int:
    """The power-of-two width a head dim of n is padded to (n itself when a power of two)."""
    return pl.next_power_of_2(n)


def _pad_lanes(x, n: int):
    """x with its last dim zero-padded to n (x itself when it is n wide)."""
    if x.shape[-1] == n:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n - x.shape[-1])])


def _index(idx):
    # Integer indices as int32 scalars: the Pallas interpreter's masked load takes no Python ints.
    return tuple(jnp.int32(i) if isinstance(i, int) else i for i in idx)


def _load(ref, idx, mask):
    """ref[idx], with rows outside the array read as 0 when `mask` is given."""
    idx = _index(idx)
    if mask is None:
        return ref[idx]
    return plgpu.load(ref.at[idx], mask=mask, other=0)


def _store(ref, idx, val, mask):
    idx = _index(idx)
    if mask is None:
        ref[idx] = val
    else:
        plgpu.store(ref.at[idx], val, mask=mask)


def _dot(a, b, *, ta=False, tb=False):
    """float32-accumulated a·b with optional transposes (a: (m, k) or (k, m) when ta)."""
    dims = (((0,) if ta else (1,), (1,) if tb else (0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _valid(rows, cols, qs, ks, *, causal, s):
    """(bq, bk) keep-mask from causal / segment / ragged key-bound rules, or None if all kept."""
    mask = None

    def both(a, b):
        return b if a is None else a & b

    if causal:
        mask = both(mask, rows[:, None] >= cols[None, :])
    if qs is not None:
        mask = both(mask, (qs[:, None] == ks[None, :]) & (qs[:, None] != 0))
    if s is not None:
        mask = both(mask, jnp.broadcast_to(cols[None, :] < s, (rows.shape[0], cols.shape[0])))
    return mask


def _kv_range(i, *, causal, has_seg, bq, bk, s):
    """kv tiles [0, lo) need no mask, [lo, hi) do (diagonal, segments, ragged tail)."""
    n_kv = pl.cdiv(s, bk)
    hi = jnp.minimum(n_kv, pl.cdiv((i + 1) * bq, bk)) if causal else n_kv
    if has_seg:
        return 0, hi
    lo = jnp.minimum(s // bk, (i * bq + 1) // bk) if causal else s // bk
    return jnp.minimum(lo, hi), hi


def _fwd_kernel(*refs, nc, causal, has_seg, scale, bq, bk, t, s):
    q_ref, k_ref, v_ref, lam_ref, *refs = refs
    qs_ref, ks_ref, *refs = refs if has_seg else (None, None, *refs)
    o_ref, *refs = refs
    o2_ref, lse_ref = refs if nc == 2 else (None, *refs)
    i = pl.program_id(2)
    rows = i * bq + lax.iota(jnp.int32, bq)
    rmask = (rows < t)[:, None] if t % bq else None
    smask_needed = s % bk != 0
    qc = [_load(q_ref, (slice(None), c, slice(None)), rmask) for c in range(nc)]  # nc × (bq, d)
    qs = _load(qs_ref, (slice(None),), rmask[:, 0] if rmask is not None else None) if has_seg else None
    dv = v_ref.shape[-1]

    def body(j, carry, masked):
        accs, ms, ls = carry
        cols = j * bk + lax.iota(jnp.int32, bk)
        cmask = (cols < s)[:, None] if smask_needed and masked else None
        win = pl.ds(j * bk, bk)
        v = _load(v_ref, (win, slice(None)), cmask)  # (bk, dv)
        ks = _load(ks_ref, (win,), cmask[:, 0] if cmask is not None else None) if has_seg else None
        mask = _valid(rows, cols, qs, ks, causal=causal,
                      s=s if smask_needed else None) if masked else None
        new = ([], [], [])
        for c in range(nc):
            kc = _load(k_ref, (win, c, slice(None)), cmask)  # (bk, d)
            sc = _dot(qc[c], kc, tb=True) * scale  # (bq, bk) f32
            if mask is not None:
                sc = jnp.where(mask, sc, NEG_INF)
            m = jnp.maximum(ms[c], jnp.max(sc, axis=1))
            p = jnp.exp(sc - m[:, None])
            if mask is not None:
                p = jnp.where(mask, p, 0.0)
            alpha = jnp.exp(ms[c] - m)
            new[0].append(accs[c] * alpha[:, None] + _dot(p.astype(v.dtype), v))
            new[1].append(m)
            new[2].append(ls[c] * alpha + jnp.sum(p, axis=1))
        return tuple(map(tuple, new))

    lo, hi = _kv_range(i, causal=causal, has_seg=has_seg, bq=bq, bk=bk, s=s)
    init = (
        tuple(jnp.zeros((bq, dv), jnp.float32) for _ in range(nc)),
        tuple(jnp.full((bq,), NEG_INF, jnp.float32) for _ in range(nc)),
        tuple(jnp.zeros((bq,), jnp.float32) for _ in range(nc)),
    )
    carry = lax.fori_loop(0, lo, functools.partial(body, masked=False), init)
    accs, ms, ls = lax.fori_loop(lo, hi, functools.partial(body, masked=True), carry)
    outs = []
    for c in range(nc):
        seen = ls[c] > 0.0  # False on fully masked rows: output 0
        inv = jnp.where(seen, 1.0 / jnp.where(seen, ls[c], 1.0), 0.0)
        outs.append(accs[c] * inv[:, None])
        lse = jnp.where(seen, ms[c] + jnp.log(jnp.where(seen, ls[c], 1.0)), 0.0)
        _store(lse_ref, (c, slice(None)), lse, rmask[:, 0] if rmask is not None else None)
    o = outs[0]
    if nc == 2:
        o = o - lam_ref[0] * outs[1]
        _store(o2_ref, (slice(None), slice(None)), outs[1].astype(o2_ref.dtype), rmask)
    _store(o_ref, (slice(None), slice(None)), o.astype(o_ref.dtype), rmask)


def fwd(q: jax.Array, k: jax.Array, v: jax.Array, lam: jax.Array, q_seg: jax.Array | None,
        kv_seg: jax.Array | None, *, nc: int, causal: bool, block_q: int, block_k: int,
        num_warps: int, num_stages: int,
        interpret: bool) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """Returns (o (B,T,H,dv), o2 (B,T,H,dv) or None, lse (B,H,nc,T) float32).

    q (B, T, H·nc, d), k (B, S, Hkv·nc, d), v (B, S, Hkv, dv), lam a float32 scalar (read
    when nc = 2), q_seg (B, T) and kv_seg (B, S) int32 or None.
    """
    b, t, hq, d_true = q.shape
    s, hkv, dv_true = k.shape[1], v.shape[2], v.shape[3]
    h, n_rep = hq // nc, hq // nc // hkv
    d, dv = lanes(d_true), lanes(dv_true)
    q, k, v = _pad_lanes(q, d), _pad_lanes(k, d), _pad_lanes(v, dv)
    bq, bk = _tile(block_q, t), _tile(block_k, s)
    sp = _round_up(s, bk)
    has_seg = q_seg is not None
    kernel = functools.partial(_fwd_kernel, nc=nc, causal=causal, has_seg=has_seg,
                               scale=d_true**-0.5, bq=bq, bk=bk, t=t, s=s)
    in_specs = [
        pl.BlockSpec((None, bq, nc, d), lambda b_, h_, i: (b_, i, h_, 0)),
        pl.BlockSpec((None, sp, nc, d), lambda b_, h_, i: (b_, 0, h_ // n_rep, 0)),
        pl.BlockSpec((None, sp, None, dv), lambda b_, h_, i: (b_, 0, h_ // n_rep, 0)),
        pl.BlockSpec((1,), lambda b_, h_, i: (0,)),
    ]
    args = [q, k, v, lam.reshape(1).astype(jnp.float32)]
    if has_seg:
        in_specs += [pl.BlockSpec((None, bq), lambda b_, h_, i: (b_, i)),
                     pl.BlockSpec((None, sp), lambda b_, h_, i: (b_, 0))]
        args += [q_seg, kv_seg]
    o_spec = pl.BlockSpec((None, bq, None, dv), lambda b_, h_, i: (b_, i, h_, 0))
    out_shape = [jax.ShapeDtypeStruct((b, t, h, dv), q.dtype)]
    out_specs = [o_spec]
    if nc == 2:
        out_shape.append(jax.ShapeDtypeStruct((b, t, h, dv), q.dtype))
        out_specs.append(o_spec)
    out_shape.append(jax.ShapeDtypeStruct((b, h, nc, t), jnp.float32))
    out_specs.append(pl.BlockSpec((None, None, nc, bq), lambda b_, h_, i: (b_, h_, 0, i)))
    res = pl.pallas_call(
        kernel,
        grid=(b, h, pl.cdiv(t, bq)),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        cost_estimate=cost.fwd(q, k, v, nc=nc, causal=causal, bq=bq, bk=bk),
        name=f"flash{nc}_fwd",
    )(*args)
    o, lse = res[0][..., :dv_true], res[-1]
    return o, res[1][..., :dv_true] if nc == 2 else None, lse


def _dkdv_kernel(*refs, nc, causal, has_seg, scale, bq, bk, t, s, n_rep):
    q_ref, k_ref, v_ref, lam_ref, *refs = refs
    qs_ref, ks_ref, *refs = refs if has_seg else (None, None, *refs)
    do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs
    j = pl.program_id(2)
    cols = j * bk + lax.iota(jnp.int32, bk)
    cmask = (cols < s)[:, None] if s % bk else None
    rag_t = t % bq != 0
    kc = [_load(k_ref, (slice(None), c, slice(None)), cmask) for c in range(nc)]  # (bk, d)
    v = _load(v_ref, (slice(None), slice(None)), cmask)  # (bk, dv)
    ks = _load(ks_ref, (slice(None),), cmask[:, 0] if cmask is not None else None) if has_seg else None
    lam = lam_ref[0] if nc == 2 else None
    d, dv = kc[0].shape[1], v.shape[1]

    def body(i, carry, r, masked):
        dks, dvacc = carry
        rows = i * bq + lax.iota(jnp.int32, bq)
        rmask = (rows < t) if rag_t else None
        rm2 = rmask[:, None] if rag_t else None
        win = pl.ds(i * bq, bq)
        qs = _load(qs_ref, (win,), rmask) if has_seg else None
        # No bound masks: padded query rows load q = dO = lse = δ = 0 and contribute exactly 0,
        # and padded key rows only feed dK/dV rows that are never stored.
        mask = _valid(rows, cols, qs, ks, causal=causal, s=None) if masked else None
        do = _load(do_ref, (win, r, slice(None)), rm2)  # (bq, dv)
        dp = _dot(do, v, tb=True)  # (bq, bk): dP1 (= −dP2 / λ)
        qcs, ps = [], []
        for c in range(nc):
            qc = _load(q_ref, (win, r * nc + c, slice(None)), rm2)  # (bq, d)
            lse = _load(lse_ref, (r, c, win), rmask)  # (bq,)
            p = jnp.exp(_dot(qc, kc[c], tb=True) * scale - lse[:, None])
            if mask is not None:
                p = jnp.where(mask, p, 0.0)
            qcs.append(qc)
            ps.append(p)
        pv = ps[0] - lam * ps[1] if nc == 2 else ps[0]
        dvacc = dvacc + _dot(pv.astype(do.dtype), do, ta=True)  # (bk, dv)
        new_dks = []
        for c in range(nc):
            delta = _load(delta_ref, (r, c, win), rmask)
            dpc = dp if c == 0 else -lam * dp
            ds = ps[c] * (dpc - delta[:, None])
            new_dks.append(dks[c] + _dot(ds.astype(qcs[c].dtype), qcs[c], ta=True))  # (bk, d)
        return tuple(new_dks), dvacc

    n_q = pl.cdiv(t, bq)
    lo = (j * bk) // bq if causal else 0
    if has_seg:
        mid = n_q
    elif causal:  # q tiles from `mid` on lie wholly on or below the diagonal
        mid = jnp.minimum(n_q, pl.cdiv((j + 1) * bk - 1, bq))
    else:
        mid = lo

    def per_head(r, cr):
        cr = lax.fori_loop(lo, mid, functools.partial(body, r=r, masked=True), cr)
        return lax.fori_loop(mid, n_q, functools.partial(body, r=r, masked=False), cr)

    carry = (tuple(jnp.zeros((bk, d), jnp.float32) for _ in range(nc)),
             jnp.zeros((bk, dv), jnp.float32))
    dks, dvacc = lax.fori_loop(0, n_rep, per_head, carry)  # the group's query heads, q tiles
    for c in range(nc):
        _store(dk_ref, (slice(None), c, slice(None)), (dks[c] * scale).astype(dk_ref.dtype), cmask)
    _store(dv_ref, (slice(None), slice(None)), dvacc.astype(dv_ref.dtype), cmask)


def _dq_kernel(*refs, nc, causal, has_seg, scale, bq, bk, t, s):
    q_ref, k_ref, v_ref, lam_ref, *refs = refs
    qs_ref, ks_ref, *refs = refs if has_seg else (None, None, *refs)
    do_ref, lse_ref, delta_ref, dq_ref = refs
    i = pl.program_id(2)
    rows = i * bq + lax.iota(jnp.int32, bq)
    rmask = rows < t if t % bq else None
    rm2 = rmask[:, None] if rmask is not None else None
    qc = [_load(q_ref, (slice(None), c, slice(None)), rm2) for c in range(nc)]
    do = _load(do_ref, (slice(None), slice(None)), rm2)  # (bq, dv)
    lses = [_load(lse_ref, (c, slice(None)), rmask) for c in range(nc)]
    deltas = [_load(delta_ref, (c, slice(None)), rmask) for c in range(nc)]
    qs = _load(qs_ref, (slice(None),), rmask) if has_seg else None
    lam = lam_ref[0] if nc == 2 else None
    smask_needed = s % bk != 0
    d = qc[0].shape[1]

    def body(j, dqs, masked):
        cols = j * bk + lax.iota(jnp.int32, bk)
        cmask = (cols < s)[:, None] if smask_needed and masked else None
        win = pl.ds(j * bk, bk)
        v = _load(v_ref, (win, slice(None)), cmask)
        ks = _load(ks_ref, (win,), cmask[:, 0] if cmask is not None else None) if has_seg else None
        mask = _valid(rows, cols, qs, ks, causal=causal,
                      s=s if smask_needed else None) if masked else None
        dp = _dot(do, v, tb=True)  # (bq, bk)
        new = []
        for c in range(nc):
            kc = _load(k_ref, (win, c, slice(None)), cmask)
            p = jnp.exp(_dot(qc[c], kc, tb=True) * scale - lses[c][:, None])
            if mask is not None:
                p = jnp.where(mask, p, 0.0)
            dpc = dp if c == 0 else -lam * dp
            ds = p * (dpc - deltas[c][:, None])
            new.append(dqs[c] + _dot(ds.astype(kc.dtype), kc))  # (bq, d)
        return tuple(new)

    lo, hi = _kv_range(i, causal=causal, has_seg=has_seg, bq=bq, bk=bk, s=s)
    dqs = tuple(jnp.zeros((bq, d), jnp.float32) for _ in range(nc))
    dqs = lax.fori_loop(0, lo, functools.partial(body, masked=False), dqs)
    dqs = lax.fori_loop(lo, hi, functools.partial(body, masked=True), dqs)
    for c in range(nc):
        _store(dq_ref, (slice(None), c, slice(None)), (dqs[c] * scale).astype(dq_ref.dtype), rm2)


def bwd(q: jax.Array, k: jax.Array, v: jax.Array, lam: jax.Array, q_seg: jax.Array | None,
        kv_seg: jax.Array | None, do: jax.Array, lse: jax.Array, delta: jax.Array, *, nc: int,
        causal: bool, block_q: int, block_k: int, block_q_bwd: int, block_k_bwd: int,
        num_warps: int, num_stages: int,
        interpret: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns (dq, dk, dv) in the input dtypes. lse, delta: (B, H, nc, T) float32; do
    (B, T, H, dv); the rest as in `fwd`."""
    del block_q, block_k
    b, t, hq, d_true = q.shape
    s, hkv, dv_true = k.shape[1], v.shape[2], v.shape[3]
    h, n_rep = hq // nc, hq // nc // hkv
    d, dv = lanes(d_true), lanes(dv_true)
    q, k, v, do = _pad_lanes(q, d), _pad_lanes(k, d), _pad_lanes(v, dv), _pad_lanes(do, dv)
    bq, bk = _tile(block_q_bwd, t), _tile(block_k_bwd, s)
    tp, sp = _round_up(t, bq), _round_up(s, bk)
    has_seg = q_seg is not None
    common = dict(nc=nc, causal=causal, has_seg=has_seg, scale=d_true**-0.5, bq=bq, bk=bk, t=t,
                  s=s)
    costs = dict(nc=nc, causal=causal, bq=bq, bk=bk)
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    lam = lam.reshape(1).astype(jnp.float32)
    lam_spec = pl.BlockSpec((1,), lambda *_: (0,))

    # dK, dV: grid over (batch, kv head, kv tile); whole q / dO / lse of the group per program.
    in_specs = [
        pl.BlockSpec((None, tp, n_rep * nc, d), lambda b_, g, j: (b_, 0, g, 0)),
        pl.BlockSpec((None, bk, nc, d), lambda b_, g, j: (b_, j, g, 0)),
        pl.BlockSpec((None, bk, None, dv), lambda b_, g, j: (b_, j, g, 0)),
        lam_spec,
    ]
    args = [q, k, v, lam]
    if has_seg:
        in_specs += [pl.BlockSpec((None, tp), lambda b_, g, j: (b_, 0)),
                     pl.BlockSpec((None, bk), lambda b_, g, j: (b_, j))]
        args += [q_seg, kv_seg]
    stat_spec = pl.BlockSpec((None, n_rep, nc, tp), lambda b_, g, j: (b_, g, 0, 0))
    in_specs += [pl.BlockSpec((None, tp, n_rep, dv), lambda b_, g, j: (b_, 0, g, 0)),
                 stat_spec, stat_spec]
    args += [do, lse, delta]
    dk, dvv = pl.pallas_call(
        functools.partial(_dkdv_kernel, n_rep=n_rep, **common),
        grid=(b, hkv, pl.cdiv(s, bk)),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, bk, nc, d), lambda b_, g, j: (b_, j, g, 0)),
                   pl.BlockSpec((None, bk, None, dv), lambda b_, g, j: (b_, j, g, 0))],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=params,
        interpret=interpret,
        cost_estimate=cost.dkdv(q, k, v, **costs),
        name=f"flash{nc}_dkdv",
    )(*args)

    # dQ: grid over (batch, head, q tile); whole K / V of the kv group per program.
    in_specs = [
        pl.BlockSpec((None, bq, nc, d), lambda b_, h_, i: (b_, i, h_, 0)),
        pl.BlockSpec((None, sp, nc, d), lambda b_, h_, i: (b_, 0, h_ // n_rep, 0)),
        pl.BlockSpec((None, sp, None, dv), lambda b_, h_, i: (b_, 0, h_ // n_rep, 0)),
        lam_spec,
    ]
    args = [q, k, v, lam]
    if has_seg:
        in_specs += [pl.BlockSpec((None, bq), lambda b_, h_, i: (b_, i)),
                     pl.BlockSpec((None, sp), lambda b_, h_, i: (b_, 0))]
        args += [q_seg, kv_seg]
    stat_spec = pl.BlockSpec((None, None, nc, bq), lambda b_, h_, i: (b_, h_, 0, i))
    in_specs += [pl.BlockSpec((None, bq, None, dv), lambda b_, h_, i: (b_, i, h_, 0)),
                 stat_spec, stat_spec]
    args += [do, lse, delta]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **common),
        grid=(b, h, pl.cdiv(t, bq)),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, bq, nc, d), lambda b_, h_, i: (b_, i, h_, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=params,
        interpret=interpret,
        cost_estimate=cost.dq(q, k, v, **costs),
        name=f"flash{nc}_dq",
    )(*args)
    return dq[..., :d_true], dk[..., :d_true], dvv[..., :dv_true]

