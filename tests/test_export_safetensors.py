"""model.safetensors through the `safetensors` package: bfloat16, metadata, damaged files, and a
file written by the former hand-written writer (tests/fixtures/safetensors_export_v0)."""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest

from diff_jax import export as ex
from diff_jax.config import ModelConfig
from diff_jax.export.safetensors_io import read_safetensors, write_safetensors

FIXTURE = Path(__file__).parent / "fixtures" / "safetensors_export_v0"
FIXTURE_CONFIG = ModelConfig(variant="diff", vocab_size=32, embed_dim=16, num_layers=1, num_heads=2,
                             mlp_dim=32, max_seq_len=16, tie_embeddings=False)


def fixture_state_dict() -> dict[str, np.ndarray]:
    """Export tensors of FIXTURE_CONFIG, every value a multiple of 1/16 in [-14/16, 14/16] (exact
    in bfloat16), different for every tensor."""
    out = {}
    for k, (name, shape) in enumerate(sorted(ex.state_dict_shapes(FIXTURE_CONFIG).items())):
        n = int(np.prod(shape))
        out[name] = (((np.arange(n) * 7 + 13 * k) % 29 - 14) / 16).astype(np.float32).reshape(shape)
    return out


def fixture_params() -> dict:
    return ex.from_state_dict(fixture_state_dict(), FIXTURE_CONFIG, "fixture")


def _raw_header(path: Path) -> dict:
    """The JSON header of a safetensors file, parsed by hand (independently of the package)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8: 8 + n])


def test_a_file_from_the_former_writer_still_loads(caplog):
    """...with a warning that its bytes are not verified: it predates the exports' checksums.json."""
    header = _raw_header(FIXTURE / "model.safetensors")
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    tensors, metadata = read_safetensors(FIXTURE / "model.safetensors")
    assert json.loads(metadata["model_config"])["embed_dim"] == 16
    expected = fixture_state_dict()
    assert {k: (v.dtype, v.shape) for k, v in tensors.items()} == {
        k: (np.dtype(ml_dtypes.bfloat16), v.shape) for k, v in expected.items()}
    for k, v in expected.items():
        np.testing.assert_array_equal(tensors[k].astype(np.float32), v)
    with caplog.at_level("WARNING"):
        config, params = ex.load(FIXTURE)
    assert f"{FIXTURE} has no recorded checksums (written before diff-jax recorded them)" in caplog.text
    assert config == FIXTURE_CONFIG
    jax.tree.map(np.testing.assert_array_equal, params, fixture_params())


@pytest.mark.parametrize("key, value", [("rope_theta", 500000.0), ("norm_eps", 1e-6),
                                        ("lambda_init", 0.5), ("num_layers", 2)])
def test_a_config_json_that_is_not_the_one_in_model_safetensors_is_refused(key, value, tmp_path):
    """The export writes the model config twice, config.json and model.safetensors' model_config
    metadata, and read config.json alone: in an export whose checksums.json does not cover it
    (this one, from the former writer, has none), an edited config.json or one copied from
    another export of the same shapes loaded as the model the tensors were trained as (RoPE θ,
    the norms' ε, λ_init). It is refused naming both files and the field; a field that changes
    nothing the parameters compute may differ (eval.py's overrides change them too)."""
    export = tmp_path / "export"
    shutil.copytree(FIXTURE, export)
    config = json.loads((export / "config.json").read_text())
    (export / "config.json").write_text(json.dumps(config | {key: value}))
    with pytest.raises(ex.ExportError, match=re.escape(
            f"{export / 'config.json'} gives a model with model.{key}={value} but "
            f"{export / 'model.safetensors'} holds one with model.{key}="
            f"{config.get(key, 'null')} (its model_config metadata); the export wrote both "
            "from one config, so one was edited or comes from another export")):
        ex.load(export)
    free = {"max_seq_len": 8, "dtype": "bfloat16"}  # nothing the parameters compute
    (export / "config.json").write_text(json.dumps(config | free))
    assert ex.load(export)[0].max_seq_len == 8
    tensors, metadata = read_safetensors(FIXTURE / "model.safetensors")
    write_safetensors(export / "model.safetensors", tensors, {**metadata, "model_config": "{"})
    with pytest.raises(ex.ExportError, match=re.escape(
            f"{export / 'model.safetensors'} model_config metadata: not valid JSON: ")):
        ex.load(export)
    write_safetensors(export / "model.safetensors", tensors, {"format": "pt"})  # not ours: no copy
    assert ex.load(export)[0].max_seq_len == 8


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_written_file_is_standard_safetensors_with_bf16_and_metadata(dtype, tmp_path):
    tensors = {k: v.astype(ex.DTYPES[dtype]) for k, v in fixture_state_dict().items()}
    path = tmp_path / "model.safetensors"
    write_safetensors(path, tensors, {"format": "pt", "note": "ü"})
    header = _raw_header(path)
    assert header["__metadata__"] == {"format": "pt", "note": "ü"}
    code = {"float32": "F32", "bfloat16": "BF16"}[dtype]
    assert {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"} == {
        k: (code, v.shape) for k, v in tensors.items()}
    back, metadata = read_safetensors(path)
    assert metadata["note"] == "ü"
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype
        np.testing.assert_array_equal(back[k], v)
    torch_st = pytest.importorskip("safetensors.torch")  # another consumer of the same bytes
    torch = pytest.importorskip("torch")
    theirs = torch_st.load_file(path)
    for k, v in tensors.items():
        np.testing.assert_array_equal(theirs[k].to(torch.float32).numpy(), v.astype(np.float32))


def test_the_header_is_written_in_one_order_so_equal_exports_are_equal_bytes(tmp_path):
    """The package writes the metadata from a hash map, whose order changed from process to
    process: two exports of one step had different bytes (and file hashes). The header's keys
    are now sorted, the metadata's too, and the file still reads (here and through torch)."""
    tensors = fixture_state_dict()
    metadata = {f"key{i}": f"value {i} ü" for i in (3, 1, 4, 0, 2)}
    for name in ("a", "b"):
        write_safetensors(tmp_path / name, tensors, metadata)
    raw = (tmp_path / "a").read_bytes()
    assert raw == (tmp_path / "b").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    text = raw[8: 8 + n].decode()
    header = json.loads(text)
    assert list(header) == sorted(header) and list(header["__metadata__"]) == sorted(metadata)
    assert text.rstrip(" ") == json.dumps(header, sort_keys=True, separators=(",", ":"),
                                          ensure_ascii=False)
    back, read_metadata = read_safetensors(tmp_path / "a")
    assert read_metadata == metadata and back.keys() == tensors.keys()
    for k, v in tensors.items():
        np.testing.assert_array_equal(back[k], v)
    torch_st = pytest.importorskip("safetensors.torch")
    assert torch_st.load_file(tmp_path / "a").keys() == tensors.keys()


def test_unwritable_dtype_and_damaged_files_name_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    with pytest.raises(ex.ExportError, match=r"model.safetensors: tensor 'x' has dtype complex64"):
        write_safetensors(path, {"x": np.zeros(2, np.complex64)}, {})
    with pytest.raises(ex.ExportError, match=r"model.safetensors: missing"):
        read_safetensors(path)
    data = (FIXTURE / "model.safetensors").read_bytes()
    for damaged in (data[: len(data) - 3], data[:20], b"\x00" * 4):
        path.write_bytes(damaged)
        with pytest.raises(ex.ExportError, match=r"model.safetensors: not a readable safetensors file"):
            read_safetensors(path)


def test_a_dtype_numpy_cannot_hold_names_the_file_and_tensor(tmp_path):
    """A float8 tensor (as in FP8 checkpoints) is one ExportError naming the file, the tensor and
    its dtype; safetensors' numpy backend fails on it with an AttributeError."""
    path = tmp_path / "model.safetensors"
    header = json.dumps({"w": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0")
    with pytest.raises(ex.ExportError, match=re.escape(
            f"{path}: tensor 'w' has dtype F8_E4M3, which numpy cannot hold (expected one of "
            "['float32', 'bfloat16', 'float16', 'float64', 'int32', 'int64']): ")):
        read_safetensors(path)


def test_a_write_that_fails_names_the_file(tmp_path):
    path = tmp_path / "missing" / "model.safetensors"
    with pytest.raises(ex.ExportError, match=re.escape(f"{path}: could not write safetensors: ")):
        write_safetensors(path, {"x": np.zeros(2, np.float32)}, {})
