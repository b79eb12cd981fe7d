"""The Mosaic GPU (Hopper) differential kernel on a CPU: interpreter numerics, CUDA lowerings,
dispatch and tiles.

Numerics run `kernels/flash_mgpu.py` under Mosaic GPU's interpreter (jax 0.10.2 with jax 0.11's
caching of its thread bodies, `_run_jaxpr`; and jax 0.11), which simulates the warpgroups as
threads, the TMA copies and barriers (every barrier phase must be awaited once by each thread, or
it raises), but stands in plain loads and dots for wgmma, `plgpu.load` and layout casts
(`flash_mgpu._Ops`). The interpreter runs the three warpgroups on XLA's CPU threads: it needs
more than two (conftest's 8 host devices give them). Tolerances as tests/test_kernels.py's bf16
ones (2e-2; dλ 5e-2), 8 times tighter in float16, against the float64 reference of the same
rounded inputs. The CUDA exports run the real Mosaic GPU lowering (layouts, wgmma shapes,
swizzles, TMA slices) on this machine; only ptxas and the run itself need the GPU.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax import export
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call  # no public API in 0.10.2
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
from jax.experimental.mosaic.gpu import core as mosaic_gpu_core

from diff_jax import kernels
from diff_jax.kernels import BlockSizes, flash, flash_mgpu, hopper
from diff_jax.kernels.flash import flash_attention
from diff_jax.kernels.float64_reference import diff_attention as np_diff_attention
from test_kernels import TRITON, _abstract, _fwd_bwd, make_inputs, rel

MOSAIC = "stablehlo.custom_call @mosaic_gpu"

# (B, T, H, Hkv, d, causal, segments, dtype, λ, Tiles fields): the kernel-test matrix's GPU
# cases at the widths and dtypes this kernel takes, kept few for time; T ragged against the
# 64-row tiles, and at T = 130 every ring slot is refilled. Each shape runs the table's tiles
# (dK/dV "auto": split at both widths; dQ "rows"; forward ping-pong on) and the other schedules
# ("rows" dK/dV, "split" dQ) with ping-pong off; the d = 64 one with 64-key forward tiles, so
# the last query rows have an interior tile (below the diagonal) whose keys of document 1 only
# the segment mask removes, and with two kv heads: the only case where a head reads kv group 1
# (with one kv head in every case, a forward, dQ or dK/dV that read group 0's K and V for every
# head passed every test). d = 96 differs from these in the interpreter only by shape; its
# lowering (64-byte swizzle) is exported below.
CASES = {
    "mqa-causal-segments-neg-lam-d64": (1, 70, 2, 1, 64, True, True, jnp.bfloat16, -0.5, {}),
    "mha-causal-segments-neg-lam-d64-rows-splitdq-nopingpong-bk64": (
        1, 70, 2, 2, 64, True, True, jnp.bfloat16, -0.5,
        {"dkv": "rows", "pingpong": False, "dq": "split", "block_kv": 64}),
    "mqa-causal-segments-neg-lam-d64-share": (1, 70, 2, 1, 64, True, True, jnp.bfloat16, -0.5,
                                               {"dkv": "share"}),
    "mha-causal-segments-neg-lam-d64-share-fuseddq": (
        1, 130, 2, 2, 64, True, True, jnp.bfloat16, -0.5, {"dkv": "share", "dq": "fused"}),
    "gqa-causal-segments-d64-share-fusedtma": (
        1, 130, 4, 2, 64, True, True, jnp.bfloat16, 0.6, {"dkv": "share", "dq": "fused_tma"}),
    "gqa-noncausal-d128-fp16-share-fuseddq": (1, 130, 4, 2, 128, False, False, jnp.float16, 0.7,
                                              {"dkv": "share", "dq": "fused"}),
    "mha-noncausal-lam0-d128-fp16": (1, 130, 1, 1, 128, False, False, jnp.float16, 0.0, {}),
    "mha-noncausal-lam0-d128-fp16-rows-splitdq-nopingpong": (
        1, 130, 1, 1, 128, False, False, jnp.float16, 0.0,
        {"dkv": "rows", "pingpong": False, "dq": "split"}),
}


def _run(jaxpr, consts, *args):
    jax.core.eval_jaxpr(jaxpr, consts, *args)


def _run_jaxpr(jaxpr, consts, *args):
    """jax 0.11's `thread_map._run_jaxpr`: `_run` at module level, so the interpreter's
    `jit(...).trace().lower().compile()` of a kernel body hits JAX's caches. jax 0.10.2 defines
    `_run` inside `_run_jaxpr`, a new function each call, so every warpgroup thread of every grid
    point compiled the same body again (its callbacks keep it out of the persistent cache too):
    6 to 12 identical compiles of several seconds each per case."""
    jax.jit(_run, static_argnums=(0,)).trace(jaxpr, consts, *args).lower().compile()(consts, *args)


@pytest.fixture(scope="module", autouse=True)
def _interpreter_compiles_each_kernel_body_once():
    """Under jax 0.10.2, the interpreter with jax 0.11's caching of thread bodies (`_run_jaxpr`);
    what the threads run is unchanged."""
    if jax.__version_info__ >= (0, 11):
        yield
        return
    from jax._src.pallas.mosaic.interpret import thread_map

    with pytest.MonkeyPatch.context() as m:
        m.setattr(thread_map, "_run_jaxpr", _run_jaxpr)
        yield


needs_threads = pytest.mark.skipif(
    len(jax.devices("cpu")) < 3, reason="the Mosaic GPU interpreter's three warpgroups block "
    "each other with fewer than 3 host devices (conftest sets 8)")


@needs_threads
@pytest.mark.parametrize("name", list(CASES))
def test_mosaic_kernel_matches_float64_reference(name, capsys):
    """Forward and all gradients (λ too) of fwd, dQ and dK/dV under the interpreter, with its
    shared-memory race detector: every access ordered by a barrier (and, on jax 0.11, a TMA
    refill of a slot read with generic loads ordered by a proxy fence)."""
    b, t, h, hkv, d, causal, segments, dtype, lam, fields = CASES[name]
    if fields.get("dq") in flash_mgpu.FUSED and not flash_mgpu.FUSED_DQ:
        pytest.skip("fused dQ needs jax >= 0.11 (CI runs this file on jax 0.11.2 too)")
    q, k, v, do, seg = make_inputs(b, t, h, hkv, d, dtype, seed=len(name), segments=segments)
    interpret = InterpretGPUParams(detect_races=True)
    tiles = dataclasses.replace(hopper.tiles_for(d, dtype, kind="")[0], **fields)

    def loss(q, k, v, lam):
        out = flash_attention(q, k, v, lam, num_components=2, segment_ids=seg, causal=causal,
                              backend="mosaic_gpu", interpret=interpret,
                              block_sizes=BlockSizes(mosaic_gpu=tiles))
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        q, k, v, jnp.float32(lam))
    assert out.dtype == dtype and out.shape == (b, t, h, 2 * d)
    # races_found covers the last kernel run; each race is also printed, by any of the three
    assert not interpret_pallas_call.get_races().races_found
    assert "RACE DETECTED" not in capsys.readouterr().out
    ref_out, ref_grads = np_diff_attention(*(x.astype(jnp.float32) for x in (q, k, v)), lam,
                                           do.astype(jnp.float32), causal=causal, seg=seg)
    # float16 has 3 more mantissa bits than bfloat16: 8 times tighter (its cases sit near 3e-4;
    # one zero-padded key let into every softmax of the d = 128 case is 4.6e-3 off)
    tol = 2e-2 * float(jnp.finfo(dtype).eps / jnp.finfo(jnp.bfloat16).eps)
    assert rel(out, ref_out) < tol
    for nm, g, r in zip(("dq", "dk", "dv", "dλ"), grads, ref_grads):
        assert g.dtype == (jnp.float32 if nm == "dλ" else dtype), nm
        assert bool(jnp.isfinite(g.astype(jnp.float32)).all()), nm
        assert rel(g, r) < (2.5 * tol if nm == "dλ" else tol), (nm, rel(g, r))
    if segments:  # padding rows output exactly 0
        assert float(jnp.abs(out.astype(jnp.float32) * (seg == 0)[:, :, None, None]).max()) == 0.0


@needs_threads
def test_mosaic_kernel_with_fewer_keys_than_queries():
    """Causal with S < T, S not a whole kv tile (T = 200, S = 70, 128-key tiles): query rows
    past the keys' last tile took it as an interior tile (no length mask), so its zero-padded
    keys entered their softmaxes (forward 16% off the reference); they are masked now. "rows"
    dK/dV (two warpgroups, 128 kv rows a CTA): the only causal case without segment ids (which
    mask every step) on that schedule, so its causal mask must cover the q tiles up to the CTA's
    last kv row (a boundary taken from its first 64 rows passed every test; dk 3.7% off here).
    One head: the interpreter compiles each grid point's warpgroups anew, so a second head (the
    matrix's cases cover sharing a kv head) would only add compiles."""
    b, t, s, h, hkv, d = 1, 200, 70, 1, 1, 64
    q, _, _, do, _ = make_inputs(b, t, h, hkv, d, jnp.bfloat16, seed=3, segments=False)
    _, k, v, _, _ = make_inputs(b, s, h, hkv, d, jnp.bfloat16, seed=4, segments=False)
    tiles = dataclasses.replace(hopper.tiles_for(d, jnp.bfloat16, kind="")[0], dkv="rows")
    assert tiles.block_kv == 128 and tiles.block_kv_dq == 64
    assert flash_mgpu.warpgroups(d, tiles)[1:] == (2, False)

    def loss(q, k, v, lam):
        out = flash_attention(q, k, v, lam, num_components=2, causal=True, backend="mosaic_gpu",
                              interpret=True, block_sizes=BlockSizes(mosaic_gpu=tiles))
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        q, k, v, jnp.float32(0.5))
    ref_out, ref_grads = np_diff_attention(*(x.astype(jnp.float32) for x in (q, k, v)), 0.5,
                                           do.astype(jnp.float32), causal=True, seg=None)
    assert rel(out, ref_out) < 2e-2
    for nm, g, r in zip(("dq", "dk", "dv", "dλ"), grads, ref_grads):
        assert rel(g, r) < (5e-2 if nm == "dλ" else 2e-2), (nm, rel(g, r))


def test_the_interpreter_with_too_few_cpu_devices_is_refused_not_a_hang(monkeypatch):
    """Mosaic GPU's interpreter runs a kernel's warpgroups on XLA's CPU devices' threads: with
    three devices, the forward's three warpgroups waited forever at their first barrier (one,
    a user's default, as well). Such a call is one ValueError naming the flag (this process has
    eight devices: three are stood in)."""
    cpus = jax.devices("cpu")[:3]
    monkeypatch.setattr(flash_mgpu.jax, "devices", lambda backend=None: cpus)
    q, k, v, _, _ = make_inputs(1, 24, 1, 1, 64, jnp.bfloat16, seed=9, segments=False)
    with pytest.raises(ValueError, match=r"Mosaic GPU's interpreter runs diff_flash_fwd's 3 "
                                         r"warpgroups on XLA's CPU devices and waits forever on "
                                         r"3, fewer than 4: set XLA_FLAGS=--xla_force_host_"
                                         r"platform_device_count=8"):
        flash_attention(q, k, v, jnp.float32(0.5), num_components=2, backend="mosaic_gpu",
                        interpret=True)


def _cuda_export(*abstract):
    return export.export(_fwd_bwd("pallas"), platforms=["cuda"],
                         disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)])(
        *abstract).mlir_module()


@pytest.mark.parametrize("d,dtype", [(64, jnp.bfloat16), (96, jnp.bfloat16), (128, jnp.float16)])
def test_cuda_export_hopper_lowers_mosaic_kernels(d, dtype):
    """With no GPU attached the target is Hopper: forward, dQ and dK/dV lower through Mosaic GPU
    (segments, GQA, ragged T) and no Triton kernel is left; float32 stays on Triton."""
    text = _cuda_export(*_abstract(d=d, dtype=dtype))
    assert text.count(MOSAIC) == 3 and TRITON not in text
    with kernels.gpu_target("9.0"):  # jax 0.11's Triton lowering needs the GPU named
        text = _cuda_export(*_abstract(d=d, dtype=jnp.float32))
    assert text.count(TRITON) == 3 and MOSAIC not in text


@pytest.mark.skipif(not flash_mgpu.FUSED_DQ, reason="fused dQ needs jax >= 0.11")
@pytest.mark.parametrize("d,dq", [(64, "fused"), (128, "fused"), (64, "fused_tma")])
def test_cuda_export_fused_dq_is_one_backward_kernel(d, dq):
    """dQ fused into the share dK/dV kernel: the backward is one Mosaic kernel (no dQ kernel),
    which adds into dQ's float32 sums in place with atomic adds or TMA reduce-adds."""
    tiles = dataclasses.replace(hopper.tiles_for(d, jnp.bfloat16, kind="")[0], dkv="share",
                                dq=dq, block_q_dkv=64)
    text = export.export(_fwd_bwd("pallas", BlockSizes(mosaic_gpu=tiles)),
                         platforms=["cuda"])(*_abstract(d=d)).mlir_module()
    assert text.count(MOSAIC) == 2 and TRITON not in text
    assert "diff_flash_dkdvdq" in text and "diff_flash_dq" not in text.replace("dkdvdq", "")


def test_cuda_export_before_hopper_lowers_triton_kernels():
    with kernels.gpu_target("8.0"):
        text = _cuda_export(*_abstract())
    assert text.count(TRITON) == 3 and MOSAIC not in text


def _two_layers(q, k, v, do):
    """Gradients of two fused layers of the same shapes, the second fed by the first."""
    def loss(q, k, v):
        o = kernels.diff_attention(q, k, v, 0.5, causal=True, impl="pallas")
        o = kernels.diff_attention(o.reshape(q.shape), k, v, 0.5, causal=True, impl="pallas")
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def test_layers_of_one_shape_share_one_lowering_of_each_kernel(monkeypatch):
    """A model's layers call the kernels at one shape: the module holds each Mosaic kernel once
    (jitted, lowered once and called from every layer), not once a layer; each lowering cost
    Mosaic GPU's Python 0.5 s on a CPU, and a 1.4B train step took 100 s to its first call on
    an H100. With the kernels unjitted the two layers lower six."""
    q, k, v, _, _ = _abstract(d=64, dtype=jnp.bfloat16)
    abstract = (q, k, v, jax.ShapeDtypeStruct((*q.shape[:2], q.shape[2] // 2, 128), q.dtype))

    def kernels_lowered():  # a fresh function each time: no trace of an earlier export reused
        fn = jax.jit(lambda *a: _two_layers(*a))
        return export.export(fn, platforms=["cuda"])(*abstract).mlir_module().count(MOSAIC)

    assert kernels_lowered() == 3
    monkeypatch.setattr(flash_mgpu, "fwd", flash_mgpu.fwd.__wrapped__)
    monkeypatch.setattr(flash_mgpu, "bwd", flash_mgpu.bwd.__wrapped__)
    assert kernels_lowered() == 6


def _lowered_smem(fn, args, limit):
    """The shared-memory bytes Mosaic GPU's lowering of `fn` reports against an artificial
    per-CTA `limit` (its own test hook), or None when every kernel fits it."""
    with mosaic_gpu_core.artificial_shared_memory_limit(limit):
        try:
            export.export(jax.jit(fn), platforms=["cuda"])(*args)
        except ValueError as e:
            found = re.search(r"smem_bytes=(\d+) >", str(e))
            if found is None:
                raise
            return int(found[1])
    return None


@pytest.mark.parametrize("d,tiles,seg", [
    (64, flash_mgpu.Tiles(64, 64, 64, 3, dkv="split"), True),  # bigger dQ; split dK/dV
    (128, flash_mgpu.Tiles(64, 64, 64, 2, dkv="rows", pingpong=False), False),  # bigger dK/dV
    (128, flash_mgpu.Tiles(64, 64, 64, 2, dq="split"), True),  # dQ's Q and dO held once
    (128, flash_mgpu.Tiles(64, 64, 64, 2, dkv="share"), True),  # and the shared P tiles
    pytest.param(96, flash_mgpu.Tiles(64, 64, 64, 2, dkv="share", dq="fused"), True,
                 marks=pytest.mark.skipif(not flash_mgpu.FUSED_DQ, reason="jax >= 0.11")),
    pytest.param(96, flash_mgpu.Tiles(64, 64, 64, 2, dkv="share", dq="fused_tma"), True,
                 marks=pytest.mark.skipif(not flash_mgpu.FUSED_DQ, reason="jax >= 0.11"))])
def test_shared_memory_plans_are_what_the_lowering_allocates(d, tiles, seg):
    """`warpgroups` judges tiles by plans built from the kernels' own scratch lists; each plan
    is the exact byte count the real lowering allocates (1 KiB-aligned buffers, barriers, the
    forward's reduction scratch): one byte less is refused with that count. A plan that summed
    the buffers alone (the first version) accepted tiles the lowering refuses."""
    wgs_dq, wgs_dkv, split = flash_mgpu.warpgroups(d, tiles)
    sd = jax.ShapeDtypeStruct
    b, t = 1, 256
    q, k, v = (sd((b, t, 2, d), jnp.bfloat16), sd((b, t, 2, d), jnp.bfloat16),
               sd((b, t, 1, 2 * d), jnp.bfloat16))
    ids = sd((b, t), jnp.int32)

    def fwd(q, k, v, q_seg, kv_seg):
        segs = (q_seg, kv_seg) if seg else (None, None)
        return flash_mgpu.fwd(q, k, v, 0.5, *segs, causal=True, tiles=tiles)

    def bwd(q, k, v, q_seg, kv_seg, do, lse, delta):
        segs = (q_seg, kv_seg) if seg else (None, None)
        return flash_mgpu.bwd(q, k, v, 0.5, *segs, do, lse, delta, causal=True, tiles=tiles)

    plan = flash_mgpu.fwd_smem(d, tiles, seg)
    assert _lowered_smem(fwd, (q, k, v, ids, ids), plan - 1) == plan
    plan = max(flash_mgpu.dq_smem(d, tiles, wgs_dq, seg, split=tiles.dq == "split")
               if wgs_dq else 0, flash_mgpu.dkv_smem(d, tiles, wgs_dkv, split, seg))
    stats = sd((b, 1, 2, t), jnp.float32)
    assert _lowered_smem(bwd, (q, k, v, ids, ids, sd((b, t, 1, 2 * d), jnp.bfloat16), stats,
                               stats), plan - 1) == plan
    # the buffers alone fit 227 KiB, the allocation does not
    over = flash_mgpu.Tiles(128, 64, 64, 3)
    with pytest.raises(ValueError, match=r"block_kv=128 with stages=3 needs 230 KiB .* at d=64"):
        flash_mgpu.warpgroups(64, over)


def test_gpu_target_and_dispatch_rule():
    """The target comes from gpu_target, else the attached GPU, else Hopper; the Mosaic kernel
    takes differential bf16/fp16 calls at d ∈ {64, 96, 128} with V 2d wide on sm_90 (its wgmma
    is an sm_90a instruction: Blackwell takes Triton)."""
    assert hopper.compute_capability() == (9, 0)  # CPU test machine: no CUDA device
    for spec, cc in (("8.6", (8, 6)), ("sm_90", (9, 0)), ("sm_90a", (9, 0)), ((10, 0), (10, 0))):
        with kernels.gpu_target(spec):
            assert hopper.compute_capability() == cc
    with pytest.raises(ValueError, match="GPU target must look like"):
        with kernels.gpu_target("hopper"):
            pass
    with kernels.gpu_target("8.0"):  # no GPU attached: the abstract mesh names one (jax 0.11)
        assert jax.sharding.get_abstract_mesh().abstract_device.device_kind == "NVIDIA A100"
    mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
    with jax.set_mesh(mesh), kernels.gpu_target("8.0"):  # a mesh is kept as it is
        assert jax.sharding.get_abstract_mesh() == mesh.abstract_mesh
    assert flash.uses_mosaic_gpu(2, jnp.bfloat16, 96, 192)
    assert not flash.uses_mosaic_gpu(2, jnp.float32, 64, 128)
    assert not flash.uses_mosaic_gpu(1, jnp.bfloat16, 64, 64)
    assert not flash.uses_mosaic_gpu(2, jnp.bfloat16, 32, 64)
    for cc in ("8.0", "10.0"):
        with kernels.gpu_target(cc):
            assert not flash.uses_mosaic_gpu(2, jnp.bfloat16, 64, 128)
    with kernels.gpu_target("9.0"):
        assert flash.uses_mosaic_gpu(2, jnp.bfloat16, 64, 128)


def test_tile_table_and_invalid_tiles():
    """Every (d, dtype) the kernel takes has a row that fits shared memory; Triton's tile fields
    do not reach the Mosaic kernel (so Triton tiles still run the CPU and pre-Hopper paths of a
    bf16 d = 64 call, whose Hopper branch is traced too); bad Mosaic tiles are one ValueError
    naming the field."""
    for d in flash_mgpu.HEAD_DIMS:
        for dtype in (jnp.bfloat16, jnp.float16):
            tiles, row = hopper.tiles_for(d, dtype, kind="")
            assert row["tuned"] is False and "untuned" in row["source"]
            flash_mgpu.warpgroups(d, tiles)
    # (dQ warpgroups, dK/dV warpgroups, split): "rows" fits no register budget (ptxas spills it
    # at d = 64: kernels.ptxas), so "auto" splits; "rows" when asked for
    d64, d128 = (hopper.tiles_for(d, jnp.bfloat16, kind="")[0] for d in (64, 128))
    assert flash_mgpu.warpgroups(64, d64) == (2, 2, True)
    assert flash_mgpu.warpgroups(128, d128) == (1, 2, True)
    assert flash_mgpu.warpgroups(64, dataclasses.replace(d64, block_q_dkv=128)) == (2, 2, True)
    assert flash_mgpu.warpgroups(128, dataclasses.replace(d128, dkv="rows")) == (1, 1, False)
    assert flash_mgpu.warpgroups(64, dataclasses.replace(d64, dkv="rows")) == (2, 2, False)
    assert flash_mgpu.warpgroups(128, dataclasses.replace(d128, dkv="share")) == (1, 2, True)
    fused = dataclasses.replace(d128, dkv="share", dq="fused")
    if flash_mgpu.FUSED_DQ:  # no dQ kernel
        assert flash_mgpu.warpgroups(128, fused) == (0, 2, True)
    else:
        with pytest.raises(ValueError, match=r"dq='fused' needs jax >= 0.11 .* this is jax 0\.10"):
            flash_mgpu.warpgroups(128, fused)
    triton = BlockSizes(block_q=16, block_k=16, num_warps=4)
    assert flash.mosaic_tiles(triton, 64, jnp.bfloat16) == hopper.tiles_for(64, jnp.bfloat16)[0]
    q = jnp.ones((1, 32, 2, 64), jnp.bfloat16)
    out = flash_attention(q, q, jnp.ones((1, 32, 1, 128), jnp.bfloat16), 0.5, num_components=2,
                          block_sizes=triton)
    assert out.shape == (1, 32, 1, 128)
    cases = [(flash_mgpu.Tiles(96, 64, 64, 2), r"block_kv must be a multiple of 64 .* got 96"),
             (flash_mgpu.Tiles(64, 64, 32, 2), r"block_q_dkv must be a multiple of 64 .* got 32"),
             (flash_mgpu.Tiles(64, 64, 64, 1), r"stages must be 2, 3 or 4, got 1"),
             (flash_mgpu.Tiles(64, 64, 64, 2, "cols"), r"dkv must be one of .* got 'cols'"),
             (flash_mgpu.Tiles(64, 64, 64, 2, "auto", "yes"),
              r"pingpong must be True or False, got 'yes'"),
             (flash_mgpu.Tiles(64, 64, 64, 2, dq="auto"), r"dq must be one of .* got 'auto'"),
             (flash_mgpu.Tiles(64, 64, 64, 2, "split", dq="fused"),
              r"dq='fused' runs in the dkv='share' kernel, got dkv='split'"),
             (flash_mgpu.Tiles(256, 64, 64, 2), r"block_kv=256 .* KiB of shared memory")]
    for tiles, msg in cases:
        with pytest.raises(ValueError, match=msg):
            flash.mosaic_tiles(BlockSizes(mosaic_gpu=tiles), 128, jnp.bfloat16)
    # backward tiles that overflow shared memory at d = 64, under each dQ and dK/dV schedule
    for dq, dkv in (("rows", "auto"), ("split", "auto"), ("rows", "rows"), ("rows", "split")):
        for tiles, msg in ((flash_mgpu.Tiles(64, 128, 64, 3, dkv, dq=dq), r"block_kv_dq=128 with "
                            rf"stages=3 needs {229 + (dq == 'split')} KiB .* at d=64"),
                           (flash_mgpu.Tiles(64, 64, 128, 3, dkv, dq=dq),
                            r"block_q_dkv=128 with stages=3 needs 234 KiB .* at d=64")):
            with pytest.raises(ValueError, match=msg):
                flash_mgpu.warpgroups(64, tiles)
    with pytest.raises(ValueError, match=r"backend='mosaic_gpu' takes .* float32, d=64"):
        q, k, v = (jnp.zeros(s, jnp.float32)
                   for s in ((1, 8, 2, 64), (1, 8, 2, 64), (1, 8, 1, 128)))
        flash_attention(q, k, v, 0.5, num_components=2, backend="mosaic_gpu")


def test_tuned_rows_win_for_their_gpu(tmp_path):
    """A recorded row (every Tiles field, as --tune writes it) wins for its GPU only."""
    path = tmp_path / "table.json"
    path.write_text(hopper.TABLE.read_text())
    tiles = flash_mgpu.Tiles(128, 128, 64, 3, "split", False, "split")
    assert hopper.parse_tiles(hopper.tiles_text(tiles)) == tiles  # a tune row's `tiles` text
    hopper.record("H100", 64, jnp.bfloat16, tiles, "test", path=path)
    got, row = hopper.tiles_for(64, jnp.bfloat16, kind="NVIDIA H100 80GB HBM3", path=path)
    assert got == tiles and row["tuned"] is True
    assert hopper.tiles_for(64, jnp.bfloat16, kind="NVIDIA H200", path=path)[0] != tiles
    assert len(hopper.load_table(path)) == len(hopper.load_table()) + 1
    # Re-recording (gpu, d, dtype) replaces that row only: the same GPU and d's other dtype stays.
    fp16 = dataclasses.replace(tiles, stages=2)
    hopper.record("H100", 64, jnp.float16, fp16, "test", path=path)
    hopper.record("H100", 64, jnp.bfloat16, dataclasses.replace(tiles, pingpong=True), "test",
                  path=path)
    assert hopper.tiles_for(64, jnp.float16, kind="NVIDIA H100", path=path)[0] == fp16
    assert hopper.tiles_for(64, jnp.bfloat16, kind="NVIDIA H100", path=path)[0].pingpong
    assert len(hopper.load_table(path)) == len(hopper.load_table()) + 2


def test_a_row_tuned_to_fused_dq_reads_on_every_jax(tmp_path):
    """A row --tune wrote on the GPU machine's jax with dQ "fused" is read on jax 0.10 too (where
    a Tiles that asks for it is refused: every pallas call reads the table) and runs its dK/dV
    schedule with the "rows" dQ kernel there; the row itself still says what was tuned."""
    path = tmp_path / "table.json"
    doc = json.loads(hopper.TABLE.read_text())
    doc["entries"].append({"gpu": "H100", "d": 64, "dtype": "bfloat16", "block_kv": 128,
                           "block_kv_dq": 64, "block_q_dkv": 64, "stages": 2, "dkv": "share",
                           "pingpong": True, "dq": "fused", "tuned": True, "source": "test"})
    path.write_text(json.dumps(doc))
    tiles, row = hopper.tiles_for(64, jnp.bfloat16, kind="NVIDIA H100 80GB HBM3", path=path)
    assert row["dq"] == "fused" and tiles.dkv == "share"
    assert tiles.dq == ("fused" if flash_mgpu.FUSED_DQ else "rows")
    flash_mgpu.warpgroups(64, tiles)


def test_a_failed_record_leaves_the_table_as_it_was(tmp_path, monkeypatch):
    """A write that dies part-way (full disk, kill) leaves the table whole: every pallas call
    reads it, so a truncated table would stop the kernel everywhere."""
    path = tmp_path / "table.json"
    path.write_text(hopper.TABLE.read_text())
    before = path.read_text()
    real_write = Path.write_text

    def half_then_fail(self, text, *args, **kwargs):
        real_write(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        hopper.record("H100", 64, jnp.bfloat16, flash_mgpu.Tiles(64, 64, 64, 3), "test", path=path)
    monkeypatch.undo()
    assert path.read_text() == before and list(tmp_path.iterdir()) == [path]


def test_a_bad_tile_table_is_one_error_naming_the_file_and_row(tmp_path):
    """Every pallas call reads the table while tracing (on any platform), so a table that does
    not read, or a bad row, is one ValueError naming the file and the row, not a KeyError or
    JSONDecodeError from deep in the dispatch; a row's gpu is a whole word of device_kind: an
    empty one (what --tune-write recorded where jax saw no GPU) matched every GPU."""
    path = tmp_path / "table.json"
    good = json.loads(hopper.TABLE.read_text())
    row = good["entries"][0]
    cases = [("{", r"does not read as JSON"),
             (json.dumps({"rows": []}), r"must be an object with a list 'entries'"),
             (json.dumps({"entries": [row, 5]}), r"entries\[1\] must be an object, got 5$"),
             (json.dumps({"entries": [row, {**row, "gpu": ""}]}),
              r"entries\[1\]: gpu must be 'default' or one word"),
             (json.dumps({"entries": [{**row, "d": "64"}]}), r"entries\[0\]: d must be an integer"),
             (json.dumps({"entries": [{k: x for k, x in row.items() if k != "stages"}]}),
              r"entries\[0\] \(gpu default, d=64, bfloat16\): missing field 'stages'"),
             (json.dumps({"entries": [{**row, "block_kv": 96}]}),
              r"entries\[0\] .*: Mosaic GPU tiles: block_kv must be a multiple of 64")]
    for text, msg in cases:
        path.write_text(text)
        with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + msg):
            hopper.tiles_for(64, jnp.bfloat16, kind="", path=path)
    path.write_text(hopper.TABLE.read_text())
    with pytest.raises(ValueError, match=re.escape(str(path)) + r" has no bfloat16 row for "
                       r"d = 32; it has d = 64, 96, 128$"):  # a width the table does not tile
        hopper.tiles_for(32, jnp.bfloat16, kind="", path=path)
    tiles = flash_mgpu.Tiles(64, 64, 64, 3)
    with pytest.raises(ValueError, match=r"gpu must be 'default' or one word .* got ''"):
        hopper.record("", 64, jnp.bfloat16, tiles, "test", path=path)
    assert len(hopper.load_table(path)) == len(good["entries"])  # nothing was written
    hopper.record("H20", 64, jnp.bfloat16, tiles, "test", path=path)
    hopper.record("H100", 64, jnp.bfloat16, dataclasses.replace(tiles, stages=4), "test",
                  path=path)
    assert hopper.tiles_for(64, jnp.bfloat16, kind="NVIDIA H200", path=path)[1]["gpu"] == "default"
    assert hopper.tiles_for(64, jnp.bfloat16, kind="NVIDIA H20", path=path)[0] == tiles
    for kind in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe"):
        assert hopper.tiles_for(64, jnp.bfloat16, kind=kind, path=path)[0].stages == 4
