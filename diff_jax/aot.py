"""Ahead-of-time compilation of the sharded train step, for local devices, a TPU slice or GPUs.

`train.compile_only=true train.compile_topology=v5p:4x4x4` compiles on a CPU machine for a slice
you do not have (needs libtpu: `pip install "jax[tpu]"`; `train.compile_slices=N` for N of them
joined by the data-center network, a multi-slice job); `train.compile_topology=h100:8` does the
same for eight H100s in one host (needs the CUDA plugin and ptxas, not a GPU: the `cuda-aot`
extra), which compiles the Mosaic GPU kernels to sm_90a machine code as a GPU run would. Either
reports per-device memory against the device's memory and per-device FLOPs of one step, for the
attention implementation the run would use. The step is the training loop's own
(`diff_jax.step.build_steps`), lowered on abstract arguments.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import re
from typing import Any, Iterator, Sequence

import jax
import jax.export

from diff_jax.attention_op import resolve_impl
from diff_jax.config import Config, ConfigError
from diff_jax.device_memory import devices_here, fit_or_explain, train_advice
from diff_jax.error_text import first_line
from diff_jax.kernels import ptxas
from diff_jax.platforms import accelerator_attached, describe_missing_tpu_host, signals_kept
from diff_jax.sharding import make_mesh
from diff_jax.step import Batch, Steps, TrainState, build_steps

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """What XLA needs to know of a CUDA GPU to compile for it without one (its target config):
    the figures the device reports of itself."""

    device_kind: str  # jax's device_kind
    compute_capability: tuple[int, int]
    sms: int
    memory_bytes: int
    memory_bandwidth: int  # bytes/s
    l2_bytes: int
    clock_ghz: float

    def target_config(self) -> str:
        """XLA's GpuTargetConfigProto of this GPU, as text. Shared memory and registers are
        sm_90's: 228 KiB an SM, 227 KiB a block (opt-in), 64 Ki 32-bit registers."""
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 threads_per_core_limit: 2048
  shared_memory_per_block: 49152 shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472 registers_per_core_limit: 65536
  registers_per_block_limit: 65536 core_count: {self.sms} fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {self.memory_bandwidth} l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz} device_memory_size: {self.memory_bytes}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 }}
runtime_version {{ major: 13 minor: 0 }}
device_description_str: "{self.device_kind}"
"""


# `train.compile_topology=NAME:N` compiles for N of these GPUs in one host.
GPU_TARGETS = {
    "h100": GpuTarget("NVIDIA H100 80GB HBM3", (9, 0), sms=132, memory_bytes=84_929_347_584,
                      memory_bandwidth=3_352_320_000_000, l2_bytes=50 * 2**20, clock_ghz=1.98),
}
HBM_BYTES = {"v4": 32 * 2**30, "v5e": 16 * 2**30, "v5p": 95 * 2**30, "v6e": 32 * 2**30,
             **{name: gpu.memory_bytes for name, gpu in GPU_TARGETS.items()}}


def gpu_devices(topology: str) -> list[Any]:
    """The devices of `NAME:N` (N GPUs of `GPU_TARGETS[NAME]` in one host), described to XLA
    without a GPU: needs the CUDA plugin and ptxas (`pip install -e ".[cuda-aot]"`)."""
    from jax.experimental import topologies

    name, _, count = topology.partition(":")
    if name not in GPU_TARGETS or not re.fullmatch(r"[1-9]\d*", count):
        raise ConfigError(f"train.compile_topology={topology!r}: expected NAME:N with NAME one "
                          f"of {sorted(GPU_TARGETS)} and N >= 1 GPUs in one host, e.g. h100:8")
    try:
        return list(topologies.get_topology_desc(
            platform="cuda", topology=f"1x1x{count}",
            target_config=GPU_TARGETS[name].target_config()).devices)
    except Exception as e:  # the CUDA plugin missing
        raise ConfigError(f"train.compile_topology={topology!r}: cannot describe these GPUs "
                          f"({type(e).__name__}: {e}); it needs the CUDA plugin and ptxas "
                          "(pip install -e '.[cuda-aot]')") from e


def topology_devices(topology: str, slices: int = 1) -> list[Any]:
    """The devices of a TPU slice description such as `v5p:4x4x4` (no TPU needed, libtpu is),
    `slices` of them joined by the data-center network (a multi-slice job: each device's
    `slice_index` says which), or of GPUs such as `h100:8` (`gpu_devices`)."""
    from jax.experimental import topologies

    if topology.split(":")[0] in GPU_TARGETS:
        if slices != 1:
            raise ConfigError(f"train.compile_slices={slices}: slices are TPU slices; "
                              f"train.compile_topology={topology!r} describes GPUs in one host")
        return gpu_devices(topology)
    if not re.match(r"v\d", topology):  # before libtpu, which logs its own line for such a name
        raise ConfigError(f"train.compile_topology={topology!r}: expected a TPU slice such as "
                          f"v5p:2x2x2 or GPUs NAME:N with NAME one of {sorted(GPU_TARGETS)}, "
                          "e.g. h100:8")
    describe_missing_tpu_host(topology)
    try:
        with signals_kept():  # libtpu loads here, and ignores SIGHUP in this process
            return list(topologies.get_topology_desc(
                topology, platform="tpu", **({"num_slices": slices} if slices > 1 else {})
            ).devices)
    except Exception as e:  # libtpu missing or held, or an unknown topology name
        raise ConfigError(f"train.compile_topology={topology!r}: cannot describe this TPU slice "
                          f"({type(e).__name__}: {first_line(e)}); "
                          f"{_why_no_slice(str(e))}") from e


def _why_no_slice(error: str) -> str:
    """What to do when libtpu could not describe a TPU slice, by the likely cause."""
    if importlib.util.find_spec("libtpu") is None:
        return "it needs libtpu: pip install 'jax[tpu]' (or diff-jax's tpu extra)"
    if "lockfile" in error:  # describe_missing_tpu_host allows it where there are no TPU chips
        if not accelerator_attached():
            return (f"another process has libtpu loaded, and ALLOW_MULTIPLE_LIBTPU_LOAD="
                    f"{os.environ.get('ALLOW_MULTIPLE_LIBTPU_LOAD', '')} keeps this one from "
                    "loading it beside that one; unset it (this machine has no TPU chips to "
                    "guard)")
        return ("another process on this TPU host has libtpu loaded (a training run, another "
                "compile): compile when it has ended, or on a machine without TPU chips")
    return (f"expected a TPU slice name such as v5p:2x2x2 (GPUs: NAME:N, NAME one of "
            f"{sorted(GPU_TARGETS)})")


def _abstract_args(config: Config, steps: Steps) -> tuple[TrainState, Batch]:
    """The train step's (state, batch) as ShapeDtypeStructs with their shardings: nothing is
    allocated, so `steps` may be for devices this machine does not have."""
    return steps.abstract, steps.abstract_batch(config.train.batch_size, config.train.seq_len)


def compile_train_step(config: Config, devices: list[Any] | None = None) -> dict[str, Any]:
    """Compile the sharded train step for `devices` (default: local); return memory, FLOPs
    (None where XLA gives no cost analysis: GPU programs compiled without a GPU) and, for each
    Mosaic GPU kernel compiled, ptxas's registers and spill bytes (`kernels.ptxas`)."""
    mesh = make_mesh(config.mesh, devices)
    platform = mesh.devices.flat[0].platform
    with _cudnn_found(config, resolve_impl(config.model, platform)):
        steps = build_steps(config, mesh)
        with steps.context():
            lowered = steps.train.lower(*_abstract_args(config, steps))
            if platform == "gpu":  # Mosaic GPU kernels run ptxas here
                compiled, kernels = ptxas.ptxas_report(lowered.compile)
            else:
                compiled, kernels = lowered.compile(), []
    model = steps.model
    mem = compiled.memory_analysis()
    args, temp = mem.argument_size_in_bytes, mem.temp_size_in_bytes
    out, alias = mem.output_size_in_bytes, mem.alias_size_in_bytes
    return {
        "devices": len(mesh.devices.flat), "device_kind": mesh.devices.flat[0].device_kind,
        "mesh": dict(mesh.shape), "attention_impl": model.attention_op.impl,
        "argument_gib": args / GiB, "temp_gib": temp / GiB,
        "peak_gib": (args + temp + out - alias) / GiB,
        "flops_per_chip": flops_per_chip(compiled),
        **({"flops_note": note} if (note := _loops_counted_once(config)) else {}),
        "kernels": [dataclasses.asdict(k) for k in kernels],
    }


def _loops_counted_once(config: Config) -> str | None:
    """What `flops_per_chip` undercounts: XLA's cost analysis counts a loop's body once, and the
    step loops over its micro-batches (`train.grad_accum`), its layers (`model.scan_layers`:
    measured on CPU, 31.2 MFLOP with 2 layers unrolled, 16.7 scanned, 17.4 with 4 scanned) and
    its loss chunks (`model.loss_chunk`)."""
    t, m = config.train, config.model
    loops = [f"the {t.grad_accum} micro-batches (train.grad_accum)"] if t.grad_accum > 1 else []
    if m.scan_layers and m.num_layers > 1:
        loops.append(f"the {m.num_layers} layers (model.scan_layers)")
    if 0 < m.loss_chunk < t.seq_len:
        loops.append(f"the {-(-t.seq_len // m.loss_chunk)} loss chunks (model.loss_chunk)")
    if not loops:
        return None
    return ("flops_per_chip counts one pass of the loop over " + " and of the loop over ".join(loops)
            + ": XLA's cost analysis counts a loop's body once")


@contextlib.contextmanager
def _cudnn_found(config: Config, impl: str) -> Iterator[None]:
    """Turn jax failing to find the cuDNN library while tracing or lowering a step whose
    attention `impl` is "cudnn" into a `ConfigError` naming `model.attention_impl` (the `cuda-aot`
    extra has no cuDNN; jax asks the library for its version before it emits the cuDNN call)."""
    try:
        yield
    except RuntimeError as e:
        if impl != "cudnn" or "cudnn" not in str(e).lower():
            raise
        m = config.model
        why = "" if m.attention_impl == "cudnn" else (
            f" (auto picks it for variant {m.variant} in {m.dtype} on GPU)")
        found = str(e).strip().rstrip(".")
        raise ConfigError(f"model.attention_impl={m.attention_impl}: the cuDNN attention cannot "
                          f"be compiled on this machine{why}: {found}; compile with "
                          "model.attention_impl=pallas or xla") from e


def export_train_step(config: Config, platform: str,
                      disabled_checks: Sequence[jax.export.DisabledSafetyCheck] = ()) -> str:
    """The sharded train step on the local devices' mesh, lowered for `platform` ("cuda",
    "tpu", …) with `jax.export`; returns its StableHLO text (lowering checks, no compile)."""
    steps = build_steps(config, make_mesh(config.mesh))
    with steps.context():
        exported = jax.export.export(steps.train, platforms=[platform],
                                     disabled_checks=list(disabled_checks))(
            *_abstract_args(config, steps))
    return exported.mlir_module()


def flops_per_chip(compiled: Any) -> float | None:
    """FLOPs of one step on one chip from XLA's cost analysis of the partitioned program, or
    None where XLA has none (a GPU program compiled without a GPU).

    Custom calls count what their kernels declare (the fused kernel's `pl.CostEstimate`).
    """
    cost = compiled.cost_analysis()  # a dict (jax >= 0.10), None without a cost model
    return None if cost is None else float(cost.get("flops", 0.0))


def report(config: Config) -> dict[str, Any]:
    """Print (and return) the compile report of `config` as JSON; `DeviceMemoryError` where the
    compiler itself finds that the step does not fit (XLA:TPU does)."""
    topology, slices = config.train.compile_topology, config.train.compile_slices
    devices = topology_devices(topology, slices) if topology else None
    where = (topology + (f" x {slices} slices" if slices > 1 else "") if topology
             else devices_here())
    with fit_or_explain(train_advice(config, "the train step", where)):  # XLA:TPU's compile OOM
        result = compile_train_step(config, devices)
    if topology:
        hbm = HBM_BYTES.get(topology.split(":")[0])
        result["topology"] = topology
        result["slices"] = slices
        result["hbm_gib"] = hbm / GiB if hbm else None
        result["fits"] = None if hbm is None else result["peak_gib"] * GiB <= hbm
    print(json.dumps(result, indent=1))
    return result
