"""Conversion between the PyTorch reference's attention state_dict and diff-jax parameters.

The layouts agree (adjacent Q1/Q2 sub-heads, heads concatenated in order), so a projection's
Flax kernel (in, out) is the transpose of the reference `Linear.weight` (out, in); the λ vectors
and the per-head norm weight are copied as they are. λ_init is not stored: it follows from the
layer index (`depth`). Each variant's reference layout and shapes are its spec's
(`diff_jax.variants.Variant.reference_layout`, `.reference_shapes`).

    python -m diff_jax.interop run-reference IN.npz OUT.npz

runs this project's attention module on a reference state_dict and input (see `run_reference`).
"""

from __future__ import annotations

import io
import sys
import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from diff_jax import variants
from diff_jax.command import failed, leave, output_kept
from diff_jax.config import ConfigError, ModelConfig
from diff_jax.file_errors import describe
from diff_jax.output_dir import write_whole
from diff_jax.sharding import unboxed


def reference_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The reference state_dict shapes of one attention module of `config` (its variant's
    `Variant.reference_shapes`)."""
    return variants.spec(config.variant).reference_shapes(config)


def from_reference(state_dict: Mapping[str, np.ndarray], config: ModelConfig) -> dict:
    """Reference attention state_dict (numpy, reference names) -> our attention parameter tree."""
    expected = reference_shapes(config)
    params: dict = {}
    layout = variants.spec(config.variant).reference_layout(config)
    for key, ((*parents, leaf), transpose) in layout.items():
        if key not in state_dict:
            raise KeyError(f"reference state_dict is missing {key!r} (expected shape {expected[key]})")
        value = np.asarray(state_dict[key], np.float32)
        if value.shape != expected[key]:
            raise ValueError(f"{key}: expected shape {expected[key]}, got {value.shape}")
        node = params
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value.T if transpose else value
    extra = sorted(set(state_dict) - set(expected))
    if extra:
        raise KeyError(f"unexpected keys in the reference state_dict for {config.variant}: {extra}")
    return params


def to_reference(params: Mapping, config: ModelConfig) -> dict[str, np.ndarray]:
    """Our attention parameter tree (boxed or not) -> reference state_dict (numpy, (out, in)
    weights)."""
    params, out = unboxed(params), {}
    for key, (path, transpose) in variants.spec(config.variant).reference_layout(config).items():
        node = params
        for p in path:
            node = node[p]
        value = np.asarray(node)
        out[key] = np.ascontiguousarray(value.T) if transpose else value
    return out


def attention_output(
    state_dict: Mapping[str, np.ndarray],
    x: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    config: ModelConfig,
    depth: int,
) -> np.ndarray:
    """Run our attention module (float32) with reference weights and explicit RoPE tables:
    x (B, T, E), cos and sin (T, d/2) -> (B, T, E)."""
    params = from_reference(state_dict, config)
    module = variants.spec(config.variant).module(config, depth=depth)
    fn = jax.jit(lambda p, x, c, s: module.apply({"params": p}, x, rope=(c, s)))
    out = fn(params, jnp.asarray(x, jnp.float32), jnp.asarray(cos, jnp.float32),
             jnp.asarray(sin, jnp.float32))
    return np.asarray(out)


def _scalar(data: Mapping, key: str, kind: type):
    if key not in data:
        raise KeyError(f"IN.npz is missing the scalar {key!r}")
    value = np.asarray(data[key])
    if value.shape != ():
        raise ValueError(f"{key}: expected a scalar, got shape {value.shape}")
    return kind(value.item())


def _array(data: Mapping, key: str, shape: tuple[int, ...]) -> np.ndarray:
    if key not in data:
        raise KeyError(f"IN.npz is missing {key!r} (expected shape {shape})")
    value = np.asarray(data[key])
    if value.shape != shape:
        raise ValueError(f"{key}: expected shape {shape}, got {value.shape}")
    return value.astype(np.float32)


def _v1_config(data: Mapping, e: int, h: int, kv: int) -> tuple[ModelConfig, int]:
    """(config, depth) of a reference `MultiheadDiffAttn` (V1): its depth and GQA pairing."""
    depth = _scalar(data, "depth", int)
    if depth < 0:
        raise ValueError(f"depth: expected the layer index, an integer >= 0, got {depth}")
    pairing = _scalar(data, "gqa_pairing", str)
    if pairing not in ("flash", "naive"):
        raise ValueError(f"gqa_pairing: expected 'flash' or 'naive', got {pairing!r}")
    return ModelConfig(variant="diff", embed_dim=e, num_heads=h, num_kv_heads=kv,
                       num_layers=depth + 1, gqa_pairing=pairing), depth


def _v2_config(data: Mapping, e: int, h: int, kv: int) -> tuple[ModelConfig, int]:
    """(config, depth 0) of a reference DIFF V2 module: its head width."""
    return ModelConfig(variant="diff_v2", embed_dim=e, num_heads=h, num_kv_heads=kv,
                       head_dim=_scalar(data, "head_dim", int)), 0


_REFERENCE_MODULES = {"v1": _v1_config, "v2": _v2_config}  # IN.npz `variant` -> its config


def run_reference(in_path: str, out_path: str) -> None:
    """IN.npz (reference tensors, x, rope_cos, rope_sin, scalars) -> OUT.npz with `output` (B,T,E),
    written whole or not at all (`output_dir.write_whole`)."""
    data = {}
    try:
        archive = np.load(in_path, allow_pickle=False)
    # numpy reads a file that is no archive as a pickle and refuses it; an empty one is EOFError
    except (ValueError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"{in_path}: not a NumPy .npz archive (np.savez writes one): "
                         f"{type(e).__name__}: {e}") from e
    if not isinstance(archive, np.lib.npyio.NpzFile):  # a single .npy array
        raise ValueError(f"{in_path}: a single .npy array, not an .npz archive of named arrays")
    with archive as f:
        for k in f.files:
            try:
                data[k] = f[k]
            except ValueError as e:  # numpy's own text names neither the file nor the array
                raise ValueError(f"{k}: an object array, which IN.npz cannot hold (numeric arrays "
                                 f"and string scalars only; {e})") from e
            except (zipfile.BadZipFile, zlib.error, EOFError) as e:  # cut short or corrupted
                raise ValueError(f"{in_path}: {k} cannot be read, the archive is damaged "
                                 f"({type(e).__name__}: {e})") from e
    reference = _scalar(data, "variant", str)
    if reference not in _REFERENCE_MODULES:
        raise ValueError(f"variant: expected 'v1' or 'v2', got {reference!r}")
    e = _scalar(data, "embed_dim", int)
    try:
        config, depth = _REFERENCE_MODULES[reference](
            data, e, _scalar(data, "num_heads", int), _scalar(data, "num_kv_heads", int))
    except ConfigError as e:  # sizes no module has, named by the model's own field
        raise ValueError(f"{in_path}: its scalars describe no {reference} attention module: "
                         f"{e}") from e
    if "x" not in data:
        raise KeyError("IN.npz is missing 'x' (expected shape (B, T, embed_dim))")
    x = np.asarray(data["x"])
    if x.ndim != 3 or x.shape[-1] != e:
        raise ValueError(f"x: expected shape (B, T, {e}), got {x.shape}")
    half = config.resolved_head_dim // 2
    cos = _array(data, "rope_cos", (x.shape[1], half))
    sin = _array(data, "rope_sin", (x.shape[1], half))
    names = set(reference_shapes(config))
    state_dict = {k: v for k, v in data.items() if k in names}
    missing = sorted(names - set(state_dict))
    if missing:
        raise KeyError(f"IN.npz is missing reference tensor(s) {missing}")
    out = attention_output(state_dict, x, cos, sin, config, depth)
    buffer = io.BytesIO()
    np.savez(buffer, output=out)
    write_whole(Path(out_path), buffer.getvalue())


def main(argv: list[str] | None = None) -> int:
    """`python -m diff_jax.interop run-reference IN.npz OUT.npz`; 0 on success (and for
    --help), 2 on bad input (one `error:` line) or a usage error, 130 after Ctrl-C."""
    argv = sys.argv[1:] if argv is None else argv
    usage = "usage: python -m diff_jax.interop run-reference IN.npz OUT.npz"
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        return 0
    if len(argv) != 3 or argv[0] != "run-reference":
        print(usage, file=sys.stderr)
        return 2
    try:
        run_reference(argv[1], argv[2])
    except KeyboardInterrupt:
        return output_kept(argv[2])
    except OSError as e:
        return failed(describe(e, [("IN.npz", argv[1]), ("OUT.npz", argv[2])]))
    except (KeyError, ValueError) as e:
        return failed(str(e.args[0] if isinstance(e, KeyError) and e.args else e))
    return 0


if __name__ == "__main__":
    leave(main())
