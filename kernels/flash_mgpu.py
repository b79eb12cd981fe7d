"""Differential flash attention on Hopper: Mosaic GPU (`plgpu.kernel`), forward and backward.

The operator is `kernels.flash`'s with two softmax components (nc = 2):
O = softmax(s·Q1K1ᵀ+M)·V − λ·softmax(s·Q2K2ᵀ+M)·V, layouts q (B, T, 2H, d), k (B, S, 2Hkv, d),
v (B, S, Hkv, 2d); DIFF head h reads kv group h // (H // Hkv). bfloat16 or float16 inputs,
d ∈ {64, 96, 128} (`supports`); the dispatch in `kernels.flash` sends everything else to the
Triton kernel.

Every kernel is one CTA of warpgroups (`num_threads`, axis "wg"): compute warpgroups of 64 rows
each (the wgmma M) and a last, producer warpgroup that streams the other operand through a
`stages`-deep shared-memory ring with TMA, one "loaded" barrier per buffer and slot and one
"consumed" barrier per slot that every compute warpgroup arrives on once it is done with the
slot. The producer keeps 24 registers (`setmaxnreg`), compute warpgroups take the rest
(`compute_registers`).

- Forward (`fwd`): a CTA owns 64 query rows; compute warpgroup c owns softmax component c of
  those rows (one f32 accumulator 64 × 2d, at d = 128 128 registers a thread, instead of two in
  one warpgroup), and the producer loads K1, K2 and V once per step for both. Online softmax in
  base 2 (max kept in log2 units, `exp2`). Ping-pong (`Tiles.pingpong`, FA3's schedule): a
  two-arrival barrier, passed twice a step (after issuing QKᵀ, after the softmax) with
  warpgroup 1 one turn behind, makes the warpgroups take turns on the tensor cores, one's P·V
  and next QKᵀ against the other's softmax. At the end warpgroup 1 writes O2 and lse2, and
  warpgroup 0 reads O2 back from shared memory to form O = O1 − λ·O2.
- dQ (`bwd`, first kernel): `wgs_dq` warpgroups of 64 query rows each, both components per
  warpgroup (dQ1, dQ2 accumulators; `Tiles.dq` "rows"), or two warpgroups on the same 64 rows,
  one component each ("split": each computes dP, a third more tensor-core work, for half the
  accumulators); the producer streams K1, K2, V. Per step dP = dO·Vᵀ, dS_c =
  P_c∘(coef_c·dP − δ_c) with coef = (1, −λ).
- dK/dV (`bwd`, second kernel): the producer streams Q1, Q2, dO, lse and δ over the kv group's
  n_rep heads and the q tiles; per step dPᵀ = V·dOᵀ, dV += (P1 − λ·P2)ᵀ·dO, dK_c += dS_cᵀ·Q_c.
  GQA sums stay in registers (no reduction outside). Two schedules (`Tiles.dkv`): "rows",
  `wgs_dkv` warpgroups of 64 kv rows each holding all three accumulators; "split", two
  warpgroups on the same 64 kv rows (K1, K2, V loaded once), one accumulating dV, the other
  dK1 and dK2 (both compute P1 and P2: two extra QKᵀ products a step, a quarter more
  tensor-core work, for half the accumulators a thread); "share", as "split" but the dV
  warpgroup alone forms P1ᵀ and P2ᵀ and passes them to the dK warpgroup through shared memory
  in bf16 (one 64 × bq buffer each, a written and a read barrier), so the warpgroups do equal
  tensor-core work a step, 4 units of a d-wide 64 × bq product each (S1ᵀ, S2ᵀ and the 2d-wide
  dV; the 2d-wide dPᵀ, dK1 and dK2), where "split"'s dK warpgroup does 6 and its dV one 4
  (ptxas: the dK step loop holds 16 wgmmas against split's 24 at d = 64, 24 against 40 at
  d = 128). dS is then formed from the bf16 P, one more rounding of a value that is rounded to
  bf16 for its product anyway.
- dQ fused (`Tiles.dq` "fused", with "share"; jax ≥ 0.11): no dQ kernel. The dK warpgroup
  writes dS1ᵀ and dS2ᵀ over P1ᵀ and P2ᵀ in shared memory (no more shared memory) and, with a
  third barrier, hands dS2ᵀ to the dV warpgroup; each computes one component's dQ_c = dS_c·K_c
  (a wgmma with the transposed dS_cᵀ tile from shared memory and K_c, which the CTA holds
  anyway), bq × d, and adds it into a float32 dQ in global memory with atomic adds
  (`plgpu.atomic_add`: red.global.add.f32, one an element, REDG.E.ADD.F32 in the SASS, 32 a
  thread a step at d = 64; the float32 sums start at zero in a `jax.Ref` that the kernel
  takes, which jax 0.10 cannot trace; `bwd` scales and casts them). "fused_tma" stages the
  product in shared memory instead (bq × d float32 a warpgroup) and adds it with one TMA
  reduce-add (UTMAREDG.5D.ADD in the SASS), whole lines into L2; the previous step's must
  have left the buffer first (`wait_smem_to_gmem(read_only)`). Its buffers fit at d = 64 and 96 (bq = 64),
  not at 128. A pair then costs 10 d-wide products, the backward's floor, against 14 with the
  dQ kernel (which recomputes S and dP: 6 of its own) and "share" (16 with "split"): 5 in each
  warpgroup (S1ᵀ, S2ᵀ, dV, dQ2; dPᵀ, dK1, dK2, dQ1). The price: the additions' traffic, bq × d
  × 4 bytes a component a step into L2, which only a GPU can weigh against the work saved, and
  the dK warpgroup's registers, which hold dK1 + dK2 and the bq × d dQ1 tile (ptxas at
  bq = 64: no spill a step at d = 64; at d = 128 a few, 19 spill instructions a step, 44 with
  segment ids; benchmarks/results/mosaic_ptxas_sm90a_jax0.11.2.md).

Registers (f32, per thread of a compute warpgroup; budget `compute_registers`: 240 with two
compute warpgroups, 256 with one; the split dK/dV schedule gives its dK warpgroup 256 and its dV
warpgroup 224, `split_registers`): forward d (the 64 × 2d accumulator) plus bk/2 for the score
tile; dQ d (dQ1 + dQ2) plus bk/2 for each of dP, S, dS; dK/dV 2d (dK1 + dK2 + dV) with "rows"
plus bq/2 for each of P1ᵀ, P2ᵀ, dPᵀ and P1ᵀ − λ·P2ᵀ, with "split" d plus bq/2 for each of
dPᵀ, Sᵀ, dSᵀ (the dK warpgroup forms dS1ᵀ before P2ᵀ, so it never holds both P tiles;
`dkv_registers`): "rows" is over budget at every d, so "auto" takes "split" wherever shared
memory holds it. These counts leave out addresses, loop state and vectors (a per-query vector in
dK/dV's transposed tiles costs bq/4 registers, so λ is held along the kv rows). ptxas's own
report (`kernels.ptxas`, compiled for sm_90a on a CPU by `benchmarks/mosaic_ptxas.py`) is the
check: benchmarks/results/mosaic_ptxas_sm90a_jax*.md list which kernels spill and, from the
SASS, what each kv or q step runs of it. At the table's tiles no step spills at d = 64 and 96.
At d = 128 "rows" dQ (one warpgroup holding dQ1 + dQ2: 128 registers) stores and reloads values
in every step (22 spill instructions, 40 with segment ids) where "split" dQ spills nothing; the
split dK/dV, whose dK1 + dK2 + dV take 256 registers a thread per 64 kv rows and whose two roles
share the CTA's 504 less the producer's (`split_registers`), runs 9 spill instructions a step
on jax 0.10.2 and 6 on 0.11.2 (49 with segment ids). Shared memory per CTA is exact:
`fwd_smem`, `dq_smem` and `dkv_smem` count each kernel's own scratch list (`_fwd_scratch`, ...)
as the lowering allocates it (every buffer from a 1 KiB boundary, 8 bytes a barrier, the
forward's reduction scratch; tested against the lowering's own count), at most 227 KiB: d = 64
runs two compute warpgroups in every kernel; at d = 128 "rows" dQ holds one (`warpgroups`).
`benchmarks/attention.py --tune` measures the tiles, the forward with and without ping-pong and
the three dK/dV and two dQ schedules on the GPU; until it has run (the first H100 run checked
and benchmarked the untuned table: benchmarks/results/mosaic_h100.md) the table keeps "rows" dQ
and "auto" dK/dV everywhere.

Masks: causal tiles are skipped by the loop bounds; only tiles that cross the diagonal or hold
a ragged tail get the position mask. Segment ids mask every tile: in the forward the interior
tiles (below the diagonal) compare segment ids only, 9-15% fewer instructions a step than the
full mask (sm_90a SASS, d = 64 and 128); dQ and dK/dV run every step with the full mask, since
a separate interior loop spills more there (ptxas: d = 96 "rows" dQ 80 B against none; d = 128
dK/dV's "k" role 41 spill instructions a step against 16). Masked logits are −1e30 and the
running max starts at −1e29, so a row that has seen only masked keys keeps p = 0 and l = 0 with
no extra select; fully masked rows (segment 0) output 0 and lse 0. Ragged lengths are padded
by the wrapper to whole CTA tiles (zeros, segment 0); padded keys are masked, padded queries
are sliced off (in dK/dV they contribute exactly 0: q = dO = lse = δ = 0).

`interpret=True` (or an `InterpretGPUParams`, e.g. with `detect_races=True`) runs the same
kernels under Mosaic GPU's interpreter (CPU; checked with jax 0.10.2 and 0.11.2), which
simulates the warpgroups as threads, the TMA copies and the barriers (each thread must await
every phase of a barrier it waits on) and optionally detects shared-memory races — on jax 0.11
also across proxies, so a TMA refill of a slot that was read with generic loads needs the
producer's proxy fence (`commit_smem`). It cannot run wgmma from registers or with a register
accumulator (`run_state`), so wgmma, `plgpu.load` and layout casts become plain loads and
`lax.dot_general` there (`_Ops`); it has no model of atomics either, so the fused dQ's atomic
adds become each CTA's own sums, added up after the kernel (`_Ops.atomic_add`), and it takes the
fused dQ's Ref argument on jax 0.11 only. Everything else — the schedule, the barrier protocol,
indexing, masks, the softmax and the epilogues — is the code that runs on the GPU. The
interpreter runs the warpgroups on XLA's CPU devices' threads and hangs with no more devices than
warpgroups (3 warpgroups: 3 devices hung, 4 ran), so such a call is refused naming the flag
(`--xla_force_host_platform_device_count=8` gives it enough, on 2 cores too).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

LOG2E = math.log2(math.e)
MASKED = -1e30  # a masked logit (log2 units)
M_INIT = -1e29  # the running max before any key: above MASKED, so masked keys give p = 0
ROWS = 64  # rows of a warpgroup's tile: the wgmma M
SMEM_BYTES = 227 * 1024  # shared memory a CTA may use on sm_90
SMEM_ALIGN = 1024  # Pallas starts every scratch buffer at a 1 KiB boundary
BARRIER_BYTES = 8  # one mbarrier
# A TMA warpgroup's registers a thread (`setmaxnreg`): the least setmaxnreg takes. ptxas fits
# the producer's code in it (no kernel spills at d = 64 or 96), and the 16 it frees from 40 take
# dQ's masked steps at d = 96 to no spills and leave the split dK/dV's roles 480 at d = 128.
PRODUCER_REGISTERS = 24
HEAD_DIMS = (64, 96, 128)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
DKV_SCHEDULES = ("auto", "rows", "split", "share")
DQ_SCHEDULES = ("rows", "split", "fused", "fused_tma")
FUSED = ("fused", "fused_tma")  # dQ in the dK/dV kernel: atomic adds, or TMA reduce-adds
# fused dQ passes a float32 `jax.Ref` to the kernel to add into: plgpu.kernel takes Ref arguments
# (aliased in and out) from jax 0.11; jax 0.10 fails to trace one.
FUSED_DQ = jax.__version_info__ >= (0, 11)
_PARAMS = plgpu.CompilerParams(approx_math=True)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tile sizes of the three kernels (rows of the streamed operand per pipeline step).

    block_kv: forward K/V tile; block_kv_dq: dQ's K/V tile; block_q_dkv: dK/dV's Q/dO tile;
    stages: shared-memory ring depth. Compute tiles are 64 rows per warpgroup.
    dkv: the dK/dV kernel's schedule (`warpgroups`): "rows" (each compute warpgroup owns 64 kv
    rows and all three accumulators), "split" (two compute warpgroups share 64 kv rows: one
    accumulates dV, the other dK1 and dK2, each forming P1ᵀ and P2ᵀ itself), "share" (as
    "split", but the dV warpgroup alone forms P1ᵀ and P2ᵀ and hands them to the dK one through
    shared memory in bf16, which forms dPᵀ: equal tensor-core work a step, where "split"
    gives the dK one half as much again as the dV one) or "auto" (by the register plan; never
    "share" until a GPU measures it).
    pingpong: the forward's two compute warpgroups take turns on the tensor cores (one runs its
    P·V and next QKᵀ wgmmas while the other runs its softmax), ordered by a two-arrival
    schedule barrier; False lets them run unordered.
    dq: the dQ kernel's schedule: "rows" (each compute warpgroup owns 64 query rows and both
    dQ1 and dQ2; two warpgroups where shared memory holds two rows' Q and dO, else one) or
    "split" (two compute warpgroups share 64 query rows, one accumulating dQ1, the other dQ2;
    each computes dP = dO·Vᵀ: a third more tensor-core work for half the accumulators a
    thread, where one "rows" warpgroup at d = 128 spills) or "fused" (no dQ kernel: the
    "share" dK/dV kernel adds each step's dS_c·K_c into a float32 dQ in global memory with
    atomic adds from registers, so S and dP are computed once a pair; jax ≥ 0.11, dkv
    "share") or "fused_tma" (as "fused", the product staged in shared memory, bq × d float32
    a warpgroup, and added by a TMA reduce-add: whole lines into L2, where each atomic covers
    one element; shared memory holds it at d = 64 and 96).
    """

    block_kv: int
    block_kv_dq: int
    block_q_dkv: int
    stages: int
    dkv: str = "auto"
    pingpong: bool = True
    dq: str = "rows"

    def check(self) -> None:
        """One ValueError naming the first invalid field."""
        for name in ("block_kv", "block_kv_dq", "block_q_dkv"):
            val = getattr(self, name)
            if not isinstance(val, int) or val <= 0 or val % 64 or val > 256:
                raise ValueError(f"Mosaic GPU tiles: {name} must be a multiple of 64 in "
                                 f"[64, 256], got {val!r}")
        if not isinstance(self.stages, int) or not 2 <= self.stages <= 4:
            raise ValueError(f"Mosaic GPU tiles: stages must be 2, 3 or 4, got {self.stages!r}")
        if self.dkv not in DKV_SCHEDULES:
            raise ValueError(f"Mosaic GPU tiles: dkv must be one of {DKV_SCHEDULES}, "
                             f"got {self.dkv!r}")
        if not isinstance(self.pingpong, bool):
            raise ValueError(f"Mosaic GPU tiles: pingpong must be True or False, "
                             f"got {self.pingpong!r}")
        if self.dq not in DQ_SCHEDULES:
            raise ValueError(f"Mosaic GPU tiles: dq must be one of {DQ_SCHEDULES}, "
                             f"got {self.dq!r}")
        if self.dq in FUSED and self.dkv != "share":
            raise ValueError(f"Mosaic GPU tiles: dq={self.dq!r} runs in the dkv='share' kernel, "
                             f"got dkv={self.dkv!r}")
        if self.dq in FUSED and not FUSED_DQ:
            raise ValueError(f"Mosaic GPU tiles: dq={self.dq!r} needs jax >= 0.11 (a Ref "
                             f"argument to plgpu.kernel), this is jax {jax.__version__}")


def supports(dtype: jax.typing.DTypeLike, head_dim: int, nc: int) -> bool:
    """Whether these kernels take the call: differential (nc = 2), bf16/fp16, d ∈ {64, 96, 128}."""
    return nc == 2 and jnp.dtype(dtype) in DTYPES and head_dim in HEAD_DIMS


# ----------------------------------------------------------------------------------------------
# Shared memory: each kernel's scratch buffers (one definition, used by the kernel and its plan),
# and the bytes Pallas allocates for them, used to pick the warpgroup count and refuse tiles.


def _smem(shape, dtype, like: int | None = None):
    """A shared-memory buffer; 2-D bf16/fp16 tiles (wgmma operands) tiled and swizzled, with
    the swizzle of rows `like` elements wide when given (wgmma takes two shared-memory operands
    of one swizzle)."""
    if len(shape) >= 2 and jnp.dtype(dtype).itemsize == 2:
        swizzle = min(plgpu.find_swizzle(n * 16) for n in (shape[-1], like or shape[-1]))
        transforms = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))
        return plgpu.SMEM(shape, dtype, transforms=transforms)
    return plgpu.SMEM(shape, dtype)


def _fwd_scratch(d: int, tiles: Tiles, dt, has_seg: bool) -> list:
    """[buffers, barriers]: Q1, Q2 (64 × d); the ring (K1, K2: bk × d, V: bk × 2d per stage);
    O (64 × 2d); lse1, lse2, λ vectors; segment ids. Barriers: Q/λ/segments, K, V, segment ring,
    consumed (2 arrivals), O2 done, ping-pong turn (2 arrivals)."""
    bk, stages = tiles.block_kv, tiles.stages
    i32 = jnp.int32
    return [
        (_smem((2, ROWS, d), dt), _smem((2, stages, bk, d), dt), _smem((stages, bk, 2 * d), dt),
         _smem((ROWS, 2 * d), dt), plgpu.SMEM((4, ROWS), jnp.float32),
         plgpu.SMEM((2, ROWS), i32) if has_seg else None,
         plgpu.SMEM((stages, bk), i32) if has_seg else None),
        (plgpu.Barrier(num_barriers=6), plgpu.Barrier(num_barriers=2 * stages),
         plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_arrivals=2, num_barriers=stages), plgpu.Barrier(num_barriers=1),
         plgpu.Barrier(num_arrivals=2, num_barriers=1) if tiles.pingpong else None),
    ]


def _dq_scratch(d: int, tiles: Tiles, wgs: int, dt, has_seg: bool, split: bool = False) -> list:
    """[buffers, barriers]: Q1, Q2 (64 × d) and dO (64 × 2d) per warpgroup (once when `split`);
    per warpgroup lse/δ, λ and segment vectors; the K1, K2 (bk × d) and V (bk × 2d) rings,
    segment ring."""
    bk, stages = tiles.block_kv_dq, tiles.stages
    copies = 1 if split else wgs
    i32 = jnp.int32
    return [
        (_smem((copies, 2, ROWS, d), dt), _smem((copies, ROWS, 2 * d), dt),
         # K1 and K2 rings as two buffers: jax 0.11 cannot lower a wgmma accumulation
         # (`run_state`) whose operand ref is indexed by a Python int
         (_smem((stages, bk, d), dt),) * 2, _smem((stages, bk, 2 * d), dt),
         plgpu.SMEM((wgs, 4, ROWS), jnp.float32), plgpu.SMEM((wgs, ROWS), jnp.float32),
         plgpu.SMEM((wgs, ROWS), i32) if has_seg else None,
         plgpu.SMEM((stages, bk), i32) if has_seg else None),
        (plgpu.Barrier(num_barriers=7 * wgs), plgpu.Barrier(num_barriers=2 * stages),
         plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_arrivals=wgs, num_barriers=stages)),
    ]


def _dkv_scratch(d: int, tiles: Tiles, wgs: int, split: bool, dt, has_seg: bool) -> list:
    """[buffers, barriers]: K1, K2 (64 × d) and V (64 × 2d) per warpgroup (once when `split`);
    the Q1, Q2 (bq × d) and dO (bq × 2d) rings with lse, δ; λ and segment vectors; with
    "share", P1ᵀ and P2ᵀ (64 × bq) and their barriers (written, read; with fused dQ the
    dS1ᵀ, dS2ᵀ that replace them written); with "fused_tma" the two warpgroups' float32 dQ
    products (bq × d)."""
    bq, stages = tiles.block_q_dkv, tiles.stages
    copies = 1 if split else wgs
    share = tiles.dkv == "share"  # `warpgroups` takes it as split, or refuses it
    i32 = jnp.int32
    return [
        (_smem((copies, 2, ROWS, d), dt), _smem((copies, ROWS, 2 * d), dt),
         (_smem((stages, bq, d), dt),) * 2, _smem((stages, bq, 2 * d), dt),  # Q1, Q2 rings
         plgpu.SMEM((stages, 4, bq), jnp.float32), plgpu.SMEM((wgs, ROWS), jnp.float32),
         plgpu.SMEM((wgs, ROWS), i32) if has_seg else None,
         plgpu.SMEM((stages, bq), i32) if has_seg else None,
         # P1ᵀ, P2ᵀ: K's swizzle, as fused dQ multiplies the dSᵀ written over them with K
         _smem((2, ROWS, bq), dt, like=d) if share else None,
         (plgpu.SMEM((bq, d), jnp.float32),) * 2 if tiles.dq == "fused_tma" else None),
        (plgpu.Barrier(num_barriers=5 * wgs), plgpu.Barrier(num_barriers=2 * stages),
         plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=2 * stages),
         plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
         *([plgpu.Barrier(num_arrivals=2, num_barriers=1)] if split else []),
         *([plgpu.Barrier(num_barriers=3 if tiles.dq in FUSED else 2)] if share else [])),
    ]


def _smem_bytes(scratch, *, reduces: bool) -> int:
    """Bytes of shared memory Pallas allocates for `scratch`: each buffer from a 1 KiB boundary
    (`SMEM_ALIGN`), 8 bytes a barrier, plus the compiler's reduction scratch when the kernel body
    reduces over a register tile (the forward's row max and sum)."""
    if scratch is None:
        return 0
    if isinstance(scratch, (list, tuple)):
        return sum(_smem_bytes(x, reduces=False) for x in scratch) + (
            _PARAMS.reduction_scratch_bytes if reduces else 0)
    if isinstance(scratch, plgpu.Barrier):
        n = scratch.num_barriers  # a count, or a shape (jax normalises it to one)
        return BARRIER_BYTES * (math.prod(n) if isinstance(n, tuple) else n)
    size = math.prod(scratch.shape) * jnp.dtype(scratch.dtype).itemsize
    return -(-size // SMEM_ALIGN) * SMEM_ALIGN


# Plans use bf16 and segment ids (a few KiB more than without), so a tile that fits is valid for
# every call the kernel takes.
def fwd_smem(d: int, tiles: Tiles, has_seg: bool = True) -> int:
    """Shared memory of the forward kernel (`_fwd_scratch`)."""
    return _smem_bytes(_fwd_scratch(d, tiles, jnp.bfloat16, has_seg), reduces=True)


def dq_smem(d: int, tiles: Tiles, wgs: int, has_seg: bool = True, split: bool = False) -> int:
    """Shared memory of the dQ kernel with `wgs` compute warpgroups (`_dq_scratch`)."""
    return _smem_bytes(_dq_scratch(d, tiles, wgs, jnp.bfloat16, has_seg, split), reduces=False)


def dkv_smem(d: int, tiles: Tiles, wgs: int, split: bool = False, has_seg: bool = True) -> int:
    """Shared memory of the dK/dV kernel (`_dkv_scratch`)."""
    return _smem_bytes(_dkv_scratch(d, tiles, wgs, split, jnp.bfloat16, has_seg), reduces=False)


def dkv_registers(d: int, bq: int, split: bool) -> int:
    """f32 registers a dK/dV compute thread holds at its peak (a 64 × n tile is n/2 a thread):
    with "rows" dK1 + dK2 + dV (2d) and four score-sized tiles (P1ᵀ and P2ᵀ, both live until
    P1ᵀ − λ·P2ᵀ is formed for dV, dPᵀ, and that difference or a dSᵀ: bq/2 each); with "split"
    dV or dK1 + dK2 (d) and three (the dK warpgroup forms dS1ᵀ before P2ᵀ). ptxas agrees where
    it matters: "rows" spills at d = 64, bq = 64 (2d + 2bq = 256 > 240), "split" does not
    (benchmarks/results/mosaic_ptxas_sm90a_jax*.md)."""
    return d + 3 * bq // 2 if split else 2 * d + 2 * bq


def _overflow(name: str, tiles: Tiles, need: int, d: int) -> ValueError:
    return ValueError(f"Mosaic GPU tiles: {name}={getattr(tiles, name)} with stages="
                      f"{tiles.stages} needs {need // 1024} KiB of shared memory at d={d}, more "
                      f"than {SMEM_BYTES // 1024} KiB")


def warpgroups(d: int, tiles: Tiles) -> tuple[int, int, bool]:
    """(dQ's compute warpgroups, dK/dV's compute warpgroups, whether dK/dV splits its rows'
    accumulators across two of them). Two warpgroups where shared memory holds them, else one;
    dQ "split" always two (on the same 64 rows); fused dQ none (no dQ kernel).

    dK/dV "auto": "rows" while `dkv_registers` fits `compute_registers` (240 with two compute
    warpgroups, 256 with one), else "split" where shared memory holds it. Raises a ValueError
    naming the tile when even the smallest plan does not fit.
    """
    tiles.check()
    if fwd_smem(d, tiles) > SMEM_BYTES:
        raise _overflow("block_kv", tiles, fwd_smem(d, tiles), d)
    if tiles.dq in FUSED:
        wgs_dq = 0
    elif tiles.dq == "split":
        if dq_smem(d, tiles, 2, split=True) > SMEM_BYTES:
            raise _overflow("block_kv_dq", tiles, dq_smem(d, tiles, 2, split=True), d)
        wgs_dq = 2
    else:
        wgs_dq = next((w for w in (2, 1) if dq_smem(d, tiles, w) <= SMEM_BYTES), None)
        if wgs_dq is None:
            raise _overflow("block_kv_dq", tiles, dq_smem(d, tiles, 1), d)
    split_fits = dkv_smem(d, tiles, 2, split=True) <= SMEM_BYTES
    rows = next((w for w in (2, 1) if dkv_smem(d, tiles, w) <= SMEM_BYTES), None)
    schedule = tiles.dkv
    if schedule == "auto":
        over = rows is None or dkv_registers(d, tiles.block_q_dkv, False) > (
            compute_registers(rows))
        schedule = "split" if over and split_fits else "rows"
    if schedule in ("split", "share"):  # the plan of "share" holds its P tiles
        if not split_fits:
            raise _overflow("block_q_dkv", tiles, dkv_smem(d, tiles, 2, split=True), d)
        return wgs_dq, 2, True
    if rows is None:
        raise _overflow("block_q_dkv", tiles, dkv_smem(d, tiles, 1), d)
    return wgs_dq, rows, False


# ----------------------------------------------------------------------------------------------
# The few operations that differ between the GPU and the interpreter.


# jax 0.10 requires plgpu.load's index argument; jax 0.11 deprecates passing it.
_LOAD_NEEDS_IDX = inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty


def _load_smem(ref, layout):
    """All of an SMEM ref, in registers with `layout`."""
    return plgpu.load(ref, (), layout=layout) if _LOAD_NEEDS_IDX else plgpu.load(ref, layout=layout)


@dataclasses.dataclass(frozen=True)
class _Ops:
    emulate: bool

    def dot(self, a, b, *, transpose_a: bool = False, transpose_b: bool = False, acc=None,
            issued=None):
        """a (M, K) · b (K, N) (or aᵀ with a (K, M), bᵀ with b (N, K)) in float32, plus `acc`
        when given.

        a: an SMEM ref (transpose_a: a 16-bit one) or a (M, K) array in the WGMMA layout
        (registers); b: an SMEM ref. issued: called once the wgmma is issued, before its
        result is awaited.
        """
        if self.emulate:
            av, bv = a[...], b[...]  # `[...]` reads a ref and leaves an array as it is
            dims = (((0,) if transpose_a else (1,), (1,) if transpose_b else (0,)), ((), ()))
            out = lax.dot_general(av, bv, dims, preferred_element_type=jnp.float32)
            if issued is not None:
                issued()
            return out if acc is None else acc + out
        rhs = b.transpose((1, 0)) if transpose_b else b
        a = a.transpose((1, 0)) if transpose_a else a
        if acc is None:
            m = a.shape[0]
            n = b.shape[0] if transpose_b else b.shape[1]

            def run(acc_ref):
                plgpu.wgmma(acc_ref, a, rhs)
                if issued is not None:
                    issued()
                return acc_ref[...]  # awaits the wgmma

            return pl.run_scoped(run, plgpu.ACC((m, n), jnp.float32))

        def accumulate(acc_ref):
            plgpu.wgmma(acc_ref, a, rhs)
            if issued is not None:
                issued()

        return pl.run_state(accumulate)(plgpu.ACC.init(acc))

    def atomic_add(self, ref, x):
        """ref += x, element-wise atomic (a GMEM ref, x in the WGMMA layout). Interpreted, the
        ref is a slice that this CTA alone adds to (`bwd` sums the CTAs' slices), one
        warpgroup an element, so a plain read, add and write is the same sum and the race
        detector still sees every access (an atomic it has no model of)."""
        if self.emulate:
            ref[...] = ref[...] + x
        else:
            plgpu.atomic_add(ref, x)

    def reduce_add(self, src, dst):
        """dst += src by a TMA reduce-add (src a float32 SMEM ref, dst a GMEM ref of its shape),
        committed as a bulk group (`plgpu.wait_smem_to_gmem`). Interpreted, as `atomic_add`."""
        if self.emulate:
            dst[...] = dst[...] + src[...]
        else:
            plgpu.copy_smem_to_gmem(src, dst, reduction_op="add")

    def iota(self, shape, dim):
        """int32 iota in the WGMMA register layout."""
        if self.emulate:
            return lax.broadcasted_iota(jnp.int32, shape, dim)
        return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)

    def vector(self, ref, axis: int):
        """A 1-D SMEM ref as the row (axis 0) or column (axis 1) vector of a WGMMA tile."""
        if self.emulate:
            return ref[...]
        return _load_smem(ref, plgpu.Layout.WGMMA.reduce(1 - axis))

    def tile(self, ref):
        """A 2-D SMEM ref in the WGMMA register layout."""
        if self.emulate:
            return ref[...]
        return _load_smem(ref, plgpu.Layout.WGMMA)

    def full(self, shape, value):
        """A float32 constant in the WGMMA layout (a loop carry must keep one layout)."""
        x = jnp.full(shape, value, jnp.float32)
        if self.emulate:
            return x
        layout = plgpu.Layout.WGMMA if len(shape) == 2 else plgpu.Layout.WGMMA.reduce(1)
        return plgpu.layout_cast(x, layout)


def _bcast_rows(x, shape):
    return lax.broadcast_in_dim(x, shape, (0,))


def _bcast_cols(x, shape):
    return lax.broadcast_in_dim(x, shape, (1,))


_KERNEL_ARGS = set(inspect.signature(plgpu.kernel).parameters)


def _kernel(body, *, out, scratch, grid, names, threads, interpret, name):
    """plgpu.kernel across jax versions (out_type/scratch_types since 0.10, out_shape before)."""
    kw = ({"out_type": out, "scratch_types": scratch} if "out_type" in _KERNEL_ARGS
          else {"out_shape": out, "scratch_shapes": scratch})
    cpus = len(jax.devices("cpu")) if interpret else 0
    if interpret and cpus <= threads:  # measured: 3 warpgroups wait forever on 3, run on 4
        raise ValueError(f"Mosaic GPU's interpreter runs {name}'s {threads} warpgroups on XLA's "
                         f"CPU devices and waits forever on {cpus}, fewer than {threads + 1}: set "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts")
    if interpret is True:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        kw["interpret"] = InterpretGPUParams()
    elif interpret:
        kw["interpret"] = interpret
    return plgpu.kernel(body, grid=grid, grid_names=names, num_threads=threads,
                        thread_name="wg", compiler_params=_PARAMS,
                        kernel_name=name, **kw)


def cta_registers(threads: int) -> int:
    """Registers a lane holds across a CTA of `threads` warpgroups at launch, the pool that
    `setmaxnreg` moves registers within: each thread starts with the 64K register file's share,
    in units of 8, at most 256; 168 a thread with three warpgroups, so 504, not 512. A
    `setmaxnreg.inc` that asks the pool for more than it holds waits forever (the split dK/dV
    schedule's 256 + 232 + 24 = 512 hung every backward on an H100)."""
    return min(256, 65536 // (128 * threads) // 8 * 8) * threads


def compute_registers(wgs: int) -> int:
    """Registers a thread of each of `wgs` compute warpgroups gets (`setmaxnreg`): the CTA's
    launch pool (`cta_registers`, compute warpgroups and the producer) less the producer's
    `PRODUCER_REGISTERS`, shared out in multiples of 8 and capped at 256 (255 addressable): 240
    with two, 256 with one. setmaxnreg.inc below what a thread already holds is undefined."""
    return min(256, (cta_registers(wgs + 1) - PRODUCER_REGISTERS) // wgs // 8 * 8)


def split_registers() -> dict[str, int]:
    """Registers a thread of each role of the split dK/dV schedule gets: the "k" warpgroup
    (dK1 + dK2, dPᵀ, Sᵀ, dSᵀ and the per-query vectors) all 256, the "v" warpgroup (dV, P1ᵀ, P2ᵀ)
    the rest of the three warpgroups' launch pool after the producer: 224. ptxas on the d = 128
    dK/dV kernel (`kernels.ptxas`, no segment ids, jax 0.10.2): 256 / 224 spills 80 bytes, 9
    spill instructions a step (49 with segment ids), and keeps the wgmmas pipelined; 248 / 232
    and 240 / 240 spill more and serialize them (C7512)."""
    return {"k": 256, "v": (cta_registers(3) - PRODUCER_REGISTERS - 256) // 8 * 8}


def _compute_registers(wgs: int, role: str | None = None) -> None:
    n = compute_registers(wgs) if role is None else split_registers()[role]
    plgpu.set_max_registers(n, action="increase")


def _producer(n_steps, issue, consumed, stages):
    """The TMA warpgroup: fill `stages` slots, refill slot s % stages once consumed, drain."""
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
    for t in range(stages):
        @pl.when(t < n_steps)
        def _():
            issue(jnp.int32(t), t)

    @pl.loop(stages, jnp.maximum(n_steps, stages))
    def _(step):
        slot = lax.rem(step, stages)
        plgpu.barrier_wait(consumed.at[slot])
        # The compute warpgroups read some of the slot with generic loads (lse, δ, segment ids;
        # everything in the interpreter): a proxy fence orders those reads before the TMA
        # (async proxy) refill. jax 0.11's race detector reports the refill without it.
        plgpu.commit_smem()
        issue(step, slot)

    # Observe the last slots' consumption too: every phase of a barrier is waited for once.
    @pl.loop(jnp.maximum(n_steps - stages, 0), n_steps)
    def _(step):
        plgpu.barrier_wait(consumed.at[lax.rem(step, stages)])


def _load(copies):
    """Issue every (gmem ref, smem ref, barrier) copy of `copies`, then wait on each barrier: a
    compute warpgroup's own operands, each on a barrier used once per kernel."""
    for src, dst, bar in copies:
        plgpu.copy_gmem_to_smem(src, dst, bar)
    for _, _, bar in copies:
        plgpu.barrier_wait(bar)


def _mask(ops, shape, q0, k0, *, causal, qs, ks, kv_len, transposed=False):
    """Keep-mask of a (queries, keys) tile — (keys, queries) when `transposed` — whose first
    query/key positions are q0/k0; qs/ks the segment vectors along those axes."""
    qa, ka = (1, 0) if transposed else (0, 1)
    bq = _bcast_cols if transposed else _bcast_rows
    bk = _bcast_rows if transposed else _bcast_cols
    mask = None

    def both(m):
        return m if mask is None else mask & m

    if causal:
        mask = both(ops.iota(shape, qa) + q0 >= ops.iota(shape, ka) + k0)
    if qs is not None:
        q2 = bq(qs, shape)
        mask = both((q2 == bk(ks, shape)) & (q2 != 0))
    if kv_len is not None:
        mask = both(ops.iota(shape, ka) + k0 < kv_len)
    return mask


def _kv_step_mask(ops, shape, row0, k0, slot, *, boundary, causal, qs, ks_bar, ks_s, bound):
    """The keep-mask (or None) of the forward's or dQ's step tile `shape` (queries from row0,
    keys from k0): the position masks on the boundary steps only, the segment mask on every
    step where `qs` is given, after waiting for the step's kv segment ids in `ks_s[slot]`."""
    ks = None
    if qs is not None:
        plgpu.barrier_wait(ks_bar.at[slot])
        ks = ops.vector(ks_s.at[slot], 1)
    return _mask(ops, shape, row0, k0, causal=causal and boundary, qs=qs, ks=ks,
                 kv_len=bound if boundary else None)


def _kv_range(row0, rows, *, causal, bk, n_kv, kv_len):
    """For query rows [row0, row0 + rows): kv steps [0, lo) are interior (no causal or length
    mask; segment ids, where given, still mask them), [lo, hi) the boundary that needs those.
    An interior tile holds only real keys (below kv_len) and, when causal, only keys at or
    before row0: with fewer keys than queries (S < T) the last tile of keys is a boundary one
    even for query rows past it."""
    hi = jnp.minimum(n_kv, pl.cdiv(row0 + rows, bk)) if causal else jnp.int32(n_kv)
    lo = jnp.int32(kv_len // bk)
    if causal:
        lo = jnp.minimum(lo, (row0 + 1) // bk)
    return jnp.minimum(lo, hi), hi


def _pad_rows(x, n, axis=1):
    if x.shape[axis] == n:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n - x.shape[axis])
    return jnp.pad(x, pad)


# ----------------------------------------------------------------------------------------------
# Forward.


def _fwd_body(*refs, causal, has_seg, d, bk, stages, pingpong, n_rep, kv_len, n_kv, ops):
    q_ref, k_ref, v_ref, lam_ref, *refs = refs
    qs_ref, ks_ref, *refs = refs if has_seg else (None, None, *refs)
    o_ref, o2_ref, lse_ref, (q_s, k_s, v_s, o_s, vec_s, qs_s, ks_s), bars = refs
    q_bar, k_bar, v_bar, ks_bar, consumed, done, turn = bars
    b, h, i = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("q")
    wg = lax.axis_index("wg")
    g = h // n_rep
    row0 = i * ROWS
    dt = q_ref.dtype
    lo, hi = _kv_range(row0, ROWS, causal=causal, bk=bk, n_kv=n_kv, kv_len=kv_len)
    bound = None if kv_len == n_kv * bk else kv_len
    scale = d**-0.5 * LOG2E

    @pl.when(wg < 2)
    def _compute():
        _compute_registers(2)
        c = wg  # this warpgroup's softmax component
        rows = pl.ds(row0, ROWS)
        _load([(q_ref.at[b, rows, 2 * h + c], q_s.at[c], q_bar.at[c]),
               (lam_ref, vec_s.at[2 + c], q_bar.at[2 + c]),
               *([(qs_ref.at[b, rows], qs_s.at[c], q_bar.at[4 + c])] if has_seg else [])])
        qs = ops.vector(qs_s.at[c], 0) if has_seg else None

        def take_turn():  # both warpgroups arrive, then both go on
            plgpu.barrier_arrive(turn.at[0])
            plgpu.barrier_wait(turn.at[0])

        # Ping-pong: two turns a step (after issuing QKᵀ; after the softmax), warpgroup 1 one
        # turn behind, so one warpgroup's P·V and next QKᵀ run while the other's softmax does.
        # Each takes 2·steps + 1 turns: warpgroup 1 its extra one first, warpgroup 0 last.
        if pingpong:
            pl.when(c == 1)(take_turn)

        def step(j, carry, boundary):
            acc, m, l = carry
            slot = lax.rem(j, stages)
            plgpu.barrier_wait(k_bar.at[c * stages + slot])
            s = ops.dot(q_s.at[c], k_s.at[c, slot], transpose_b=True,
                        issued=take_turn if pingpong else None) * scale  # (64, bk)
            mask = _kv_step_mask(ops, s.shape, row0, j * bk, slot, boundary=boundary,
                                 causal=causal, qs=qs, ks_bar=ks_bar, ks_s=ks_s, bound=bound)
            if mask is not None:
                s = jnp.where(mask, s, MASKED)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - _bcast_rows(m_new, s.shape))
            l = l * alpha + p.sum(axis=1)
            acc = acc * _bcast_rows(alpha, acc.shape)
            p = p.astype(dt)
            if pingpong:  # the softmax is done before this warpgroup's turn on the tensor cores
                acc, l, p = lax.optimization_barrier((acc, l, p))
                plgpu.barrier_arrive(turn.at[0])
            plgpu.barrier_wait(v_bar.at[slot])
            if pingpong:
                plgpu.barrier_wait(turn.at[0])
            acc = ops.dot(p, v_s.at[slot], acc=acc)
            plgpu.barrier_arrive(consumed.at[slot])
            return acc, m_new, l

        carry = (ops.full((ROWS, 2 * d), 0.0), ops.full((ROWS,), M_INIT), ops.full((ROWS,), 0.0))
        carry = lax.fori_loop(0, lo, functools.partial(step, boundary=False), carry)
        acc, m, l = lax.fori_loop(lo, hi, functools.partial(step, boundary=True), carry)
        if pingpong:
            pl.when(c == 0)(take_turn)
        seen = l > 0.0
        inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
        out = acc * _bcast_rows(inv, acc.shape)
        vec_s.at[c][...] = jnp.where(seen, (m + jnp.log2(jnp.where(seen, l, 1.0))) / LOG2E, 0.0)

        @pl.when(c == 1)
        def _second():  # O2 (a residual) to memory, then to warpgroup 0 through o_s
            o_s[...] = out.astype(dt)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, o2_ref.at[b, rows, h])
            plgpu.copy_smem_to_gmem(vec_s.at[1], lse_ref.at[b, h, 1, rows])
            plgpu.wait_smem_to_gmem(0)
            plgpu.barrier_arrive(done.at[0])

        @pl.when(c == 0)
        def _first():  # O = O1 − λ·O2
            lam = ops.vector(vec_s.at[2], 0)
            plgpu.barrier_wait(done.at[0])
            o2 = ops.tile(o_s).astype(jnp.float32)
            o_s[...] = (out - _bcast_rows(lam, out.shape) * o2).astype(dt)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, o_ref.at[b, rows, h])
            plgpu.copy_smem_to_gmem(vec_s.at[0], lse_ref.at[b, h, 0, rows])
            plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
        def issue(j, slot):
            cols = pl.ds(j * bk, bk)
            for c in range(2):
                plgpu.copy_gmem_to_smem(k_ref.at[b, cols, 2 * g + c], k_s.at[c, slot],
                                        k_bar.at[c * stages + slot])
            plgpu.copy_gmem_to_smem(v_ref.at[b, cols, g], v_s.at[slot], v_bar.at[slot])
            if has_seg:
                plgpu.copy_gmem_to_smem(ks_ref.at[b, cols], ks_s.at[slot], ks_bar.at[slot])

        _producer(hi, issue, consumed, stages)


# jit per (shapes, statics): a model's layers call the same kernel, and jax lowers a jitted
# function once per module and calls it from every site, where each call site of a bare
# `plgpu.kernel` ran Mosaic GPU's Python lowering again (0.5 s a kernel on a CPU; 3 kernels a
# layer).
@functools.partial(jax.jit, static_argnames=("causal", "tiles", "interpret"))
def fwd(q: jax.Array, k: jax.Array, v: jax.Array, lam: jax.Array, q_seg: jax.Array | None,
        kv_seg: jax.Array | None, *, causal: bool, tiles: Tiles,
        interpret: Any = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Forward: (o (B,T,H,2d), o2 (B,T,H,2d), lse (B,H,2,T) float32).

    q (B, T, 2H, d), k (B, S, 2Hkv, d), v (B, S, Hkv, 2d) bf16/fp16; lam a float32 scalar;
    q_seg, kv_seg (B, T) int32 or None. `interpret`: None/False compiles for the GPU; True or
    an `InterpretGPUParams` runs Mosaic GPU's interpreter.
    """
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], v.shape[2]
    h = hq // 2
    bk, stages = tiles.block_kv, tiles.stages
    warpgroups(d, tiles)
    tp, sp = _round_up(t, ROWS), _round_up(s, bk)
    has_seg = q_seg is not None
    q = _pad_rows(q, tp)
    k, v = _pad_rows(k, sp), _pad_rows(v, sp)
    args = [q, k, v, jnp.full((ROWS,), lam, jnp.float32)]
    if has_seg:
        args += [_pad_rows(q_seg, tp), _pad_rows(kv_seg, sp)]
    dt = q.dtype
    body = functools.partial(_fwd_body, causal=causal, has_seg=has_seg, d=d, bk=bk, stages=stages,
                             pingpong=tiles.pingpong, n_rep=h // hkv, kv_len=s, n_kv=sp // bk,
                             ops=_Ops(bool(interpret)))
    out = [jax.ShapeDtypeStruct((b, tp, h, 2 * d), dt), jax.ShapeDtypeStruct((b, tp, h, 2 * d), dt),
           jax.ShapeDtypeStruct((b, h, 2, tp), jnp.float32)]
    scratch = _fwd_scratch(d, tiles, dt, has_seg)
    o, o2, lse = _kernel(body, out=out, scratch=scratch, grid=(b, h, tp // ROWS),
                         names=("b", "h", "q"), threads=3, interpret=interpret,
                         name="diff_flash_fwd")(*args)
    return o[:, :t], o2[:, :t], lse[..., :t]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# ----------------------------------------------------------------------------------------------
# Backward: dQ, then dK/dV. δ (with the λ terms) comes from outside (`kernels.flash`).


def _dq_body(*refs, causal, has_seg, d, bk, stages, wgs, split, n_rep, kv_len, n_kv, ops):
    q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, lam_ref, *refs = refs
    qs_ref, ks_ref, *refs = refs if has_seg else (None, None, *refs)
    dq_ref, (q_s, do_s, k_s, v_s, st_s, lam_s, qs_s, ks_s), bars = refs
    in_bar, k_bar, v_bar, ks_bar, consumed = bars
    b, h, i = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("q")
    wg = lax.axis_index("wg")
    g = h // n_rep
    dt = q_ref.dtype
    cta_rows = ROWS if split else ROWS * wgs
    cta0 = i * cta_rows
    bound = None if kv_len == n_kv * bk else kv_len
    lo, hi = _kv_range(cta0, cta_rows, causal=causal, bk=bk, n_kv=n_kv, kv_len=kv_len)
    if has_seg:  # every step on the boundary path: with interior steps of their own (segment
        lo = jnp.int32(0)  # mask only) ptxas spills 80 B at d=96 "rows", none this way
    scale = d**-0.5

    def compute(comps):
        """A compute warpgroup's loop and epilogue for the softmax components `comps`: both
        (0, 1) of its own 64 query rows, or with "split" one of the CTA's 64 rows."""
        _compute_registers(wgs)
        own = 0 if split else wg  # which Q, dO copy this warpgroup reads
        row0 = cta0 if split else cta0 + wg * ROWS
        rows = pl.ds(row0, ROWS)

        def bar_at(n):  # flat indices: the interpreter takes no barrier slices
            return in_bar.at[wg * 7 + n]

        do_load = (do_ref.at[b, rows, h], do_s.at[own], in_bar.at[own * 7 + 2])
        loads_q = [(q_ref.at[b, rows, 2 * h + c], q_s.at[own, c], bar_at(c)) for c in comps]
        loads_rest = ([(lse_ref.at[b, h, :, rows], st_s.at[wg, pl.ds(0, 2)], bar_at(3)),
                       (dl_ref.at[b, h, :, rows], st_s.at[wg, pl.ds(2, 2)], bar_at(4)),
                       (lam_ref, lam_s.at[wg], bar_at(5))]
                      + ([(qs_ref.at[b, rows], qs_s.at[wg], bar_at(6))] if has_seg else []))
        if split and comps == (1,):  # the component-0 warpgroup loads the shared dO
            _load(loads_q + loads_rest)
            plgpu.barrier_wait(do_load[2])
        else:
            _load(loads_q + [do_load] + loads_rest)
        lse = {c: ops.vector(st_s.at[wg, c], 0) * LOG2E for c in comps}
        delta = {c: ops.vector(st_s.at[wg, 2 + c], 0) for c in comps}
        lam = ops.vector(lam_s.at[wg], 0)
        qs = ops.vector(qs_s.at[wg], 0) if has_seg else None

        def step(j, dqs, boundary):
            slot = lax.rem(j, stages)
            plgpu.barrier_wait(v_bar.at[slot])
            dp = ops.dot(do_s.at[own], v_s.at[slot], transpose_b=True)  # (64, bk): dP1
            mask = _kv_step_mask(ops, dp.shape, row0, j * bk, slot, boundary=boundary,
                                 causal=causal, qs=qs, ks_bar=ks_bar, ks_s=ks_s, bound=bound)
            new = []
            for n, c in enumerate(comps):
                plgpu.barrier_wait(k_bar.at[c * stages + slot])
                s = ops.dot(q_s.at[own, c], k_s[c].at[slot], transpose_b=True) * (scale * LOG2E)
                if mask is not None:
                    s = jnp.where(mask, s, MASKED)
                p = jnp.exp2(s - _bcast_rows(lse[c], s.shape))
                dpc = dp if c == 0 else -_bcast_rows(lam, dp.shape) * dp
                ds = p * (dpc - _bcast_rows(delta[c], dp.shape))
                new.append(ops.dot(ds.astype(dt), k_s[c].at[slot], acc=dqs[n]))
            plgpu.barrier_arrive(consumed.at[slot])
            return tuple(new)

        dqs = tuple(ops.full((ROWS, d), 0.0) for _ in comps)
        dqs = lax.fori_loop(0, lo, functools.partial(step, boundary=False), dqs)
        dqs = lax.fori_loop(lo, hi, functools.partial(step, boundary=True), dqs)
        for n, c in enumerate(comps):  # Q_c is read by this warpgroup alone: its buffer is free
            q_s.at[own, c][...] = (dqs[n] * scale).astype(dt)
        plgpu.commit_smem()
        for c in comps:
            plgpu.copy_smem_to_gmem(q_s.at[own, c], dq_ref.at[b, rows, 2 * h + c])
        plgpu.wait_smem_to_gmem(0)

    if split:
        pl.when(wg == 0)(functools.partial(compute, (0,)))
        pl.when(wg == 1)(functools.partial(compute, (1,)))
    else:
        pl.when(wg < wgs)(functools.partial(compute, (0, 1)))

    @pl.when(wg == wgs)
    def _memory():
        def issue(j, slot):
            cols = pl.ds(j * bk, bk)
            for c in range(2):
                plgpu.copy_gmem_to_smem(k_ref.at[b, cols, 2 * g + c], k_s[c].at[slot],
                                        k_bar.at[c * stages + slot])
            plgpu.copy_gmem_to_smem(v_ref.at[b, cols, g], v_s.at[slot], v_bar.at[slot])
            if has_seg:
                plgpu.copy_gmem_to_smem(ks_ref.at[b, cols], ks_s.at[slot], ks_bar.at[slot])

        _producer(hi, issue, consumed, stages)


def _dkv_body(*refs, causal, has_seg, d, bq, stages, wgs, split, share, fused, cta_rows, n_rep,
              n_q, ops):
    q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, lam_ref, *refs = refs
    qs_ref, ks_ref, *refs = refs if has_seg else (None, None, *refs)
    dqa_ref, *refs = refs if fused else (None, *refs)
    dk_ref, dv_ref, (k_s, v_s, q_r, do_r, st_r, lam_s, ks_s, qs_r, p_s, dq_s), bars = refs
    in_bar, q_bar, do_bar, st_bar, qs_bar, consumed, *done = bars
    # "share": P1ᵀ, P2ᵀ written (at 0) and read (at 1); "fused" dQ: dS1ᵀ, dS2ᵀ written over
    # them (at 2), and "read" waits for the dQ products that read them too
    p_bar = done[1] if share else None
    b, g, j = lax.axis_index("b"), lax.axis_index("g"), lax.axis_index("kv")
    wg = lax.axis_index("wg")
    dt = q_ref.dtype
    cta0 = j * cta_rows
    if causal:
        start = cta0 // bq
        mid = jnp.clip(pl.cdiv(cta0 + cta_rows - 1, bq), start, n_q)
    else:
        start = mid = jnp.int32(0)
    if has_seg:  # every step on the boundary path, as in dQ: with interior steps of their own
        mid = jnp.int32(n_q)  # (segment mask only) the "k" role's step spills more (d=128)
    per_head = n_q - start
    scale = d**-0.5

    def compute(role):
        """A compute warpgroup's loop and epilogue. role None: its own 64 kv rows, all of dK1,
        dK2 and dV; "v" / "k": the CTA's 64 rows shared with the other role, dV / dK1 and dK2."""
        _compute_registers(wgs, role)
        own = 0 if split else wg  # which K, V copy this warpgroup reads
        row0 = cta0 if split else cta0 + wg * ROWS
        rows = pl.ds(row0, ROWS)

        def bar_at(n):  # flat indices: the interpreter takes no barrier slices
            return in_bar.at[wg * 5 + n]

        kv = [(k_ref.at[b, rows, 2 * g + c], k_s.at[own, c], in_bar.at[own * 5 + c])
              for c in range(2)] + [(v_ref.at[b, rows, g], v_s.at[own], in_bar.at[own * 5 + 2])]
        mine = [(lam_ref, lam_s.at[wg], bar_at(3))] + (
            [(ks_ref.at[b, rows], ks_s.at[wg], bar_at(4))] if has_seg else [])
        if role == "k":  # the "v" warpgroup loads the shared K1, K2 and V
            _load(mine)
            for _, _, bar in kv:
                plgpu.barrier_wait(bar)
        else:
            _load(kv + mine)
        # λ along the kv rows: 2 registers a thread (along the bq columns it would be bq/4)
        lam = ops.vector(lam_s.at[wg], 0)
        ks = ops.vector(ks_s.at[wg], 0) if has_seg else None

        def add_dq(c, i, r):
            """dQ_c of query tile i, head r of the group += dS_c·K_c: dS_cᵀ from p_s[c]."""
            part = ops.dot(p_s.at[c], k_s.at[own, c], transpose_a=True)  # (bq, d)
            dq_sums = dqa_ref.at[b, j] if ops.emulate else dqa_ref.at[b]  # `bwd`: a CTA's own
            dst = dq_sums.at[pl.ds(i * bq, bq), 2 * (g * n_rep + r) + c]
            if dq_s is None:
                ops.atomic_add(dst, part)
                return
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last step's has left dq_s[c]
            dq_s[c][...] = part
            plgpu.commit_smem()
            ops.reduce_add(dq_s[c], dst)

        def step(i, carry, r, boundary):
            dks, dv = carry
            n = r * per_head + i - start
            if share and role == "k":
                return share_dk_step(n, dks, i, r), dv
            slot = lax.rem(n, stages)
            plgpu.barrier_wait(do_bar.at[slot])
            plgpu.barrier_wait(st_bar.at[2 * slot])
            plgpu.barrier_wait(st_bar.at[2 * slot + 1])
            dpt = None
            if role != "v":
                dpt = ops.dot(v_s.at[own], do_r.at[slot], transpose_b=True)  # (64, bq): dP1ᵀ
            qs = None
            if has_seg:
                plgpu.barrier_wait(qs_bar.at[slot])
                qs = ops.vector(qs_r.at[slot], 1)
            mask = _mask(ops, (ROWS, bq), i * bq, row0, causal=causal and boundary, qs=qs,
                         ks=ks, kv_len=None, transposed=True)
            def dk_step(c, pt):  # dK_c += dS_cᵀ·Q_c, dS_cᵀ = P_cᵀ∘(coef_c·dP1ᵀ − δ_c)
                delta = _bcast_cols(ops.vector(st_r.at[slot, 2 + c], 1), dpt.shape)
                dsc = pt * ((dpt if c == 0 else -_bcast_rows(lam, dpt.shape) * dpt) - delta)
                return ops.dot(dsc.astype(dt), q_r[c].at[slot], acc=dks[c])

            pts, new = [], []
            for c in range(2):
                plgpu.barrier_wait(q_bar.at[c * stages + slot])
                st = ops.dot(k_s.at[own, c], q_r[c].at[slot], transpose_b=True) * (scale * LOG2E)
                if mask is not None:
                    st = jnp.where(mask, st, MASKED)
                lse = ops.vector(st_r.at[slot, c], 1) * LOG2E
                pt = jnp.exp2(st - _bcast_cols(lse, st.shape))
                if role == "k":  # dS_c at once: P1ᵀ is dead before P2ᵀ is formed
                    new.append(dk_step(c, pt))
                else:
                    pts.append(pt)
            if share:  # to the "k" warpgroup, once it has read the last step's
                pl.when(n > 0)(lambda: plgpu.barrier_wait(p_bar.at[1]))
                for c in range(2):
                    p_s.at[c][...] = pts[c].astype(dt)
                plgpu.barrier_arrive(p_bar.at[0])
            if role != "k":
                pdiff = pts[0] - _bcast_rows(lam, pts[1].shape) * pts[1]  # P1ᵀ − λ·P2ᵀ
                dv = ops.dot(pdiff.astype(dt), do_r.at[slot], acc=dv)
            if fused:  # dQ2 here, dQ1 in the "k" warpgroup, once it has written dS1ᵀ, dS2ᵀ
                plgpu.barrier_wait(p_bar.at[2])
                add_dq(1, i, r)
            if role is None:
                new = [dk_step(c, pts[c]) for c in range(2)]
            if role != "v":
                dks = tuple(new)
            plgpu.barrier_arrive(consumed.at[slot])
            return dks, dv

        def share_dk_step(n, dks, i, r):
            """The "k" warpgroup's step under "share": dPᵀ, then dK_c += dS_cᵀ·Q_c with the
            "v" warpgroup's P_cᵀ (zero where masked); with "fused" dQ, dS_cᵀ replaces P_cᵀ in
            shared memory and this warpgroup adds dQ1."""
            slot = lax.rem(n, stages)
            plgpu.barrier_wait(do_bar.at[slot])
            plgpu.barrier_wait(st_bar.at[2 * slot + 1])
            dpt = ops.dot(v_s.at[own], do_r.at[slot], transpose_b=True)  # (64, bq): dP1ᵀ
            plgpu.barrier_wait(p_bar.at[0])
            new = []
            for c in range(2):
                pt = ops.tile(p_s.at[c]).astype(jnp.float32)
                delta = _bcast_cols(ops.vector(st_r.at[slot, 2 + c], 1), dpt.shape)
                dsc = pt * ((dpt if c == 0 else -_bcast_rows(lam, dpt.shape) * dpt) - delta)
                dsc = dsc.astype(dt)
                if fused:  # this thread's own elements of P_cᵀ, read above
                    p_s.at[c][...] = dsc
                plgpu.barrier_wait(q_bar.at[c * stages + slot])
                new.append(ops.dot(dsc, q_r[c].at[slot], acc=dks[c]))
            if fused:
                plgpu.commit_smem()  # dSᵀ to the tensor cores' (async) proxy, then to "v"
                plgpu.barrier_arrive(p_bar.at[2])
                add_dq(0, i, r)
            plgpu.barrier_arrive(p_bar.at[1])
            plgpu.barrier_arrive(consumed.at[slot])
            return tuple(new)

        def head(r, carry):
            carry = lax.fori_loop(start, mid, functools.partial(step, r=r, boundary=True), carry)
            return lax.fori_loop(mid, n_q, functools.partial(step, r=r, boundary=False), carry)

        dks = None if role == "v" else (ops.full((ROWS, d), 0.0), ops.full((ROWS, d), 0.0))
        dv = None if role == "k" else ops.full((ROWS, 2 * d), 0.0)
        dks, dv = lax.fori_loop(0, n_rep, head, (dks, dv))
        if share and role == "v":  # the last step's P read: every phase is awaited once
            pl.when(n_rep * per_head > 0)(lambda: plgpu.barrier_wait(p_bar.at[1]))
        if split:  # both roles are done reading K and V before either overwrites them
            plgpu.barrier_arrive(done[0].at[0])
            plgpu.barrier_wait(done[0].at[0])
        if dks is not None:
            for c in range(2):
                k_s.at[own, c][...] = (dks[c] * scale).astype(dt)
        if dv is not None:
            v_s.at[own][...] = dv.astype(dt)
        plgpu.commit_smem()
        if dks is not None:
            for c in range(2):
                plgpu.copy_smem_to_gmem(k_s.at[own, c], dk_ref.at[b, rows, 2 * g + c])
        if dv is not None:
            plgpu.copy_smem_to_gmem(v_s.at[own], dv_ref.at[b, rows, g])
        plgpu.wait_smem_to_gmem(0)

    if split:
        pl.when(wg == 0)(functools.partial(compute, "v"))
        pl.when(wg == 1)(functools.partial(compute, "k"))
    else:
        pl.when(wg < wgs)(functools.partial(compute, None))

    @pl.when(wg == wgs)
    def _memory():
        def issue(n, slot):
            h = g * n_rep + n // per_head
            cols = pl.ds((start + lax.rem(n, per_head)) * bq, bq)
            for c in range(2):
                plgpu.copy_gmem_to_smem(q_ref.at[b, cols, 2 * h + c], q_r[c].at[slot],
                                        q_bar.at[c * stages + slot])
            plgpu.copy_gmem_to_smem(do_ref.at[b, cols, h], do_r.at[slot], do_bar.at[slot])
            plgpu.copy_gmem_to_smem(lse_ref.at[b, h, :, cols], st_r.at[slot, pl.ds(0, 2)],
                                    st_bar.at[2 * slot])
            plgpu.copy_gmem_to_smem(dl_ref.at[b, h, :, cols], st_r.at[slot, pl.ds(2, 2)],
                                    st_bar.at[2 * slot + 1])
            if has_seg:
                plgpu.copy_gmem_to_smem(qs_ref.at[b, cols], qs_r.at[slot], qs_bar.at[slot])

        _producer(n_rep * per_head, issue, consumed, stages)


# jit per (shapes, statics), as `fwd`
@functools.partial(jax.jit, static_argnames=("causal", "tiles", "interpret"))
def bwd(q: jax.Array, k: jax.Array, v: jax.Array, lam: jax.Array, q_seg: jax.Array | None,
        kv_seg: jax.Array | None, do: jax.Array, lse: jax.Array, delta: jax.Array, *,
        causal: bool, tiles: Tiles,
        interpret: Any = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients (dq, dk, dv) in the input dtypes: two kernels (dQ, then dK/dV), or one with
    `tiles.dq` "fused" or "fused_tma" (dK/dV adding into dQ's float32 sums).

    q (B, T, 2H, d), k (B, S, 2Hkv, d), v (B, S, Hkv, 2d), do (B, T, H, 2d); lse and delta
    (B, H, 2, T) float32 (natural-log lse; δ1 = rowsum(dO∘O) + λ·r2, δ2 = −λ·r2).
    `interpret` as in `fwd`.
    """
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], v.shape[2]
    h = hq // 2
    n_rep = h // hkv
    wgs_dq, wgs_dkv, split = warpgroups(d, tiles)
    split_dq, fused = tiles.dq == "split", tiles.dq in FUSED
    bk, bq, stages = tiles.block_kv_dq, tiles.block_q_dkv, tiles.stages
    rows_dq = 1 if fused else ROWS if split_dq else ROWS * wgs_dq  # query rows of a dQ CTA
    rows_dkv = ROWS if split else ROWS * wgs_dkv  # kv rows of a dK/dV CTA
    tp = _round_up(t, math.lcm(rows_dq, bq))
    sp = _round_up(s, math.lcm(rows_dkv, 1 if fused else bk))
    has_seg = q_seg is not None
    q, do = _pad_rows(q, tp), _pad_rows(do, tp)
    lse, delta = _pad_rows(lse, tp, axis=3), _pad_rows(delta, tp, axis=3)
    k, v = _pad_rows(k, sp), _pad_rows(v, sp)
    segs = [_pad_rows(q_seg, tp), _pad_rows(kv_seg, sp)] if has_seg else []
    dt = q.dtype
    ops = _Ops(bool(interpret))
    lam_vec = jnp.full((ROWS,), lam, jnp.float32)
    dkv = functools.partial(
        _dkv_body, causal=causal, has_seg=has_seg, d=d, bq=bq, stages=stages, wgs=wgs_dkv,
        split=split, share=tiles.dkv == "share", fused=fused, cta_rows=rows_dkv, n_rep=n_rep,
        n_q=tp // bq, ops=ops)
    dkv_kernel = functools.partial(
        _kernel, dkv, out=[jax.ShapeDtypeStruct(k.shape, dt), jax.ShapeDtypeStruct(v.shape, dt)],
        scratch=_dkv_scratch(d, tiles, wgs_dkv, split, dt, has_seg),
        grid=(b, hkv, sp // rows_dkv), names=("b", "g", "kv"), threads=wgs_dkv + 1,
        interpret=interpret)
    if fused:  # one kernel; dQ's float32 sums start from zero and are added into in place,
        # interpreted one slice a CTA (`_Ops.atomic_add`), summed here
        n_ctas = sp // rows_dkv
        dq_sum = jax.new_ref(jnp.zeros((b, n_ctas, *q.shape[1:]) if ops.emulate else q.shape,
                                       jnp.float32))
        dk, dv = dkv_kernel(name="diff_flash_dkdvdq")(q, k, v, do, lse, delta, lam_vec, *segs,
                                                      dq_sum)
        dq = dq_sum[...].sum(axis=1) if ops.emulate else dq_sum[...]
        dq = (dq * d**-0.5).astype(dt)
        return dq[:, :t], dk[:, :s], dv[:, :s]

    dq = _kernel(
        functools.partial(_dq_body, causal=causal, has_seg=has_seg, d=d, bk=bk, stages=stages,
                          wgs=wgs_dq, split=split_dq, n_rep=n_rep, kv_len=s, n_kv=sp // bk,
                          ops=ops),
        out=jax.ShapeDtypeStruct(q.shape, dt),
        scratch=_dq_scratch(d, tiles, wgs_dq, dt, has_seg, split_dq),
        grid=(b, h, tp // rows_dq), names=("b", "h", "q"), threads=wgs_dq + 1,
        interpret=interpret, name="diff_flash_dq",
    )(q, k, v, do, lse, delta, lam_vec, *segs)
    dk, dv = dkv_kernel(name="diff_flash_dkdv")(q, k, v, do, lse, delta, lam_vec, *segs)
    return dq[:, :t], dk[:, :s], dv[:, :s]
