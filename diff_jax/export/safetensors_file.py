"""The safetensors file format, written and read with numpy (bfloat16 included).

Layout: an 8-byte little-endian header length N, N bytes of JSON mapping each tensor name to
{dtype, shape, data_offsets} (plus `__metadata__`, string to string), then the raw little-endian
tensor bytes. The `safetensors` package's numpy API cannot read bfloat16, hence this module.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from diff_jax.export.errors import ExportError

_CODES = {
    np.dtype(np.float64): "F64",
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


def _require_little_endian() -> None:
    if sys.byteorder != "little":
        raise ExportError("safetensors I/O here assumes a little-endian host")


def write_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str]) -> None:
    """Write `tensors` (C order, little-endian) with string `metadata` to `path`."""
    _require_little_endian()
    arrays = {name: np.ascontiguousarray(tensors[name]) for name in sorted(tensors)}
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, array in arrays.items():
        if array.dtype not in _CODES:
            raise ExportError(f"{name}: dtype {array.dtype} cannot be written to safetensors")
        header[name] = {"dtype": _CODES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep the tensor data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for array in arrays.values():
            f.write(array.tobytes())


def read_safetensors(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors as read-only memory-mapped arrays, metadata) from the safetensors file `path`."""
    _require_little_endian()
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if n < 2 or 8 + n > size:
            raise ExportError(f"{path}: not a safetensors file or truncated (header length "
                                   f"{n}, file size {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ExportError(f"{path}: the header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise ExportError(f"{path}: the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data = np.memmap(path, np.uint8, mode="r", offset=8 + n) if size > 8 + n else np.zeros(0, np.uint8)
    tensors = {}
    for name, info in header.items():
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ExportError(f"{path}: tensor {name!r} has a malformed or unsupported "
                                   f"header entry {info!r}") from e
        if end - begin != math.prod(shape) * dtype.itemsize or not 0 <= begin <= end <= data.size:
            raise ExportError(f"{path}: tensor {name!r} needs bytes [{begin}, {end}) of "
                                   f"{data.size} (shape {shape}, {dtype}); the file is truncated "
                                   "or corrupt")
        tensors[name] = data[begin:end].view(dtype).reshape(shape)
    return tensors, metadata
