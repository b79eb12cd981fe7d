"""Ahead-of-time compilation of the sharded train step, for local devices or a TPU slice.

`train.compile_only=true train.compile_topology=v5p:4x4x4` compiles on a CPU machine for a slice
you do not have (needs libtpu: `pip install "jax[tpu]"`) and reports per-chip memory against HBM
and per-chip FLOPs of one step, for the attention implementation the run would use. The step is
the training loop's own (`diff_jax.step.build_steps`), lowered on abstract arguments.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import jax
import jax.export

from diff_jax.config import Config, ConfigError
from diff_jax.platforms import describe_missing_tpu_host
from diff_jax.sharding import make_mesh
from diff_jax.step import Batch, Steps, TrainState, build_steps

HBM_BYTES = {"v4": 32 * 2**30, "v5e": 16 * 2**30, "v5p": 95 * 2**30, "v6e": 32 * 2**30}
GiB = 2**30


def topology_devices(topology: str) -> list[Any]:
    """The devices of a TPU slice description such as `v5p:4x4x4` (no TPU needed, libtpu is)."""
    from jax.experimental import topologies

    describe_missing_tpu_host(topology)
    try:
        return list(topologies.get_topology_desc(topology, platform="tpu").devices)
    except Exception as e:  # libtpu missing or an unknown topology name
        raise ConfigError(f"train.compile_topology={topology!r}: cannot describe this TPU slice "
                          f"({type(e).__name__}: {e}); it needs libtpu (pip install 'jax[tpu]') "
                          "and a name like v5p:2x2x2") from e


def _abstract_args(config: Config, steps: Steps) -> tuple[TrainState, Batch]:
    """The train step's (state, batch) as ShapeDtypeStructs with their shardings: nothing is
    allocated, so `steps` may be for devices this machine does not have."""
    return steps.abstract, steps.abstract_batch(config.train.batch_size, config.train.seq_len)


def compile_train_step(config: Config, devices: list[Any] | None = None) -> dict[str, Any]:
    """Compile the sharded train step for `devices` (default: local); return memory and FLOPs."""
    steps = build_steps(config, make_mesh(config.mesh, devices))
    with steps.context():
        compiled = steps.train.lower(*_abstract_args(config, steps)).compile()
    mesh, model = steps.mesh, steps.model
    mem = compiled.memory_analysis()
    args, temp = mem.argument_size_in_bytes, mem.temp_size_in_bytes
    out, alias = mem.output_size_in_bytes, mem.alias_size_in_bytes
    return {
        "devices": len(mesh.devices.flat), "device_kind": mesh.devices.flat[0].device_kind,
        "mesh": dict(mesh.shape), "attention_impl": model.attention_op.impl,
        "argument_gib": args / GiB, "temp_gib": temp / GiB,
        "peak_gib": (args + temp + out - alias) / GiB, "flops_per_chip": flops_per_chip(compiled),
    }


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


def flops_per_chip(compiled: Any) -> float:
    """FLOPs of one step on one chip from XLA's cost analysis of the partitioned program.

    Custom calls count what their kernels declare (the fused kernel's `pl.CostEstimate`).
    """
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per partition
        cost = cost[0]
    return float(cost.get("flops", 0.0))


def report(config: Config) -> dict[str, Any]:
    """Print (and return) the compile report of `config` as JSON."""
    topology = config.train.compile_topology
    devices = topology_devices(topology) if topology else None
    result = compile_train_step(config, devices)
    if topology:
        hbm = HBM_BYTES.get(topology.split(":")[0])
        result["topology"] = topology
        result["hbm_gib"] = hbm / GiB if hbm else None
        result["fits"] = None if hbm is None else result["peak_gib"] * GiB <= hbm
    print(json.dumps(result, indent=1))
    return result
