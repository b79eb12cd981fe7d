"""Fused flash attention (differential or standard): `custom_vjp` and per-platform dispatch.

`flash_attention(..., num_components=2)` is the differential operator
`softmax(s·Q1K1ᵀ+M)·V − λ·softmax(s·Q2K2ᵀ+M)·V`; `num_components=1` is standard attention. The
backward pass uses these exact identities (no division by λ, which is learnable and can be 0):
  dP1 = dO·Vᵀ, dP2 = −λ·dP1, r2 = rowsum(dO∘O2), δ1 = rowsum(dO∘O) + λ·r2, δ2 = −λ·r2,
  dλ = −Σ r2, dSc = Pc∘(dPc − δc)·s.
Residuals: O, O2 (input dtype) and the logsumexps (B, H, nc, T) float32.

The kernel is picked per lowering platform with `lax.platform_dependent`: on cuda the Mosaic GPU
kernel (`flash_mgpu`) when the GPU is a Hopper (compute capability 9.x, read by
`kernels.hopper.compute_capability()` at trace time: an explicit `kernels.gpu_target(...)`, else
the attached GPU, else 9.0 when none is attached, e.g. exporting from a CPU host) and the call is
one it takes (differential, bf16/fp16, d ∈ {64, 96, 128}, V 2d wide); otherwise Pallas' Triton
backend (`flash_gpu`): before Hopper, on Blackwell (10.x and later: the kernel's wgmma and
setmaxnreg are sm_90a instructions), and on Hopper the route for float32 inputs, standard
attention and other widths (Triton's float32 dots run as TF32 there). rocm: Triton;
tpu: Mosaic TPU; elsewhere (CPU) the Triton-style kernel under the Pallas interpreter.
`backend=` forces one: "gpu" (Triton), "mosaic_gpu", "tpu" (interpreted off their device;
"mosaic_gpu" on CPU runs under Mosaic GPU's own interpreter). `interpret=True` interprets on
every platform, with no dispatch: the kernel `backend` names (None: the Triton-style one) under
its interpreter. An interpreter's own settings (`pltpu.InterpretParams`, Mosaic GPU's
`InterpretGPUParams`) do the same for the kernel they are for, which `backend` must name.

Head widths: d (q, k) any multiple of 16 in [16, 256], dv (v, output) any multiple of 16 up to
512; the paper's d = 96 and 128 with dv = 2d included. Mosaic TPU takes them as they are (Mosaic
GPU: d ∈ {64, 96, 128}); the Triton kernels zero-pad d and dv to the next power of two
(`flash_gpu`), so their tile defaults are chosen from the padded width.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import flash_gpu, flash_mgpu, flash_tpu, hopper
from .reference import check_causal, check_layout


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes and Triton launch parameters; None takes the backend's default.

    The Triton and TPU kernels read the first eight fields; the Mosaic GPU kernel reads only
    `mosaic_gpu` (its own `flash_mgpu.Tiles`; None: the row of kernels/tuning/mosaic_gpu.json),
    so one BlockSizes serves every platform a call may be lowered for. Sizes are positive ints
    (else a ValueError naming the field); the Triton kernels round a tile down to a power of two
    (at least 16), the TPU kernels up to a multiple of 128, both to at most the padded length.
    """

    block_q: int | None = None
    block_k: int | None = None
    block_q_bwd: int | None = None
    block_k_bwd: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    num_warps_bwd: int | None = None
    num_stages_bwd: int | None = None
    mosaic_gpu: flash_mgpu.Tiles | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "mosaic_gpu" and value is not None and (
                    not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1):
                raise ValueError(f"BlockSizes.{f.name} must be a positive int or None, got {value!r}")
            if f.name != "mosaic_gpu" and value is not None:  # numpy.int64 (a sweep's) -> int:
                object.__setattr__(self, f.name, int(value))  # the tile code calls bit_length


MAX_HEAD_DIM, MAX_VALUE_DIM = 256, 512

# Tuned on an H100 (bf16, d = 64, causal; benchmarks/results/attention_nvidia_h100*.md).
GPU_DEFAULTS = BlockSizes(block_q=128, block_k=64, block_q_bwd=64, block_k_bwd=64, num_warps=8,
                          num_stages=3, num_warps_bwd=4, num_stages_bwd=2)
# Shared memory grows with the bytes of a (padded) head row (itemsize × d): rows twice as wide
# (float32 at d = 64, bf16 at d = 96 or 128) exceed the H100's 227 KB with the setting above;
# four times and more (float32 from d = 96, bf16 from d = 144) need smaller tiles still.
GPU_DEFAULTS_WIDE = BlockSizes(block_q=64, block_k=64, block_q_bwd=64, block_k_bwd=64, num_warps=4,
                               num_stages=2, num_warps_bwd=4, num_stages_bwd=2)
GPU_DEFAULTS_WIDEST = BlockSizes(block_q=32, block_k=32, block_q_bwd=32, block_k_bwd=32,
                                 num_warps=4, num_stages=1, num_warps_bwd=4, num_stages_bwd=1)


def gpu_defaults(itemsize: int, head_dim: int) -> BlockSizes:
    """The GPU tile defaults for inputs of `itemsize` bytes and component width `head_dim`, from
    the width the Triton kernels pad it to (the next power of two)."""
    row_bytes = itemsize * flash_gpu.lanes(head_dim)
    if row_bytes <= 128:
        return GPU_DEFAULTS
    return GPU_DEFAULTS_WIDE if row_bytes <= 256 else GPU_DEFAULTS_WIDEST


TPU_DEFAULTS = BlockSizes(block_q=512, block_k=512, block_q_bwd=256, block_k_bwd=256)
# Rows over 512 bytes (float32 beyond d = 128) overflow the forward's 16 MiB of scoped VMEM (v5p)
# with 512-row tiles; 256 rows fit up to float32 at d = 256, dv = 512.
TPU_DEFAULTS_WIDE = BlockSizes(block_q=256, block_k=256, block_q_bwd=256, block_k_bwd=256)


def tpu_defaults(itemsize: int, head_dim: int) -> BlockSizes:
    """The TPU tile defaults for inputs of `itemsize` bytes and component width `head_dim`."""
    return TPU_DEFAULTS if itemsize * head_dim <= 512 else TPU_DEFAULTS_WIDE


def supports_head_dim(d: int) -> bool:
    """Whether the kernels take q/k heads of width d: a multiple of 16 in [16, 256]."""
    return d % 16 == 0 and 16 <= d <= MAX_HEAD_DIM


def _fill(bs: BlockSizes | None, defaults: BlockSizes) -> dict[str, int]:
    bs = bs or BlockSizes()
    return {f.name: getattr(bs, f.name) if getattr(bs, f.name) is not None
            else getattr(defaults, f.name) for f in dataclasses.fields(BlockSizes)
            if f.name != "mosaic_gpu"}


@dataclasses.dataclass(frozen=True)
class _Config:
    nc: int
    causal: bool
    block_sizes: BlockSizes | None
    interpret: Any  # None | bool | pltpu.InterpretParams
    backend: str | None  # None: by platform; "gpu" / "mosaic_gpu" / "tpu": that kernel


def _gpu_kwargs(cfg: _Config, bwd: bool, itemsize: int, head_dim: int) -> dict[str, int]:
    kw = _fill(cfg.block_sizes, gpu_defaults(itemsize, head_dim))
    warps, stages = kw.pop("num_warps_bwd"), kw.pop("num_stages_bwd")
    if bwd:
        kw["num_warps"], kw["num_stages"] = warps, stages
    else:
        kw.pop("block_q_bwd"), kw.pop("block_k_bwd")
    return kw


def _tpu_kwargs(cfg: _Config, bwd: bool, itemsize: int, head_dim: int) -> dict[str, int]:
    kw = _fill(cfg.block_sizes, tpu_defaults(itemsize, head_dim))
    for name in ("num_warps", "num_stages", "num_warps_bwd", "num_stages_bwd"):
        kw.pop(name)
    if not bwd:
        kw.pop("block_q_bwd"), kw.pop("block_k_bwd")
    return kw


def _tpu_interpret(interpret):
    if interpret is True:
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.InterpretParams()
    return interpret


def mosaic_tiles(block_sizes: BlockSizes | None, head_dim: int,
                 dtype: jax.typing.DTypeLike) -> flash_mgpu.Tiles:
    """The Mosaic GPU kernel's tiles: `block_sizes.mosaic_gpu`, else the table's row for the
    GPU, d and dtype (`kernels.hopper`). One ValueError naming a field that is invalid or
    overflows shared memory."""
    tiles = block_sizes.mosaic_gpu if block_sizes is not None else None
    if tiles is None:
        tiles, _ = hopper.tiles_for(head_dim, dtype)
    flash_mgpu.warpgroups(head_dim, tiles)  # checks the fields and the shared-memory plan
    return tiles


def uses_mosaic_gpu(nc: int, q_dtype: jax.typing.DTypeLike, head_dim: int, value_dim: int) -> bool:
    """Whether a cuda lowering with backend=None runs the Mosaic GPU kernel (else Triton)."""
    return (flash_mgpu.supports(q_dtype, head_dim, nc) and value_dim == 2 * head_dim
            and hopper.compute_capability()[0] == hopper.HOPPER[0])


def _dispatch(cfg: _Config, gpu_fn, mgpu_fn, tpu_fn, *args, bwd: bool):
    """Run the kernel that fits the lowering platform (or `cfg.backend`)."""
    nc, causal = cfg.nc, cfg.causal
    q, v = args[0], args[2]
    itemsize, head_dim = jnp.dtype(q.dtype).itemsize, q.shape[-1]

    def gpu(interpret):
        return gpu_fn(*args, nc=nc, causal=causal, interpret=bool(interpret),
                      **_gpu_kwargs(cfg, bwd, itemsize, head_dim))

    def mgpu(interpret):
        return mgpu_fn(*args, causal=causal, interpret=interpret,
                       tiles=mosaic_tiles(cfg.block_sizes, head_dim, q.dtype))

    def tpu(interpret):
        return tpu_fn(*args, nc=nc, causal=causal, interpret=_tpu_interpret(interpret),
                      **_tpu_kwargs(cfg, bwd, itemsize, head_dim))

    if cfg.interpret:  # interpreted on every platform: nothing to dispatch on
        return {"tpu": tpu, "mosaic_gpu": mgpu}.get(cfg.backend, gpu)(cfg.interpret)
    off_device = cfg.interpret is None  # False: compiled on every platform, CPU included
    branches = {}
    mosaic = cfg.backend == "mosaic_gpu" or (
        cfg.backend is None and uses_mosaic_gpu(nc, q.dtype, head_dim, v.shape[-1]))
    if cfg.backend in (None, "gpu", "mosaic_gpu"):
        branches["cuda"] = (lambda: mgpu(False)) if mosaic else (lambda: gpu(False))
    if cfg.backend in (None, "gpu"):
        branches["rocm"] = lambda: gpu(False)
    if cfg.backend in (None, "tpu"):
        branches["tpu"] = lambda: tpu(False)
    default = {"tpu": lambda: tpu(off_device),
               "mosaic_gpu": lambda: mgpu(off_device)}.get(cfg.backend, lambda: gpu(off_device))
    return lax.platform_dependent(**branches, default=default)


def _forward(cfg, q, k, v, lam, q_seg, kv_seg):
    return _dispatch(cfg, flash_gpu.fwd, flash_mgpu.fwd, flash_tpu.fwd, q, k, v, lam, q_seg,
                     kv_seg, bwd=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q, k, v, lam, q_seg, kv_seg):
    return _forward(cfg, q, k, v, lam, q_seg, kv_seg)[0]


def _flash_fwd(cfg, q, k, v, lam, q_seg, kv_seg):
    o, o2, lse = _forward(cfg, q, k, v, lam, q_seg, kv_seg)
    return o, (q, k, v, lam, q_seg, kv_seg, o, o2, lse)


def _flash_bwd(cfg, res, do):
    q, k, v, lam, q_seg, kv_seg, o, o2, lse = res
    do32 = do.astype(jnp.float32)
    r1 = jnp.einsum("bthe,bthe->bht", do32, o.astype(jnp.float32))  # (B, H, T)
    if cfg.nc == 2:
        r2 = jnp.einsum("bthe,bthe->bht", do32, o2.astype(jnp.float32))
        delta = jnp.stack([r1 + lam * r2, -lam * r2], axis=2)  # (B, H, 2, T)
        dlam = -jnp.sum(r2)
    else:
        delta, dlam = r1[:, :, None], jnp.zeros((), jnp.float32)
    dq, dk, dv = _dispatch(cfg, flash_gpu.bwd, flash_mgpu.bwd, flash_tpu.bwd, q, k, v, lam, q_seg,
                           kv_seg, do, lse, delta, bwd=True)
    return dq, dk, dv, dlam.reshape(lam.shape).astype(lam.dtype), None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lam: jax.Array | float | None = None,
    *,
    num_components: int,
    segment_ids: jax.Array | None = None,
    causal: bool = True,
    block_sizes: BlockSizes | None = None,
    interpret: Any = None,
    backend: str | None = None,
) -> jax.Array:
    """Fused attention with `num_components` softmaxes (2: differential, 1: standard).

    q (B, T, H·nc, d), k (B, S, Hkv·nc, d), v (B, S, Hkv, dv) -> (B, T, H, dv), d a multiple of
    16 in [16, 256], dv a multiple of 16 up to 512. `causal` a bool (a NumPy bool is one; a
    TypeError otherwise). `lam`, a scalar, is required with nc = 2
    (None with nc = 1) and differentiable. `segment_ids` (B, T) requires S == T.
    `interpret=None` interprets on platforms without a kernel (CPU), True on every platform;
    `backend` forces the "gpu" (Triton), "mosaic_gpu" or "tpu" kernel (see the module docstring
    for the default choice and the interpreters).
    """
    nc = num_components
    if nc not in (1, 2):
        raise ValueError(f"num_components must be 1 or 2, got {nc}")
    if (lam is None) != (nc == 1):
        raise ValueError(f"lam (λ) is required with num_components=2 and taken only then; got "
                         f"num_components={nc}, lam={'None' if lam is None else 'given'}")
    causal = check_causal(causal)
    check_layout(q, k, v, num_components=nc, segment_ids=segment_ids, lam=lam)
    d = q.shape[3]
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):  # a dict: .block_q
        raise TypeError(f"block_sizes must be a kernels.BlockSizes or None, got "
                        f"{type(block_sizes).__name__}")
    if backend not in (None, "gpu", "mosaic_gpu", "tpu"):
        raise ValueError(f"backend must be None, 'gpu', 'mosaic_gpu' or 'tpu', got {backend!r}")
    if not supports_head_dim(d):
        raise ValueError(f"the pallas kernels need the head width d to be a multiple of 16 in "
                         f"[16, {MAX_HEAD_DIM}], got d = {d}")
    dv = v.shape[3]
    if dv % 16 or not 16 <= dv <= MAX_VALUE_DIM:
        raise ValueError(f"the pallas kernels need the value width dv to be a multiple of 16 in "
                         f"[16, {MAX_VALUE_DIM}], got dv = {dv}")
    if isinstance(interpret, np.bool_):  # np.True_ was refused as interpreter settings
        interpret = bool(interpret)
    if interpret is not None and not isinstance(interpret, bool) and backend is None:
        raise ValueError(f"interpret={interpret!r} holds one kernel's interpreter settings: name "
                         f"that kernel, flash_attention(..., backend='tpu' or 'mosaic_gpu')")
    if backend == "mosaic_gpu" and not (flash_mgpu.supports(q.dtype, d, nc) and dv == 2 * d):
        raise ValueError(f"backend='mosaic_gpu' takes differential attention in bfloat16/float16 "
                         f"with d in {flash_mgpu.HEAD_DIMS} and dv = 2d, got nc={nc}, "
                         f"{jnp.dtype(q.dtype).name}, d={d}, dv={dv}")
    if 0 in (q.shape[0], q.shape[1], k.shape[1]):  # no rows, queries or keys: the oracle's zeros
        return jnp.zeros((*q.shape[:2], q.shape[2] // nc, dv), q.dtype)
    q_seg = kv_seg = None
    if segment_ids is not None:
        q_seg = kv_seg = segment_ids.astype(jnp.int32)
    lam = jnp.asarray(0.0 if lam is None else lam, jnp.float32)  # nc = 1: unused
    cfg = _Config(nc, causal, block_sizes, interpret, backend)
    return _flash(cfg, q, k, v, lam, q_seg, kv_seg)
