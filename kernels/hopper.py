"""Which NVIDIA GPU the kernels are built for, and the Mosaic GPU kernel's tile table.

The GPU generation decides the differential kernel's backend (`kernels.flash`): Mosaic GPU on
compute capability 9.x (Hopper: the kernel's wgmma is an sm_90a instruction), Pallas' Triton
backend on any other. It is read,
at trace time, from
  1. `target(...)`, a context manager that names it explicitly (`with kernels.gpu_target("8.0")`),
     for exports to a GPU other than the one attached, or none;
  2. else the first local CUDA device's `compute_capability`;
  3. else (no CUDA device: exporting from a CPU host) 9.0, the generation the kernel is for.

Tiles come from `kernels/tuning/mosaic_gpu.json`: rows (gpu, d, dtype) where gpu is a substring
of jax's `device_kind` ("H100", "H200") or "default"; the attached GPU's own row wins, then
"default". `benchmarks/attention.py --tune` adds measured rows (`record`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from kernels.flash_mgpu import Tiles

TABLE = Path(__file__).resolve().parent / "tuning" / "mosaic_gpu.json"
HOPPER = (9, 0)

_TARGET: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "diff_jax_gpu_target", default=None)


def _parse(cc: str | tuple[int, int]) -> tuple[int, int]:
    if isinstance(cc, tuple):
        return int(cc[0]), int(cc[1])
    major, _, minor = str(cc).removeprefix("sm_").replace("a", "").partition(".")
    if not minor and len(major) >= 2:  # "sm_90" / "90"
        major, minor = major[:-1], major[-1]
    try:
        return int(major), int(minor or 0)
    except ValueError:
        raise ValueError(f"GPU target must look like '9.0', 'sm_90' or (9, 0), "
                         f"got {cc!r}") from None


# One GPU of each generation, by a name jax's Triton lowering knows (`_abstract_gpu`).
_KINDS = {(7, 5): "Tesla T4", (8, 0): "NVIDIA A100", (8, 6): "NVIDIA A10", (8, 9): "NVIDIA L4",
          (9, 0): "NVIDIA H100", (10, 0): "NVIDIA B200"}


@contextlib.contextmanager
def target(compute_capability: str | tuple[int, int]):
    """Trace the GPU kernels for this compute capability ("8.0", "sm_90", (9, 0)).

    With no GPU attached and no mesh set, it also names a GPU of that generation as the abstract
    mesh's device: jax 0.11's Triton lowering reads its target from there (jax 0.10 needs
    nothing). Under a mesh it cannot (shard_map refuses a context mesh unlike its own), so on
    jax 0.11 a sharded step's Triton kernels export only on a GPU host; the Mosaic GPU kernels
    need no device to export.
    """
    cc = _parse(compute_capability)
    token = _TARGET.set(cc)
    try:
        with _abstract_gpu(cc):
            yield
    finally:
        _TARGET.reset(token)


def _abstract_gpu(cc: tuple[int, int]):
    """An abstract mesh with no axes and a GPU of generation `cc` as its device, when no GPU is
    attached, no mesh is set and `_KINDS` names the generation; else a context doing nothing."""
    kind = _KINDS.get(cc)
    if kind is None or _cuda_device() is not None or not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform="gpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device))


def _cuda_device():
    try:
        devices = jax.devices("cuda")
    except RuntimeError:  # no CUDA backend in this process
        return None
    return devices[0] if devices else None


def compute_capability() -> tuple[int, int]:
    """(major, minor) of the GPU the kernels are traced for; see the module docstring."""
    explicit = _TARGET.get()
    if explicit is not None:
        return explicit
    dev = _cuda_device()
    cc = getattr(dev, "compute_capability", None) if dev is not None else None
    return _parse(cc) if cc else HOPPER


def device_kind() -> str:
    """jax's device_kind of the attached CUDA GPU ("NVIDIA H100 80GB HBM3"), or "" if none."""
    dev = _cuda_device()
    return getattr(dev, "device_kind", "") if dev is not None else ""


def load_table(path: Path = TABLE) -> list[dict]:
    """The rows ("entries") of the Mosaic GPU tile table at `path` (see `tiles_for`)."""
    return json.loads(path.read_text())["entries"]


def tiles_for(d: int, dtype, kind: str | None = None, path: Path = TABLE) -> tuple[Tiles, dict]:
    """(Tiles, table row) for head width d and dtype on GPU `kind` (default: the attached one)."""
    kind = (device_kind() if kind is None else kind).lower()
    name = jnp.dtype(dtype).name
    rows = [r for r in load_table(path) if r["d"] == d and r["dtype"] == name]
    own = [r for r in rows if r["gpu"] != "default" and r["gpu"].lower() in kind]
    row = (own or [r for r in rows if r["gpu"] == "default"] or [None])[0]
    if row is None:
        raise ValueError(f"kernels/tuning/mosaic_gpu.json has no row for d={d}, dtype={name}")
    return Tiles(row["block_kv"], row["block_kv_dq"], row["block_q_dkv"], row["stages"],
                 row.get("dkv", "auto"), row.get("pingpong", True), row.get("dq", "rows")), row


def tiles_text(tiles: Tiles) -> str:
    """"block_kv,block_kv_dq,block_q_dkv,stages,dkv,pingpong,dq": every field, as `parse_tiles`
    reads it back (a tuning row's `tiles`)."""
    return ",".join(str(getattr(tiles, f.name)) for f in dataclasses.fields(tiles))


def parse_tiles(text: str) -> Tiles:
    """The Tiles that `tiles_text` wrote."""
    *sizes, dkv, pingpong, dq = text.split(",")
    return Tiles(*(int(x) for x in sizes), dkv, pingpong == "True", dq)


def record(gpu: str, d: int, dtype, tiles: Tiles, source: str, path: Path = TABLE) -> None:
    """Write a tuned row for (gpu, d, dtype), replacing an earlier one for the same key."""
    tiles.check()
    doc = json.loads(path.read_text())
    name = jnp.dtype(dtype).name
    doc["entries"] = [r for r in doc["entries"]
                      if (r["gpu"], r["d"], r["dtype"]) != (gpu, d, name)]
    doc["entries"].append({"gpu": gpu, "d": d, "dtype": name, "block_kv": tiles.block_kv,
                           "block_kv_dq": tiles.block_kv_dq, "block_q_dkv": tiles.block_q_dkv,
                           "stages": tiles.stages, "dkv": tiles.dkv,
                           "pingpong": tiles.pingpong, "dq": tiles.dq, "tuned": True,
                           "source": source})
    path.write_text(json.dumps(doc, indent=1) + "\n")
