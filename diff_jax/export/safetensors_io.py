"""`model.safetensors` written and read with the `safetensors` package (bfloat16 included).

The package's numpy API handles bfloat16 (`ml_dtypes`) both ways from safetensors 0.8: `save_file`
takes the numpy dtype's name, and `safe_open(framework="np")` returns `ml_dtypes.bfloat16`
arrays (`safetensors.numpy.load`, from bytes, still lacks BF16, so it is not used). Arrays stay on
the host: nothing is copied to an accelerator to convert a checkpoint. Files written by the
former hand-written writer are standard safetensors files and read the same way.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from diff_jax.export.errors import ExportError

# The dtypes our exports and the Hugging Face checkpoints we import use.
WRITABLE = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16),
            np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.int64))


def write_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str]) -> None:
    """Write `tensors` ({name: array of any shape, a `WRITABLE` dtype}) and string `metadata`, the
    file's mode 0666 less the umask, as `open` gives."""
    arrays = {}
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        if array.dtype not in WRITABLE:
            raise ExportError(f"{path}: tensor {name!r} has dtype {array.dtype}, which is not "
                              f"written to safetensors here (one of {[str(d) for d in WRITABLE]})")
        arrays[name] = array
    try:
        save_file(arrays, str(path), metadata=dict(metadata))
        _sort_header(Path(path))
        # save_file creates the file 0600; give it the mode of every other file written (umask).
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(path, 0o666 & ~umask)
    except (SafetensorError, OSError, ValueError) as e:
        raise ExportError(f"{path}: could not write safetensors: {e}") from e


def _sort_header(path: Path) -> None:
    """Rewrite the JSON header of the safetensors file `path` with its keys sorted, in place: the
    package writes the metadata from a hash map, in an order that changes from process to
    process, so two exports of one step differed in bytes. The same keys and values come out as
    long as the package's compact JSON (which is padded with spaces to its length)."""
    with path.open("r+b") as f:
        length = int.from_bytes(f.read(8), "little")
        text = json.dumps(json.loads(f.read(length)), sort_keys=True, separators=(",", ":"),
                          ensure_ascii=False).encode()
        if len(text) > length:
            raise ExportError(f"{path}: its header re-sorted is {len(text)} bytes, longer than "
                              f"the {length} written")
        f.seek(8)
        f.write(text.ljust(length, b" "))


def read_safetensors(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """({name: numpy array in the stored dtype and shape}, metadata) of the safetensors file `path`.

    `ExportError` naming the file when it is missing, truncated, corrupt, or holds a dtype that
    numpy cannot represent (naming the tensor and its dtype, e.g. F8_E4M3).
    """
    path = Path(path)
    if not path.is_file():
        raise ExportError(f"{path}: missing; the export is incomplete")
    try:
        with safe_open(str(path), framework="np") as f:
            metadata = dict(f.metadata() or {})
            tensors = {}
            for name in f.keys():
                try:
                    tensors[name] = f.get_tensor(name)
                # safetensors looks the dtype up on numpy (AttributeError for float8_*, float4_*)
                except (AttributeError, TypeError, ValueError) as e:
                    raise ExportError(f"{path}: tensor {name!r} has dtype "
                                      f"{f.get_slice(name).get_dtype()}, which numpy cannot hold "
                                      f"(expected one of {[str(d) for d in WRITABLE]}): {e}") from e
    except SafetensorError as e:
        raise ExportError(f"{path}: not a readable safetensors file (truncated or corrupt?): {e}") from e
    return tensors, metadata
