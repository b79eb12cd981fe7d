"""Device mesh and logical-axis sharding: one rule table maps module axis names to mesh axes.

Every sharding is derived from an abstract (`jax.eval_shape`) tree whose leaves are boxed with
logical axis names, so the jit signatures and the checkpoint restore target agree by
construction. Divisibility is checked on that abstract tree, before anything compiles.
"""

from __future__ import annotations

import collections
import math
from typing import Any, Sequence

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P

from diff_jax.config import MeshConfig, check_section

AXES = ("data", "fsdp", "tensor")
Rules = tuple[tuple[str, Any], ...]  # a logical-axis rule table: (logical axis, mesh axes)


class ShardingError(ValueError):
    """A mesh does not fit the devices, or a dimension is not divisible by its mesh axes."""


def mesh_shape(cfg: MeshConfig, num_devices: int) -> dict[str, int]:
    """Resolve -1 (the remaining devices) and check the product equals the device count."""
    sizes = {a: getattr(cfg, a) for a in AXES}
    known = math.prod(v for v in sizes.values() if v != -1)
    for axis, size in sizes.items():
        if size == -1:
            if num_devices % known:
                raise ShardingError(f"mesh.{axis}=-1: {num_devices} devices are not divisible by "
                                    f"the other axes' product {known}")
            sizes[axis] = num_devices // known
    if math.prod(sizes.values()) != num_devices:
        raise ShardingError(f"mesh {sizes} needs {math.prod(sizes.values())} devices, "
                            f"but {num_devices} are present; set one of mesh.data/fsdp/tensor to -1")
    return sizes


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh with Auto axis types over `devices` (default: all).

    Devices of several TPU slices (a multi-slice job; their `slice_index` differs) get a hybrid
    mesh in which `data` alone crosses slices (`slice_devices`)."""
    check_section(cfg, MeshConfig, "make_mesh")
    types = (AxisType.Auto,) * len(AXES)
    present = jax.devices() if devices is None else list(devices)
    if num_slices(present) > 1:
        return Mesh(slice_devices(cfg, present), AXES, axis_types=types)
    shape = tuple(mesh_shape(cfg, len(present))[a] for a in AXES)
    if devices is None:  # let jax order the devices for the physical topology
        return jax.make_mesh(shape, AXES, axis_types=types)
    return Mesh(np.asarray(present).reshape(shape), AXES, axis_types=types)


def num_slices(devices: Sequence[Any]) -> int:
    """How many TPU slices `devices` span (1 for devices without a `slice_index`: CPUs, GPUs)."""
    return len({getattr(d, "slice_index", 0) for d in devices})


def slice_devices(cfg: MeshConfig, devices: Sequence[Any]) -> np.ndarray:
    """The (data, fsdp, tensor) device array of a multi-slice job: slice s holds the data rows
    [s·D/S, (s+1)·D/S) of the mesh with all of fsdp and tensor, laid out on its own chips'
    interconnect (ICI) as `jax.make_mesh` lays out one slice. So only the data axis' gradient
    all-reduce crosses the slower network between slices (DCN); fsdp's gathers and tensor's
    reductions stay inside a slice. Raises `ShardingError` unless the slices are of one size and
    the mesh fits them so."""
    sizes = mesh_shape(cfg, len(devices))
    per_slice = collections.Counter(getattr(d, "slice_index", 0) for d in devices)
    slices = len(per_slice)
    if len(set(per_slice.values())) > 1:
        raise ShardingError(f"the devices span {slices} TPU slices of unequal sizes "
                            f"({dict(sorted(per_slice.items()))} devices by slice_index); a mesh "
                            "needs slices of one size")
    chips = len(devices) // slices
    if sizes["data"] % slices:
        raise ShardingError(
            f"mesh.data={sizes['data']}: the devices span {slices} TPU slices of {chips} devices, "
            f"and only the data axis crosses slices: mesh.data must be a multiple of {slices} "
            f"(mesh.fsdp × mesh.tensor = {sizes['fsdp'] * sizes['tensor']} must divide {chips})")
    from jax.experimental import mesh_utils

    ici = (sizes["data"] // slices, sizes["fsdp"], sizes["tensor"])
    split = devices[0].device_kind in ("TPU v5 lite", "TPU v5e")  # as jax.make_mesh
    return mesh_utils.create_hybrid_device_mesh(ici, (slices, 1, 1), devices,
                                                allow_split_physical_axes=split)


def check_mesh(mesh: Mesh) -> None:
    """Raise `ShardingError` unless `mesh` has the axes `AXES` and all its axes are Auto: the model's
    logical-axis constraints assert shardings on Explicit axes (`jax.make_mesh`'s default)
    instead of applying them."""
    missing = [a for a in AXES if a not in mesh.axis_names]
    if missing:
        raise ShardingError(f"mesh axes {tuple(mesh.axis_names)} lack {missing}, which mesh.rules "
                            "map to; build the mesh with diff_jax.sharding.make_mesh")
    kinds = dict(zip(mesh.axis_names, (t.name for t in mesh.axis_types)))
    if any(k != AxisType.Auto.name for k in kinds.values()):
        raise ShardingError(f"mesh axis types {kinds}: the model needs Auto axes (its logical "
                            "sharding constraints fail on Explicit ones); build the mesh with "
                            "diff_jax.sharding.make_mesh or jax.make_mesh(..., axis_types="
                            "(AxisType.Auto,) * 3)")


def axes_size(mesh: Mesh | AbstractMesh, axes: Any) -> int:
    """How many devices the mesh axes `axes` (a rule's value: an axis name, a tuple of them, or
    None for replicated) span on `mesh`."""
    if axes is None:
        return 1
    axes = axes if isinstance(axes, tuple) else (axes,)
    return math.prod(mesh.shape[a] for a in axes)


def check_divisible(boxed: Any, mesh: Mesh, rules: Sequence[tuple[str, Any]], what: str) -> None:
    """Raise `ShardingError` naming the leaf, dimension and mesh axes that do not divide. Each
    leaf's dimensions resolve as Flax shards them: where two of its logical axes map to the same
    mesh axis, the rule listed first takes it and the other dimension stays whole."""
    leaves = jax.tree_util.tree_flatten_with_path(
        boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))[0]
    for path, leaf in leaves:
        if not isinstance(leaf, nn.LogicallyPartitioned):
            continue
        resolved = nn.logical_to_mesh_axes(leaf.names, rules)
        for dim, (size, name, axes) in enumerate(zip(leaf.value.shape, leaf.names, resolved)):
            n = axes_size(mesh, axes)
            if size % n:
                raise ShardingError(
                    f"{what} {jax.tree_util.keystr(path)}: dimension {dim} ({name!r}, size {size}) "
                    f"is not divisible by mesh axes {axes!r} (size {n}); change mesh.* or mesh.rules")


def tree_shardings(boxed: Any, mesh: Mesh, rules: Sequence[tuple[str, Any]]) -> Any:
    """NamedShardings for a tree of logically boxed leaves (unboxed leaves are replicated)."""
    specs = nn.get_partition_spec(boxed)
    return nn.logical_to_mesh_sharding(specs, mesh, rules)


def unboxed(boxed: Any) -> Any:
    """The tree of logically boxed leaves with the boxes removed and no sharding constraint added
    (for abstract trees: it also works inside a mesh context); unboxed leaves pass through."""
    is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)  # noqa: E731
    return jax.tree.map(lambda x: x.unbox(apply_constraint=False) if is_box(x) else x, boxed,
                        is_leaf=is_box)


def batch_sharding(mesh: Mesh, rules: Sequence[tuple[str, Any]]) -> NamedSharding:
    """(batch, length) arrays: batch over the rule for `batch`, length replicated."""
    return NamedSharding(mesh, P(dict(rules).get("batch"), None))


def check_batch(global_batch: int, grad_accum: int, mesh: Mesh, rules: Sequence[tuple[str, Any]]) -> None:
    """Raise `ShardingError` unless a micro-batch (global_batch / grad_accum rows) divides the
    mesh axes of the `batch` rule."""
    axes = dict(rules).get("batch")
    n = axes_size(mesh, axes)
    micro = global_batch // grad_accum
    if micro % n:
        raise ShardingError(f"train.batch_size / train.grad_accum = {micro} sequences a micro-batch "
                            f"is not divisible by the batch mesh axes {axes!r} (size {n})")


def check_process_rows(sharding: NamedSharding, global_batch: int, seq_len: int) -> None:
    """Each process feeds its own B/P rows, so its devices must hold exactly B/P distinct rows
    (a mesh axis outside the batch rule that spans processes would need identical rows)."""
    spans = {idx[0].indices(global_batch)[:2]
             for idx in sharding.addressable_devices_indices_map((global_batch, seq_len)).values()}
    local = sum(stop - start for start, stop in spans)
    if local != global_batch // jax.process_count():
        raise ShardingError(f"this process's devices hold {local} of the {global_batch} batch rows, "
                            f"not {global_batch // jax.process_count()}: a mesh axis outside the "
                            "`batch` rule spans processes; shard the batch over it (mesh.rules)")
