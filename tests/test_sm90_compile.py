"""Compiling for H100s on this CPU (the `cuda-aot` extra: the CUDA plugin and ptxas, no GPU): the
Mosaic GPU kernels go through their real lowering and ptxas for sm_90a, and ptxas's register and
spill report is read back (`kernels.ptxas`); the sharded train step compiles for eight H100s with
the fused kernel inside (`train.compile_topology=h100:8`)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from diff_jax.aot import GPU_TARGETS, HBM_BYTES, gpu_devices, topology_devices
from diff_jax.config import ConfigError
from diff_jax.kernels import flash_mgpu, hopper, ptxas

ROOT = Path(__file__).resolve().parents[1]


def _installed(module: str) -> bool:
    """Whether `module` can be imported, a dotted name whose parent package is absent included
    (`find_spec` imports the parent and raises then: without the cuda-aot extra there is no
    `jax_plugins` or `nvidia` package)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


CUDA_AOT = _installed("jax_plugins.xla_cuda13") and _installed("nvidia.cu13")
needs_cuda_aot = pytest.mark.skipif(not CUDA_AOT, reason="the cuda-aot extra (CUDA plugin and "
                                    "ptxas) is not installed")
NVDISASM = CUDA_AOT and (Path(importlib.util.find_spec("nvidia.cu13").submodule_search_locations[0])
                         / "bin" / "nvdisasm").exists()
needs_nvdisasm = pytest.mark.skipif(not NVDISASM, reason="nvdisasm (the cuda-aot extra's "
                                    "nvidia-cuda-nvdisasm) is not installed")

REPORT = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'diff_flash_fwd_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for diff_flash_fwd_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem
ptxas info    : Compile time = 253.135 ms
ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the function 'diff_flash_dkdv_mosaic_gpu_kernel'
ptxas warning : Registers are spilled to local memory in function 'diff_flash_dkdv_mosaic_gpu_kernel', 944 bytes spill stores, 1040 bytes spill loads
ptxas info    : Compiling entry function 'diff_flash_dkdv_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for diff_flash_dkdv_mosaic_gpu_kernel
    512 bytes stack frame, 944 bytes spill stores, 1040 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem
"""


def test_ptxas_report_is_read_per_entry_function():
    fwd, dkdv = ptxas.parse(REPORT)
    assert fwd == ptxas.KernelReport("diff_flash_fwd_mosaic_gpu_kernel", "sm_90a", 168, 16, 0, 0, 0)
    assert not fwd.spills
    assert (dkdv.stack_bytes, dkdv.spill_store_bytes, dkdv.spill_load_bytes) == (512, 944, 1040)
    assert dkdv.spills and not fwd.notes
    assert dkdv.notes == ("C7512: wgmma.mma_async instructions are serialized due to "
                          "insufficient register resources",)
    truncated = REPORT[:REPORT.rindex("ptxas info    : Used")]
    with pytest.raises(ValueError, match="diff_flash_dkdv_mosaic_gpu_kernel ends before its "
                                         "register count"):
        ptxas.parse(truncated)
    cut = REPORT.replace("ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem\n", "", 1)
    with pytest.raises(ValueError, match="diff_flash_fwd_mosaic_gpu_kernel ends before its "
                                         "register count"):  # the next entry begins first
        ptxas.parse(cut)
    frameless = REPORT.replace("    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n", "")
    with pytest.raises(ValueError, match="ptxas report of diff_flash_fwd_mosaic_gpu_kernel has no "
                                         "stack frame line$"):
        ptxas.parse(frameless)
    assert ptxas.parse("no ptxas here\n") == []


# nvdisasm's listing, cut down: a step loop (.L_x_1 back to .L_x_0) with a spill store and two
# spill loads around its wgmmas, a loop without wgmmas, a barrier-wait retry placed after the
# last EXIT that jumps back into the step loop (to its second wgmma: counted as a loop, it would
# be a second step loop), and a second function with a numeric branch target.
SASS = """//--------------------- .text.diff_flash_dq_mosaic_gpu_kernel --------------------------
	.section	.text.diff_flash_dq_mosaic_gpu_kernel,"ax",@progbits
diff_flash_dq_mosaic_gpu_kernel:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   IMAD.MOV.U32 R3, RZ, RZ, RZ ;
.L_x_0:
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;
        /*0030*/                   STL [R1+0x8], R0 ;
        /*0040*/                   LDL R2, [R1+0xc] ;
.L_x_2:
        /*0050*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR12], R24, gsb0 ;
        /*0060*/                   LDL.LU R9, [R1+0x90] ;
        /*0070*/               @P1 BRA `(.L_x_0) ;
.L_x_3:
        /*0080*/                   IADD3 R5, R5, 0x1, RZ ;
        /*0090*/               @P2 BRA `(.L_x_3) ;
        /*00a0*/                   EXIT ;
.L_x_1:
        /*00b0*/                   NANOSLEEP 0x20 ;
        /*00c0*/                   BRA `(.L_x_2) ;
.L_x_9:
        /*00d0*/                   BRA `(.L_x_9);
//--------------------- .nv.shared.diff_flash_dq_mosaic_gpu_kernel --------------------------
//--------------------- .text.diff_flash_fwd_mosaic_gpu_kernel --------------------------
        /*0000*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR28], RZ, !UPT ;
        /*0010*/                   FMUL R3, R3, R4 ;
        /*0020*/               @P0 BRA 0x0 ;
        /*0030*/                   EXIT ;
"""


def test_sass_step_loops_are_the_innermost_wgmma_loops():
    loops = ptxas.step_loops(SASS)
    assert loops == {"diff_flash_dq_mosaic_gpu_kernel": (ptxas.StepLoop(6, 2, 1, 2),),
                     "diff_flash_fwd_mosaic_gpu_kernel": (ptxas.StepLoop(3, 1, 0, 0),)}
    (dq,) = ptxas.parse(REPORT.replace("fwd", "dq").split("ptxas info    : (C7512)")[0] + SASS)
    assert dq.loops == loops["diff_flash_dq_mosaic_gpu_kernel"] and dq.loop_spills == 3
    assert ptxas.parse(REPORT)[0].loops is None  # no SASS read: unknown, not "no loops"
    assert ptxas.parse(REPORT)[0].loop_spills is None


# A wgmma loop (.L_x_1) nested in another (.L_x_0), a predicated EXIT before a second wgmma loop
# whose branch names its target by a hexadecimal address (0xa0), then the last EXIT.
NESTED_SASS = """//--------------------- .text.diff_flash_dkdv_mosaic_gpu_kernel --------------------------
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;
.L_x_1:
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR12], R24, gsb0 ;
        /*0030*/                   STL [R1+0x8], R0 ;
        /*0040*/               @P1 BRA `(.L_x_1) ;
        /*0050*/               @P2 BRA `(.L_x_0) ;
        /*0060*/               @P3 EXIT ;
        /*0070*/                   IADD3 R5, R5, 0x1, RZ ;
        /*0080*/                   IADD3 R6, R6, 0x1, RZ ;
        /*0090*/                   IADD3 R7, R7, 0x1, RZ ;
        /*00a0*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR16], RZ, !UPT ;
        /*00b0*/                   LDL R2, [R1+0xc] ;
        /*00c0*/               @P4 BRA 0xa0 ;
        /*00d0*/                   EXIT ;
"""


def test_step_loops_are_innermost_before_the_last_exit_and_every_note_is_kept():
    """Of two nested wgmma loops only the inner one is a step loop; a loop between an early
    (predicated) EXIT and the last one is still a step loop, its numeric target read as hex; a
    kernel with two performance notes keeps both."""
    inner, after_exit = ptxas.step_loops(NESTED_SASS)["diff_flash_dkdv_mosaic_gpu_kernel"]
    assert inner == ptxas.StepLoop(3, 1, 1, 0)  # 0x20..0x40, not the outer 0x10..0x50
    assert after_exit == ptxas.StepLoop(3, 1, 0, 1)  # 0xa0..0xc0
    second_note = ("ptxas info    : (C7509) Potential Performance Loss: wgmma.mma_async "
                   "instructions are serialized due to the presence of Extern calls in the "
                   "function 'diff_flash_dkdv_mosaic_gpu_kernel'\n")
    _, dkdv = ptxas.parse(second_note + REPORT)
    assert dkdv.notes == (
        "C7509: wgmma.mma_async instructions are serialized due to the presence of Extern calls",
        "C7512: wgmma.mma_async instructions are serialized due to insufficient register resources")


def test_gpu_topology_names_are_checked():
    for bad in ("h999:8", "h100:0", "h100:two", "h100"):
        with pytest.raises(ConfigError, match=rf"train.compile_topology='{bad}': expected NAME:N "
                                              r"with NAME one of \['h100'\]"):
            gpu_devices(bad)
    assert HBM_BYTES["h100"] == GPU_TARGETS["h100"].memory_bytes
    assert 'device_description_str: "NVIDIA H100 80GB HBM3"' in GPU_TARGETS["h100"].target_config()


@needs_cuda_aot
@pytest.mark.parametrize("d", flash_mgpu.HEAD_DIMS)
def test_table_tiles_compile_for_sm90a(d):
    """The table's tiles at each width, with segment ids (the most registers): forward, dQ and
    dK/dV all reach ptxas for sm_90a. The forward spills nothing at any width; neither does any
    kernel at d = 64 and 96 ("auto" splits dK/dV, where "rows" spilled ~1 KB; the producer's 24
    registers leave dQ 240). At d = 128 dQ and dK/dV still spill (their accumulators alone take
    128 registers a thread; benchmarks/results/mosaic_ptxas_sm90a_jax*.md)."""
    tiles, _ = hopper.tiles_for(d, jnp.bfloat16, kind="")
    reports = {r.name: r for r in ptxas.mosaic_kernels(gpu_devices("h100:1"), d, tiles,
                                                       has_seg=True)}
    assert sorted(reports) == ["diff_flash_dkdv_mosaic_gpu_kernel",
                               "diff_flash_dq_mosaic_gpu_kernel",
                               "diff_flash_fwd_mosaic_gpu_kernel"]
    assert {r.arch for r in reports.values()} == {"sm_90a"}
    assert not reports["diff_flash_fwd_mosaic_gpu_kernel"].spills
    if d in (64, 96):
        assert not any(r.spills for r in reports.values()), reports


def test_ptxas_markdown_reports_spills_when_only_stores_or_loads_are_nonzero():
    """mosaic_ptxas.py's summary line for the table's tiles says "no spills" only when both
    spill stores and loads are 0; "no spills" for a kernel with spill stores but no spill
    loads (or the reverse) passed every test (no test ran mosaic_ptxas.py)."""
    import mosaic_ptxas

    env = {"arch": "sm_90a", "target": "H100", "host": "a CPU", "jax": "0", "ptxas": "13",
           "date": "today"}
    row = {"d": 64, "case": "table", "tiles": "t", "seg": True, "kernel": "diff_flash_dq",
           "spill_store_bytes": 0, "spill_load_bytes": 0, "loop_spills": 0, "notes": ""}
    lines = [mosaic_ptxas.markdown([row | spill], env).splitlines()
             for spill in ({}, {"spill_store_bytes": 944}, {"spill_load_bytes": 8})]
    summaries = [[x for x in md if x.startswith("- d = 64")] for md in lines]
    assert summaries == [["- d = 64, seg = True: diff_flash_dq no spills"],
                         ["- d = 64, seg = True: diff_flash_dq spills 944 / 0 bytes, 0 spill "
                          "instructions a step"],
                         ["- d = 64, seg = True: diff_flash_dq spills 0 / 8 bytes, 0 spill "
                          "instructions a step"]]
    # each variant of the table's tiles is named as itself (the share dK/dV rows were once all
    # labelled "split dQ")
    md = mosaic_ptxas.markdown([row | {"case": c} for c in ("table, split dQ",
                                                           "table, share dK/dV")], env)
    assert [x for x in md.splitlines() if x.startswith("- d = 64")] == [
        "- d = 64, seg = True, split dQ: diff_flash_dq no spills",
        "- d = 64, seg = True, share dK/dV: diff_flash_dq no spills"]


@needs_cuda_aot
def test_the_rows_schedule_spills_at_d64_so_auto_splits():
    """The check can fail, on the kernel as written: dK/dV's "rows" schedule at d = 64 (all
    three accumulators and four score tiles a thread, `dkv_registers` 256 > 240) spills in
    ptxas's report, and "split", which "auto" takes there, does not."""
    base = hopper.tiles_for(64, jnp.bfloat16, kind="")[0]
    reports = {}
    for dkv in ("rows", "split"):
        (dkdv,) = [r for r in ptxas.mosaic_kernels(
            gpu_devices("h100:1"), 64, dataclasses.replace(base, dkv=dkv), has_seg=False,
            parts=("bwd",)) if r.name.startswith("diff_flash_dkdv")]
        reports[dkv] = dkdv
    assert reports["rows"].spill_store_bytes > 0 and not reports["split"].spills, reports
    assert flash_mgpu.warpgroups(64, base)[2]  # "auto" splits


@needs_cuda_aot
def test_a_kernel_compiled_before_is_still_reported():
    """Mosaic GPU compiles (and runs ptxas on) a kernel once a process; asked again,
    `mosaic_kernels` gives the same reports, known by the kernels' module hashes."""
    tiles = hopper.tiles_for(64, jnp.bfloat16, kind="")[0]
    devices = gpu_devices("h100:1")
    first = ptxas.mosaic_kernels(devices, 64, tiles, has_seg=False)
    again = ptxas.mosaic_kernels(devices, 64, tiles, has_seg=False)
    assert again == first and [r.name.split("_")[2] for r in first] == ["fwd", "dq", "dkdv"]


def test_ptxas_report_restores_the_dump_variables_as_they_were(monkeypatch):
    """The dump switches are on only while `compile` runs: one set before keeps its value, one
    unset before is removed again (a process that set MOSAIC_GPU_DUMP_PTXAS=0 had it left at 1)."""
    monkeypatch.setenv(ptxas.DUMP_VARIABLE, "0")
    monkeypatch.delenv(ptxas.SASS_VARIABLE, raising=False)
    seen = {}

    def compile():
        seen.update((name, os.environ.get(name)) for name in (ptxas.DUMP_VARIABLE,
                                                               ptxas.SASS_VARIABLE))
        return 7

    assert ptxas.ptxas_report(compile) == (7, [])
    assert seen == {ptxas.DUMP_VARIABLE: "1", ptxas.SASS_VARIABLE: "1"}
    assert os.environ[ptxas.DUMP_VARIABLE] == "0" and ptxas.SASS_VARIABLE not in os.environ


@needs_cuda_aot
def test_a_kernel_compiled_without_a_report_is_one_error_naming_it(monkeypatch):
    """A kernel Mosaic GPU compiled before by another path (no report read, so not in `_SEEN`)
    is not reported again: a RuntimeError naming it, not a list one report short."""
    monkeypatch.setattr(ptxas, "_SEEN", {})
    monkeypatch.setattr(ptxas, "ptxas_report", lambda compile: (None, []))
    tiles = hopper.tiles_for(64, jnp.bfloat16, kind="")[0]
    with pytest.raises(RuntimeError, match=r"ptxas reported nothing for diff_flash_fwd \(compiled "
                                           r"before this process read reports\?\)$"):
        ptxas.mosaic_kernels(gpu_devices("h100:1"), 64, tiles, has_seg=False, parts=("fwd",))


@needs_cuda_aot
def test_split_dq_holds_d128_without_spills():
    """dQ at d = 128: one "rows" warpgroup holds dQ1 and dQ2 (128 registers a thread) and spills;
    the "split" schedule gives each component its own warpgroup and spills nothing."""
    base = hopper.tiles_for(128, jnp.bfloat16, kind="")[0]
    devices = gpu_devices("h100:1")
    for dq, spills in (("rows", True), ("split", False)):
        (report,) = [r for r in ptxas.mosaic_kernels(
            devices, 128, dataclasses.replace(base, dq=dq), has_seg=True, parts=("bwd",))
            if r.name.startswith("diff_flash_dq")]
        assert report.spills is spills, (dq, report)


@needs_nvdisasm
def test_step_loops_show_where_the_spills_run():
    """The SASS step loops: the forward's at d = 64 (an interior loop and a boundary loop, 12
    wgmmas a step each: QKᵀ 4 at K = 64, P·V 8 at N = 128) run no spill instruction; d = 128's
    "rows" dQ runs its spills in its one step loop, every kv step. With segment ids the forward's
    interior step (segment mask only) is shorter than its boundary step (causal mask too)."""
    devices = gpu_devices("h100:1")
    tiles = hopper.tiles_for(64, jnp.bfloat16, kind="")[0]
    (fwd,) = ptxas.mosaic_kernels(devices, 64, tiles, has_seg=True, parts=("fwd",))
    assert [x.wgmmas for x in fwd.loops] == [12, 12] and fwd.loop_spills == 0
    interior, boundary = fwd.loops
    assert interior.instructions < boundary.instructions
    base = hopper.tiles_for(128, jnp.bfloat16, kind="")[0]
    (dq,) = [r for r in ptxas.mosaic_kernels(devices, 128, dataclasses.replace(base, dq="rows"),
                                             has_seg=True, parts=("bwd",))
             if r.name.startswith("diff_flash_dq")]
    assert len(dq.loops) == 1 and dq.loops[0].spill_loads > 0


def test_split_roles_share_the_register_file():
    roles = flash_mgpu.split_registers()
    assert roles["k"] == 256 and roles["v"] % 8 == 0 and 24 <= roles["v"] <= 256
    # the launch pool of a 384-thread CTA: 168 a thread (not 512: more would hang setmaxnreg)
    assert roles["k"] + roles["v"] + flash_mgpu.PRODUCER_REGISTERS <= flash_mgpu.cta_registers(3)
    assert flash_mgpu.cta_registers(3) == 504 and flash_mgpu.cta_registers(2) == 512
    assert flash_mgpu.compute_registers(2) == 240 and flash_mgpu.compute_registers(1) == 256


@needs_cuda_aot
def test_d128_wgmmas_stay_pipelined(monkeypatch):
    """At d = 128 (the head width of every paper config from 1.4B up) ptxas keeps every kernel's
    wgmmas asynchronous: no "serialized" note. With 232 registers for each dK/dV warpgroup
    instead of `split_registers`, ptxas serializes dK/dV's (C7512: a wait after every wgmma)."""
    tiles, _ = hopper.tiles_for(128, jnp.bfloat16, kind="")
    devices = gpu_devices("h100:1")
    reports = ptxas.mosaic_kernels(devices, 128, tiles, has_seg=False)
    assert len(reports) == 3 and not any(r.notes for r in reports), reports
    monkeypatch.setattr(flash_mgpu, "split_registers", lambda: {"k": 232, "v": 232})
    flash_mgpu.bwd.clear_cache()  # its trace holds the register plan it was traced with
    try:
        (dkdv,) = ptxas.mosaic_kernels(devices, 128, tiles, has_seg=False, parts=("bwd",))[-1:]
    finally:
        flash_mgpu.bwd.clear_cache()  # no later test gets this plan's trace
    assert dkdv.name.startswith("diff_flash_dkdv") and any("C7512" in n for n in dkdv.notes)


@needs_cuda_aot
def test_sharded_step_compiles_for_eight_h100s_with_the_fused_kernel():
    """train.py's compile-only mode for `h100:8` (data 2 × fsdp 4): the fused kernel's three
    Mosaic GPU kernels are compiled inside the sharded step, and the step fits an H100."""
    cmd = [sys.executable, "train.py", "model.vocab_size=512", "model.embed_dim=256",
           "model.num_layers=1", "model.num_heads=2", "model.max_seq_len=256",
           "train.seq_len=256", "train.batch_size=16", "model.dtype=bfloat16",
           "model.attention_impl=pallas", "mesh.data=2", "mesh.fsdp=4",
           "train.compile_only=true", "train.compile_topology=h100:8"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout[done.stdout.index("{"):])
    assert report["devices"] == 8 and report["device_kind"] == "NVIDIA H100 80GB HBM3"
    assert report["attention_impl"] == "pallas" and report["fits"] is True
    assert report["flops_per_chip"] is None  # XLA has no cost analysis without a GPU
    names = sorted(k["name"] for k in report["kernels"])
    assert names == ["diff_flash_dkdv_mosaic_gpu_kernel", "diff_flash_dq_mosaic_gpu_kernel",
                     "diff_flash_fwd_mosaic_gpu_kernel"]
    assert not any(k["spill_store_bytes"] for k in report["kernels"])  # d = 64


def test_topology_devices_sends_gpu_names_to_gpu_devices():
    with pytest.raises(ConfigError, match="train.compile_topology='h100:x'"):
        topology_devices("h100:x")


@needs_cuda_aot
def test_a_cudnn_step_for_h100s_compiles_or_is_refused_naming_attention_impl():
    """`auto` picks cuDNN for the baseline in bfloat16 on GPU. jax asks the cuDNN library for its
    version while tracing; where none is installed (the cuda-aot extra has none), compiling for
    H100s is one `ConfigError` naming model.attention_impl, not jax's RuntimeError."""
    from diff_jax.aot import compile_train_step
    from diff_jax.config import load_config

    config = load_config(None, ["model.variant=transformer", "model.vocab_size=512",
                                "model.embed_dim=128", "model.num_layers=1", "model.num_heads=2",
                                "model.max_seq_len=64", "train.seq_len=64", "train.batch_size=2",
                                "model.dtype=bfloat16", "model.attention_impl=auto"])
    try:
        report = compile_train_step(config, gpu_devices("h100:1"))
    except ConfigError as e:
        assert str(e).startswith("model.attention_impl=auto: the cuDNN attention cannot be "
                                 "compiled on this machine (auto picks it for variant transformer "
                                 "in bfloat16 on GPU): "), e
        assert str(e).endswith("; compile with model.attention_impl=pallas or xla")
    else:  # a machine with cuDNN
        assert report["attention_impl"] == "cudnn"
