"""`model.scan_layers`: the layers as one `nn.scan` over stacked parameters.

The scanned model computes what the unrolled one does on the same parameters (float32, relative
error at 1e-6: the scan computes λ_init from a traced depth in float32, the unrolled model in
Python's float64, and XLA may order the sums differently), forward, gradients and KV-cache
decoding alike; checkpoints, exports, eval.py and train.init_from read either layout, and a
run resumes in either, its parameters and optimizer state stacked or sliced.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from diff_jax.config import ModelConfig, load_config
from diff_jax.transformer import (LAYERS, DecoderLM, in_layout, in_layout_placed, layer_lambdas,
                                  stacked_layers, unstacked_layers)

L = 3
TOKENS = jax.random.randint(jax.random.key(1), (2, 12), 0, 96)


def _configs(variant: str, *extra: str) -> tuple[ModelConfig, ModelConfig]:
    """(unrolled, scanned) configs of one small model."""
    unrolled = load_config(None, [f"model.num_layers={L}", "model.embed_dim=64",
                                  "model.vocab_size=96", "model.num_heads=2",
                                  f"model.variant={variant}", *extra]).model
    return unrolled, dataclasses.replace(unrolled, scan_layers=True)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _tree_rel(a, b) -> float:
    num = sum(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2)
              for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    return float(np.sqrt(num / sum(np.sum(np.asarray(y, np.float64) ** 2)
                                   for y in jax.tree.leaves(b))))


@pytest.mark.parametrize("variant,remat", [("diff", "none"), ("diff_v2", "none"),
                                           ("transformer", "none"), ("diff", "full")])
def test_the_scanned_model_computes_the_unrolled_one(variant, remat):
    unrolled, scanned = _configs(variant, f"model.remat={remat}")
    params = nn.meta.unbox(DecoderLM(unrolled).init(jax.random.key(0), TOKENS)["params"])
    stacked = stacked_layers(params, L)
    assert set(stacked) == {"embed", LAYERS, "norm"}
    assert unstacked_layers(stacked, L).keys() == params.keys()
    assert _tree_rel(unstacked_layers(stacked, L), params) == 0.0
    # another layer count is one error, not a model silently short of layers
    with pytest.raises(ValueError, match=rf"holds \[{L}\] layers, expected {L - 1}"):
        unstacked_layers(stacked, L - 1)
    with pytest.raises(ValueError, match=rf"holds {L} layers named .* expected layers_0 \.\.\. "
                                         rf"layers_{L}"):
        stacked_layers(params, L + 1)
    with pytest.raises(ValueError, match=rf"holds {L} layers named"):
        stacked_layers(params, L - 1)

    assert _rel(DecoderLM(scanned).apply({"params": stacked}, TOKENS),
                DecoderLM(unrolled).apply({"params": params}, TOKENS)) < 1e-6

    def loss(config):
        return lambda p: DecoderLM(config).apply({"params": p}, TOKENS, targets=TOKENS).mean()

    grads = jax.grad(loss(unrolled))(params)
    scanned_grads = jax.grad(loss(scanned))(stacked)
    assert _tree_rel(unstacked_layers(scanned_grads, L), grads) < 1e-6
    if variant == "diff":  # λ per layer, from the traced depth's λ_init
        np.testing.assert_allclose(layer_lambdas(stacked, scanned), layer_lambdas(params, unrolled),
                                   rtol=1e-6)


def test_scanned_parameters_are_stacked_on_a_logical_layers_axis():
    """Init draws every layer afresh (not one layer L times), on a `layers` axis that the rule
    table leaves unsplit; the parameter count is the unrolled model's."""
    unrolled, scanned = _configs("diff")
    boxed = DecoderLM(scanned).init(jax.random.key(0), TOKENS)["params"]
    wq = boxed[LAYERS]["attn"]["q_proj"]["kernel"]
    assert wq.names == ("layers", "embed", "heads") and wq.value.shape == (L, 64, 64)
    assert not np.allclose(wq.value[0], wq.value[1])
    count = sum(x.size for x in jax.tree.leaves(nn.meta.unbox(boxed)))
    assert count == sum(x.size for x in jax.tree.leaves(
        nn.meta.unbox(DecoderLM(unrolled).init(jax.random.key(0), TOKENS)["params"])))
    assert ("layers", None) in load_config(None).mesh.rules


def test_scanned_decoding_generates_what_the_unrolled_model_does():
    from diff_jax.generate import generate

    unrolled, scanned = _configs("diff")
    params = nn.meta.unbox(DecoderLM(unrolled).init(jax.random.key(0), TOKENS)["params"])
    prompts = [[5, 9, 2], [7, 1]]
    assert generate(scanned, stacked_layers(params, L), prompts, max_new_tokens=5) == generate(
        unrolled, params, prompts, max_new_tokens=5)


def test_the_analyses_read_the_scanned_layers_one_by_one():
    """The attention-share analysis (Table 3's measure) reads per-layer attention maps that the
    scan sows stacked."""
    from diff_jax.evaluation.analysis import span_shares

    unrolled, scanned = _configs("diff")
    params = nn.meta.unbox(DecoderLM(unrolled).init(jax.random.key(0), TOKENS)["params"])
    spans = jnp.asarray([2, 4, 8, 9, 12])
    want = span_shares(unrolled, params, TOKENS, spans)
    assert want.shape == (L, 2)
    np.testing.assert_allclose(span_shares(scanned, stacked_layers(params, L), TOKENS, spans),
                               want, rtol=1e-5)


def test_a_scanned_run_is_read_in_either_layout(tmp_path):
    """Train 2 steps scanned; its checkpoint loads (diff_jax.export.load), exports in the
    reference layout and as orbax parameters, evaluates with model.scan_layers=false, and gives an
    unrolled run its parameters through train.init_from (and a scanned run an unrolled export's,
    both on a mesh of 8 devices), each computing the same logits."""
    from jax.sharding import NamedSharding, PartitionSpec

    from diff_jax import export as ex
    from diff_jax import train_loop
    from diff_jax.config import MeshConfig
    from diff_jax.evaluation.loading import load
    from diff_jax.evaluation.options import EvalOptions
    from diff_jax.export.init_from import initial_params
    from diff_jax.export.sources import Source, abstract_params
    from diff_jax.sharding import make_mesh
    from training_fixtures import tiny_config, write_corpus

    corpus = write_corpus(tmp_path / "corpus")
    run = tmp_path / "scanned"
    train_loop.run(tiny_config(corpus, run, "train.steps=2", "checkpoint.every_steps=2",
                               "model.scan_layers=true"))
    config, params = ex.load(run)
    assert config.scan_layers and LAYERS in params
    tokens = TOKENS % 64
    want = DecoderLM(config).apply({"params": params}, tokens)
    flat = dataclasses.replace(config, scan_layers=False)

    def logits(config: ModelConfig, params) -> jax.Array:
        return DecoderLM(config).apply({"params": params}, tokens)

    reference = ex.export(run, tmp_path / "st", "safetensors")
    _, read = ex.load(reference)  # the reference layout, read for the export's config
    assert _rel(logits(config, in_layout(read, config)), want) == 0.0
    orbax = ex.export(run, tmp_path / "orbax", "orbax-params")
    assert _rel(logits(*ex.load(orbax)), want) == 0.0

    for options, named in ((EvalOptions(task="ppl"), [f"train.run_dir={run}"]),
                           (EvalOptions(task="ppl", checkpoint=str(orbax)), []),
                           (EvalOptions(task="ppl", checkpoint=str(reference)), [])):
        location = options.checkpoint or named[0]
        loaded = load(options, [*named, "model.scan_layers=false"])
        assert not loaded.config.model.scan_layers and "layers_0" in loaded.params, location
        assert _rel(logits(flat, loaded.params), want) < 1e-6, location

    # an unrolled run's parameters from the scanned run, and a scanned run's from an unrolled
    # export, each placed under a training mesh of 8 devices as train.py places them
    unrolled_export = ex.export(Source(flat, in_layout(params, flat), str(run), 2), tmp_path / "u",
                                "orbax-params")
    mesh = make_mesh(MeshConfig(data=8))
    for model, path in ((flat, run), (config, unrolled_export)):
        target = abstract_params(model)
        with jax.set_mesh(mesh):
            started = initial_params(path, model, jax.tree.map(
                lambda _: NamedSharding(mesh, PartitionSpec()), target))
        assert jax.tree.map(np.shape, started) == jax.tree.map(np.shape, target), path
        assert _rel(logits(model, started), want) < 1e-6, path  # the same parameters



def test_in_layout_placed_moves_a_sharded_state_one_parameter_at_a_time():
    """A train state's parameters and AdamW moments, sharded on an fsdp × tensor mesh, stacked
    and sliced again on the devices: the values are `in_layout`'s, each leaf is on the sharding
    asked for, and every source array converted is deleted (so the peak holds one parameter's
    layers twice, not the state); leaves outside the layers stay as they were."""
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from diff_jax.config import MeshConfig
    from diff_jax.sharding import make_mesh

    unrolled, scanned = _configs("diff")
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    params = nn.meta.unbox(DecoderLM(unrolled).init(jax.random.key(0), TOKENS)["params"])
    state = {"params": params, "opt": optax.adam(1e-3).init(params), "step": jnp.int32(7)}
    state = jax.tree.map(lambda a: a + 0, state)  # moments that are not all zeros
    state["opt"] = jax.tree.map(lambda a: a + 1 if a.ndim else a, state["opt"])

    def fsdp(a):  # the first axis that fsdp divides, else replicated
        axes = [None] * np.ndim(a)
        for i, n in enumerate(np.shape(a)):
            if n % 2 == 0:
                axes[i] = "fsdp"
                break
        return NamedSharding(mesh, P(*axes))

    placed = jax.tree.map(lambda a: jax.device_put(a, fsdp(a)), state)
    host = jax.tree.map(np.asarray, state)
    for config in (scanned, unrolled):
        want = in_layout(host, config)
        shardings = jax.tree.map(fsdp, want)
        sources = jax.tree.leaves(placed)
        moved = in_layout_placed(placed, config, shardings)
        assert jax.tree.structure(moved) == jax.tree.structure(want)
        assert _tree_rel(moved, want) == 0.0
        for got, sharding in zip(jax.tree.leaves(moved), jax.tree.leaves(shardings), strict=True):
            assert got.sharding == sharding
        layered = [a for a in sources if not any(a is b for b in jax.tree.leaves(moved))]
        assert layered and all(a.is_deleted() for a in layered)
        assert moved["step"] is placed["step"]
        assert moved["params"]["embed"] is placed["params"]["embed"]
        placed = moved
    with pytest.raises(ValueError, match="expected layers_0"):
        in_layout_placed(placed, dataclasses.replace(scanned, num_layers=L + 1), shardings)
    assert not any(a.is_deleted() for a in jax.tree.leaves(placed))


def test_a_run_resumes_in_the_other_layout_as_if_it_had_not_changed(tmp_path, capsys):
    """An unrolled run of 6 steps on a data × fsdp × tensor mesh (8 devices, the parameters and
    AdamW's moments sharded); the same run resumed from step 2 with its layers scanned, then
    from that run's step 4 unrolled again: each resumed step's loss and gradient norm are the
    uninterrupted run's within 1e-5 (the two layouts compute the same function to float32
    rounding), and so are the final parameters. Each switch is one note."""
    import shutil

    from diff_jax import train_loop
    from diff_jax.export import load
    from training_fixtures import tiny_config, write_corpus

    corpus = write_corpus(tmp_path / "corpus")
    mesh = ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.steps=6",
            "checkpoint.every_steps=2")

    def metrics(run):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: [r["loss"], r["grad_norm"], *r["lambda"]] for r in rows if "loss" in r}

    full = tmp_path / "full"
    train_loop.run(tiny_config(corpus, full, *mesh))
    capsys.readouterr()
    scanned = tmp_path / "scanned"
    shutil.copytree(full, scanned)
    train_loop.run(tiny_config(corpus, scanned, *mesh, "model.scan_layers=true",
                               "checkpoint.resume_step=2", "checkpoint.discard_later=true"))
    assert ("resumed with model.scan_layers=true, where step 2 was saved with false: its "
            "parameters and optimizer state were stacked for the scan") in capsys.readouterr().err
    back = tmp_path / "back"
    shutil.copytree(scanned, back)
    train_loop.run(tiny_config(corpus, back, *mesh, "checkpoint.resume_step=4",
                               "checkpoint.discard_later=true"))
    assert ("resumed with model.scan_layers=false, where step 4 was saved with true: its "
            "parameters and optimizer state were sliced into one per layer"
            ) in capsys.readouterr().err

    want = metrics(full)
    for run, steps in ((scanned, (3, 4, 5, 6)), (back, (5, 6))):
        got = metrics(run)
        for step in steps:
            np.testing.assert_allclose(got[step], want[step], rtol=1e-5,
                                       err_msg=f"{run.name}@{step}")
    config, params = load(full)
    for run in (scanned, back):
        other, theirs = load(run)
        assert other.scan_layers == (run is scanned)
        assert _tree_rel(in_layout(theirs, config), params) < 1e-5, run.name


def test_a_conversion_out_of_device_memory_names_the_layout_it_was_saved_in(tmp_path,
                                                                            monkeypatch):
    """Out of device memory while a resume stacks an unrolled step for the scan: one
    `DeviceMemoryError` whose advice is the saved layout (not the train step's batch size), and
    the step stays on disk: the run resumes from it in the layout it was saved in."""
    from diff_jax import checkpoint, train_loop
    from diff_jax.device_memory import DeviceMemoryError
    from training_fixtures import tiny_config, write_corpus, xla_out_of_memory

    corpus, run = write_corpus(tmp_path / "corpus"), tmp_path / "run"
    train_loop.run(tiny_config(corpus, run, "train.steps=2", "checkpoint.every_steps=2"))

    def no_room(*args, **kwargs):
        raise xla_out_of_memory()

    monkeypatch.setattr(checkpoint, "in_layout_placed", no_room)
    with pytest.raises(DeviceMemoryError) as failed:
        train_loop.run(tiny_config(corpus, run, "train.steps=3", "checkpoint.every_steps=2",
                                   "model.scan_layers=true"))
    message = str(failed.value)
    assert message.startswith("out of device memory (RESOURCE_EXHAUSTED: Out of memory")
    assert ("converting checkpoint step 2 from model.scan_layers=false to true" in message
            and "resume with model.scan_layers=false (the layout it was saved in)" in message)
    assert "train.batch_size" not in message
    monkeypatch.undo()
    train_loop.run(tiny_config(corpus, run, "train.steps=3", "checkpoint.every_steps=2"))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r][-1] == 3


def test_the_scanned_train_step_shards_each_layer_as_the_unrolled_one():
    """On a data × fsdp × tensor mesh (8 devices) the stacked parameters keep each layer's
    sharding, their `layers` axis unsplit; the sharded loss equals the unrolled model's on the
    same parameters, and a train step reports λ per layer."""
    from jax.sharding import PartitionSpec as P

    from diff_jax.config import Config, MeshConfig, OptimConfig, TrainConfig
    from diff_jax.sharding import make_mesh
    from diff_jax.step import build_steps

    unrolled, scanned = _configs("diff")
    mesh_cfg = MeshConfig(data=2, fsdp=2, tensor=2)
    mesh = make_mesh(mesh_cfg)

    def built(model: ModelConfig):
        return build_steps(Config(model=model, optim=OptimConfig(warmup_steps=0), mesh=mesh_cfg,
                                  train=TrainConfig(steps=4, batch_size=4, seq_len=12)), mesh)

    flat, stack = built(unrolled), built(scanned)
    specs = stack.shardings.params
    assert specs[LAYERS]["attn"]["q_proj"]["kernel"].spec == P(None, "fsdp", "tensor")
    assert flat.shardings.params["layers_0"]["attn"]["q_proj"]["kernel"].spec == P("fsdp", "tensor")
    tokens = np.asarray(jax.random.randint(jax.random.key(2), (4, 12), 0, 96))
    batch = {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1),
             "segment_ids": np.ones_like(tokens), "positions": np.tile(np.arange(12), (4, 1))}
    with flat.context():
        params = jax.device_get(flat.init(jax.random.key(0)).params)
        want = float(flat.eval(params, jax.device_put(batch, flat.batch_sharding)))
    with stack.context():
        stacked = jax.device_put(stacked_layers(params, L), specs)
        sharded = jax.device_put(batch, stack.batch_sharding)
        assert abs(float(stack.eval(stacked, sharded)) - want) < 1e-6 * abs(want)
        _, metrics = stack.train(stack.init(jax.random.key(0)), sharded)
    assert np.shape(metrics["lambda"]) == (L,) and np.isfinite(float(metrics["loss"]))
