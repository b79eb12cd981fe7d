"""AOT compilation of the sharded train step: per-device memory reflects the sharding rules; the
fused kernel compiles inside it for a TPU slice and lowers for CUDA (on this CPU machine)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest
from jax import export

from diff_jax.aot import GiB, compile_train_step, export_train_step, topology_devices
from diff_jax.config import ConfigError, load_config
from diff_jax.summary import abstract_params
from test_kernels import TRITON

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["model.vocab_size=512", "model.embed_dim=64", "model.num_layers=2", "model.num_heads=2",
         "model.max_seq_len=64", "train.seq_len=16", "train.batch_size=8"]


def test_fsdp_divides_the_state_across_devices():
    config = load_config(None, MODEL + ["mesh.data=8"])
    state_bytes = 3 * 4 * sum(x.size for x in jax.tree.leaves(abstract_params(config.model)))
    replicated = compile_train_step(config)
    # with micro-batches, scanned layers and a loss chunk: loops whose bodies XLA counts once,
    # which it says
    sharded = compile_train_step(load_config(None, MODEL + ["mesh.data=1", "mesh.fsdp=8",
                                                            "model.loss_chunk=6", "train.grad_accum=2",
                                                            "train.batch_size=16",
                                                            "model.scan_layers=true"]))
    assert "flops_note" not in replicated
    assert sharded["flops_note"] == (
        "flops_per_chip counts one pass of the loop over the 2 micro-batches (train.grad_accum) "
        "and of the loop over the 2 layers (model.scan_layers) and of the loop over the 3 loss "
        "chunks (model.loss_chunk): XLA's cost analysis counts a loop's body once")
    assert replicated["devices"] == sharded["devices"] == 8
    assert sharded["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    assert replicated["argument_gib"] * GiB >= state_bytes  # params + Adam moments on every device
    assert sharded["argument_gib"] * GiB < state_bytes / 4  # ~1/8 of it, plus the batch
    for r in (replicated, sharded):  # the updated state reuses the donated argument buffers
        assert 0 <= (r["peak_gib"] - r["argument_gib"] - r["temp_gib"]) * GiB < 4096


def test_unknown_topology_is_a_config_error():
    with pytest.raises(ConfigError, match="train.compile_topology='v0x:9'"):
        topology_devices("v0x:9")
    # a GPU not in the table: named with the GPU form, before libtpu logs a line of its own
    with pytest.raises(ConfigError, match=r"^train.compile_topology='h200:8': expected a TPU slice "
                                          r"such as v5p:2x2x2 or GPUs NAME:N with NAME one of "
                                          r"\['h100'\], e.g. h100:8$"):
        topology_devices("h200:8")
    with pytest.raises(ConfigError, match=r"^train.compile_slices=2: slices are TPU slices; "
                                          r"train.compile_topology='h100:8' describes GPUs"):
        topology_devices("h100:8", 2)


LOCKFILE = "ABORTED: Internal error when accessing libtpu multi-process lockfile."


@pytest.mark.parametrize("libtpu,attached,said,hint", [
    (None, False, "No module named 'libtpu'", "it needs libtpu: pip install 'jax[tpu]'"),
    ("spec", True, LOCKFILE, "another process on this TPU host has libtpu loaded"),
    ("spec", False, LOCKFILE, "another process has libtpu loaded, and "
                              "ALLOW_MULTIPLE_LIBTPU_LOAD=0 keeps this one from loading it beside "
                              "that one; unset it (this machine has no TPU chips to guard)"),
    ("spec", False, "INVALID_ARGUMENT: Invalid TPU external name: TPU v5q",
     "expected a TPU slice name such as v5p:2x2x2"),
])
def test_a_slice_libtpu_cannot_describe_is_one_line_with_the_likely_cause(monkeypatch, libtpu,
                                                                         attached, said, hint):
    """libtpu missing; its lockfile held by another process on a TPU host, or on a machine
    without TPU chips where the user set ALLOW_MULTIPLE_LIBTPU_LOAD=0 over the compile's
    default; or a name it does not know: before, each ended "it needs libtpu ... and a name
    like v5p:2x2x2"."""
    from jax.experimental import topologies

    from diff_jax import aot

    def fail(*args, **kwargs):
        raise RuntimeError(said + "\nits second line")

    monkeypatch.setattr(topologies, "get_topology_desc", fail)
    monkeypatch.setattr(aot.importlib.util, "find_spec", lambda name: libtpu)
    monkeypatch.setattr(aot, "accelerator_attached", lambda: attached)
    monkeypatch.setattr(aot, "describe_missing_tpu_host", lambda topology: None)
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "0")
    with pytest.raises(ConfigError) as e:
        topology_devices("v5q:2x2x1")
    assert str(e.value).startswith(f"train.compile_topology='v5q:2x2x1': cannot describe this "
                                   f"TPU slice (RuntimeError: {said}); {hint}")
    assert "\n" not in str(e.value)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu not installed (optional extra: jax[tpu])")
def test_describing_a_tpu_slice_leaves_sighup_as_it_was():
    """Loading libtpu set SIGHUP to SIG_IGN in this process behind Python's back
    (`platforms.signals_kept`): every process started afterwards inherited SIGHUP ignored, as
    under nohup, and the kernel's SigIgn gained its bit while `signal.getsignal` said SIG_DFL.
    In a fresh process, as the first load is the one that sets it."""
    probe = textwrap.dedent("""
        import signal, subprocess, sys
        from diff_jax.aot import topology_devices

        def ignored():
            line = next(l for l in open("/proc/self/status") if l.startswith("SigIgn"))
            return [s for s in (signal.SIGHUP,) if int(line.split()[1], 16) >> (s - 1) & 1]

        before = ignored()
        assert len(topology_devices("v5p:2x2x2")) == 8
        child = subprocess.run([sys.executable, "-c", "import signal; "
                                "print(signal.getsignal(signal.SIGHUP))"],
                               capture_output=True, text=True).stdout.strip()
        print(before, ignored(), child)
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[] [] 0", out.stdout  # 0: SIG_DFL


SHARDED = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "model.dtype=bfloat16",
           "model.vocab_size=512", "model.num_layers=1", "model.max_seq_len=256",
           "train.seq_len=256", "train.batch_size=8"]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu not installed (optional extra: jax[tpu])")
@pytest.mark.parametrize("d", [96, 128])
def test_sharded_pallas_step_compiles_for_a_tpu_slice(d):
    """The fused kernel inside the sharded train step compiles for v5p:2x2x2 at the paper's head
    widths, and its per-chip FLOPs stay near the xla path's: attention is split over the chips,
    not replicated (replicated attention would add ~8× its share; here it is ~25% of the step)."""
    model = [f"model.embed_dim={4 * d}", "model.num_heads=2"]  # 2 DIFF heads of width d
    devices = topology_devices("v5p:2x2x2")
    fused = compile_train_step(load_config(None, SHARDED + model + ["model.attention_impl=pallas"]),
                               devices)
    oracle = compile_train_step(load_config(None, SHARDED + model + ["model.attention_impl=xla"]),
                                devices)
    assert fused["attention_impl"] == "pallas" and fused["devices"] == 8
    assert fused["flops_per_chip"] > 0
    assert abs(fused["flops_per_chip"] / oracle["flops_per_chip"] - 1) < 0.15, (fused, oracle)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu not installed (optional extra: jax[tpu])")
def test_the_sharded_step_compiles_for_two_tpu_slices_with_only_data_across_them(capsys):
    """train.compile_slices=2: two v5p:2x2x1 slices joined by the data-center network. Each
    slice holds one row of the data axis whole (its fsdp and tensor groups), so only the data
    axis' collectives cross slices; the compiled program, the fused kernel inside, is libtpu's
    multi-slice one (its cross-slice collectives go through Megascale). A mesh that would put
    fsdp across the slices is refused in one line."""
    from diff_jax.aot import report
    from diff_jax.sharding import ShardingError, make_mesh
    from diff_jax.step import build_steps

    two = ["train.compile_only=true", "train.compile_topology=v5p:2x2x1", "train.compile_slices=2"]
    result = report(load_config(None, MODEL + ["mesh.data=2", "mesh.fsdp=4"] + two))
    assert json.loads(capsys.readouterr().out)["slices"] == 2
    assert (result["devices"], result["slices"]) == (8, 2)
    assert result["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1} and result["fits"]

    config = load_config(None, MODEL + ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
                                        "model.attention_impl=pallas"] + two)  # the fused kernel
    mesh = make_mesh(config.mesh, topology_devices("v5p:2x2x1", 2))
    assert [{d.slice_index for d in row.flat} for row in mesh.devices] == [{0}, {1}]
    steps = build_steps(config, mesh)
    with steps.context():
        text = steps.train.lower(steps.abstract, steps.abstract_batch(8, 16)).compile().as_text()
    assert "num_partitions=4" in text  # a program of one slice's chips
    assert "tpu_custom_call" in text  # the Mosaic TPU kernel
    assert "MegascaleRendezvousKeyName" in text  # and collectives between the slices
    with pytest.raises(ShardingError, match=r"^mesh.data=1: the devices span 2 TPU slices"):
        report(load_config(None, MODEL + ["mesh.data=1", "mesh.fsdp=8"] + two))


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu not installed (optional extra: jax[tpu])")
def test_a_step_too_big_for_the_slice_is_one_error_naming_what_to_change():
    """XLA:TPU's compiler finds that the step's temporaries (a 16384 × 64 × 65536 float32 logits
    array over 4 chips) exceed a v5e chip's HBM: a `DeviceMemoryError` (train.py: one line, exit
    2) that keeps the compiler's first line and names the settings, where it was a traceback."""
    from diff_jax.aot import report
    from diff_jax.device_memory import DeviceMemoryError

    big = ["model.vocab_size=65536", "model.max_seq_len=64", "train.seq_len=64",
           "train.batch_size=16384", "train.compile_only=true", "train.compile_topology=v5e:2x2"]
    with pytest.raises(DeviceMemoryError) as caught:
        report(load_config(None, MODEL + big))
    assert re.fullmatch(
        r"out of device memory \(RESOURCE_EXHAUSTED: .*exceeds available HBM.*\): the train step "
        r"at train.batch_size=16384, train.seq_len=64, train.grad_accum=1, model.remat=none, "
        r"model.loss_chunk=0 does not fit on v5e:2x2; lower train.batch_size or raise "
        r"train.grad_accum .*\(mesh.fsdp\)", str(caught.value)), str(caught.value)


@pytest.mark.parametrize("embed_dim,kernel", [(256, "mosaic_gpu"), (64, TRITON)],
                         ids=["hopper-mosaic-d64", "triton-d16"])
def test_sharded_step_exports_for_cuda_with_the_kernel_inside_shard_map(embed_dim, kernel):
    """Lowering the sharded step for CUDA on this CPU machine (target: Hopper): every kernel call
    sees one shard's block (batch 8 / 4 batch shards, 4 sub-heads / 2 head shards), not the
    global arrays. d = 64 takes the Mosaic GPU kernels, d = 16 the Triton ones."""
    if kernel == TRITON and jax.__version_info__ >= (0, 11):
        pytest.skip("jax 0.11's Triton lowering needs a GPU to export a sharded step "
                    "(kernels.hopper.target)")
    config = load_config(None, ["model.vocab_size=512", f"model.embed_dim={embed_dim}",
                                "model.num_layers=1", "model.num_heads=2", "model.max_seq_len=64",
                                "train.seq_len=32", "train.batch_size=8",
                                "model.attention_impl=pallas", "model.dtype=bfloat16",
                                "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"])
    text = export_train_step(config, "cuda", [export.DisabledSafetyCheck.custom_call(TRITON)])
    calls = [line for line in text.splitlines() if f"custom_call @{kernel}" in line]
    assert len(calls) == 3  # forward, dK/dV, dQ
    d = embed_dim // 4
    for line in calls:  # q first: (B/4, T padded to the kernel's tiles, 2H/2, d)
        operands = line[line.rindex(": (") + 3:]
        assert re.match(rf"tensor<2x\d+x2x{d}xbf16>", operands), operands[:80]


def test_fit_tries_a_larger_slice_after_out_of_memory_and_keeps_earlier_rows(tmp_path,
                                                                         monkeypatch):
    """benchmarks/fit.py: a compile refused for memory (RESOURCE_EXHAUSTED) moves on to the next
    slice, one that fits ends the search; earlier results keep their attention impl (rows from
    before the column are xla); the spill column names the kernels that spill. A search ended
    by that refusal or recording it as an error, every earlier row relabelled xla and "none"
    unless every kernel spills passed every test (no test ran fit.py)."""
    import json
    import sys

    import fit

    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    earlier = [{"config": "diff-1.4b", "impl": "pallas", "topology": "h100:8", "error": "x"},
               {"config": "diff-1.4b", "topology": "h100:16", "error": "y"}]
    (tmp_path / "benchmarks/results/gpu_fit.json").write_text(json.dumps(earlier))
    kernels = [{"name": "diff_flash_fwd_mosaic_gpu_kernel", "spill_store_bytes": 0},
               {"name": "diff_flash_dkdv_mosaic_gpu_kernel", "spill_store_bytes": 944}]
    tried = []

    def compile_one(config, topology, impl, timeout):
        tried.append(topology)
        key = {"config": config, "topology": topology, "impl": impl}
        if topology == "h100:8":
            return key | {"error": "XlaRuntimeError: RESOURCE_EXHAUSTED: out of memory"}
        return key | {"devices": 16, "argument_gib": 1.0, "temp_gib": 2.0, "peak_gib": 3.0,
                      "fits": True, "kernels": kernels}

    monkeypatch.setattr(fit, "ROOT", tmp_path)
    monkeypatch.setattr(fit, "compile_one", compile_one)
    monkeypatch.setattr(sys, "argv", ["fit.py", "--target", "h100", "--configs", "diff-830m",
                                      "--impls", "pallas"])
    fit.main()
    assert tried == ["h100:8", "h100:16"]
    rows = json.loads((tmp_path / "benchmarks/results/gpu_fit.json").read_text())
    assert [(r["config"], r["impl"], r["topology"]) for r in rows] == [
        ("diff-830m", "pallas", "h100:8"), ("diff-830m", "pallas", "h100:16"),
        ("diff-1.4b", "pallas", "h100:8"), ("diff-1.4b", "xla", "h100:16")]
    md = (tmp_path / "docs/gpu-fit.md").read_text()
    assert "| diff-830m | pallas | h100:8 | | | | | no: out of HBM |" in md
    assert "| diff-830m | pallas | h100:16 (16) | 1.0 | 2.0 | 3.0 | dkdv 944 B | yes |" in md
    assert fit._spills({"kernels": [dict(k, spill_store_bytes=0) for k in kernels]}) == "none"
