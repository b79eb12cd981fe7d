"""Which NVIDIA GPU the kernels are built for, and the Mosaic GPU kernel's tile table.

The GPU generation decides the differential kernel's backend (`kernels.flash`): Mosaic GPU on
compute capability 9.x (Hopper: the kernel's wgmma is an sm_90a instruction), Pallas' Triton
backend on any other. It is read,
at trace time, from
  1. `target(...)`, a context manager that names it explicitly (`with kernels.gpu_target("8.0")`),
     for exports to a GPU other than the one attached, or none;
  2. else the first local CUDA device's `compute_capability`;
  3. else (no CUDA device: exporting from a CPU host) 9.0, the generation the kernel is for.

Tiles come from `kernels/tuning/mosaic_gpu.json`: rows (gpu, d, dtype) where gpu is one word of
jax's `device_kind` ("H100" for "NVIDIA H100 80GB HBM3" and "NVIDIA H100 PCIe", "H200" for
"NVIDIA H200"; compared case-insensitively, whole words only) or "default"; the attached GPU's
own row wins, then "default". `benchmarks/attention.py --tune` adds measured rows (`record`).
A table that does not read, or a row without a valid gpu word, d, dtype or tiles, is one
ValueError naming the file and the row (every pallas call reads the table while tracing).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp

from . import flash_mgpu
from .flash_mgpu import Tiles

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
def target(compute_capability: str | tuple[int, int]) -> Iterator[None]:
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
    """The rows ("entries") of the Mosaic GPU tile table at `path` (see `tiles_for`), each
    checked: one ValueError naming the file, the row and what is wrong."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"Mosaic GPU tile table {path} does not read as JSON: {e}") from None
    rows = doc.get("entries") if isinstance(doc, dict) else None
    if not isinstance(rows, list):
        raise ValueError(f"Mosaic GPU tile table {path} must be an object with a list 'entries'")
    for n, row in enumerate(rows):
        where = f"Mosaic GPU tile table {path}, entries[{n}]"
        if not isinstance(row, dict):
            raise ValueError(f"{where} must be an object, got {row!r}")
        for key, kind, what in (("gpu", str, "a string"), ("d", int, "an integer"),
                                ("dtype", str, "a dtype name")):
            if not isinstance(row.get(key), kind) or isinstance(row.get(key), bool):
                raise ValueError(f"{where}: {key} must be {what}, got {row.get(key)!r}")
        _check_gpu(row["gpu"], where)
        try:
            _tiles(row).check()
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where} (gpu {row['gpu']}, d={row['d']}, {row['dtype']}): "
                             f"{e if isinstance(e, ValueError) else f'missing field {e}'}") from None
    return rows


def _check_gpu(gpu: str, where: str) -> None:
    """A row's gpu: "default" or one word of a device_kind (never empty: it would match none)."""
    if not gpu or gpu.split() != [gpu]:
        raise ValueError(f"{where}: gpu must be 'default' or one word of jax's device_kind "
                         f"such as 'H100', got {gpu!r}")


def _tiles(row: dict) -> Tiles:
    """A row's Tiles. A row tuned to fused dQ (jax >= 0.11) runs its dK/dV schedule with the
    "rows" dQ kernel on a jax without it (`flash_mgpu.FUSED_DQ`), so that a table written on
    the GPU machine's jax still reads, and runs, on jax 0.10."""
    dq = row.get("dq", "rows")
    if dq in flash_mgpu.FUSED and not flash_mgpu.FUSED_DQ:
        dq = "rows"
    return Tiles(row["block_kv"], row["block_kv_dq"], row["block_q_dkv"], row["stages"],
                 row.get("dkv", "auto"), row.get("pingpong", True), dq)


def _rows(dtype: jax.typing.DTypeLike, kind: str | None, path: Path) -> list[dict]:
    """The table's rows for `dtype` that GPU `kind` (None: the attached one) reads: its own,
    then "default"'s."""
    words = (device_kind() if kind is None else kind).lower().split()
    rows = [r for r in load_table(path) if r["dtype"] == jnp.dtype(dtype).name]
    return ([r for r in rows if r["gpu"] != "default" and r["gpu"].lower() in words]
            + [r for r in rows if r["gpu"] == "default"])


def tiles_for(d: int, dtype: jax.typing.DTypeLike, kind: str | None = None,
              path: Path = TABLE) -> tuple[Tiles, dict]:
    """(Tiles, table row) for head width d and dtype on GPU `kind` (default: the attached one)."""
    row = next((r for r in _rows(dtype, kind, path) if r["d"] == d), None)
    if row is None:
        raise ValueError(untabled([d], dtype, kind, path))
    return _tiles(row), row


def untabled(dims: list[int], dtype: jax.typing.DTypeLike, kind: str | None = None,
             path: Path = TABLE) -> str | None:
    """Why `tiles_for` finds no row for some of the head widths `dims` in `dtype` on GPU `kind`
    (default: the attached one), naming them and the widths it has; None where it finds all.
    The benchmarks refuse such a --head-dims before anything compiles (`--tune` measured its
    widths after the table's row as the first setting: a width without one was a traceback;
    kernel_profile.py recorded a refused row per schedule, on the GPU)."""
    have = sorted({r["d"] for r in _rows(dtype, kind, path)})
    missing = [d for d in dims if d not in have]
    if not missing:
        return None
    return (f"{path} has no {jnp.dtype(dtype).name} row for d = {', '.join(map(str, missing))}; "
            f"it has d = {', '.join(map(str, have))}")


def tiles_text(tiles: Tiles) -> str:
    """"block_kv,block_kv_dq,block_q_dkv,stages,dkv,pingpong,dq": every field, as `parse_tiles`
    reads it back (a tuning row's `tiles`)."""
    return ",".join(str(getattr(tiles, f.name)) for f in dataclasses.fields(tiles))


def parse_tiles(text: str) -> Tiles:
    """The Tiles that `tiles_text` wrote."""
    *sizes, dkv, pingpong, dq = text.split(",")
    return Tiles(*(int(x) for x in sizes), dkv, pingpong == "True", dq)


def record(gpu: str, d: int, dtype: jax.typing.DTypeLike, tiles: Tiles, source: str,
           path: Path = TABLE) -> None:
    """Write a tuned row for (gpu, d, dtype), replacing an earlier one for the same key."""
    tiles.check()
    _check_gpu(gpu, f"a tuned row for {path}")
    load_table(path)  # refuses to add to a table that does not read
    doc = json.loads(path.read_text())
    name = jnp.dtype(dtype).name
    doc["entries"] = [r for r in doc["entries"]
                      if (r["gpu"], r["d"], r["dtype"]) != (gpu, d, name)]
    doc["entries"].append({"gpu": gpu, "d": d, "dtype": name, "block_kv": tiles.block_kv,
                           "block_kv_dq": tiles.block_kv_dq, "block_q_dkv": tiles.block_q_dkv,
                           "stages": tiles.stages, "dkv": tiles.dkv,
                           "pingpong": tiles.pingpong, "dq": tiles.dq, "tuned": True,
                           "source": source})
    # whole or not at all: a kill or a full disk part-way leaves the table as it was (every
    # pallas call reads it). kernels/ does not import diff_jax, whose output_dir does the same.
    tmp = path.with_name(f".{path.name}.partial")
    try:
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
