"""Mesh, sharding rules and the sharded train step on 8 fake CPU devices."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from diff_jax.config import Config, MeshConfig, ModelConfig, OptimConfig, TrainConfig
from diff_jax.optim import decay_mask, make_optimizer, schedule
from diff_jax.sharding import (ShardingError, batch_sharding, check_batch, check_divisible,
                               check_process_rows, make_mesh, mesh_shape, num_slices, slice_devices)
from diff_jax.step import build_steps, eval_step, loss_and_grads, loss_fn, state_shardings
from diff_jax.transformer import DecoderLM

MODEL = ModelConfig(vocab_size=64, embed_dim=32, num_layers=2, num_heads=2, max_seq_len=64)
RULES = MeshConfig().rules


def _batch(b=8, t=16, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 64, (b, t + 1)).astype(np.int32)
    seg = np.cumsum(rng.random((b, t)) < 0.1, axis=1).astype(np.int32) + 1
    first = np.maximum.accumulate(np.where(np.r_[[True] * b][:, None] & (np.diff(seg, prepend=0, axis=1) != 0),
                                           np.arange(t), 0), axis=1)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg,
            "positions": (np.arange(t) - first).astype(np.int32)}


def _masked(batch, seed=1):
    """`batch` with a loss mask whose counts differ between rows (and so between micro-batches)."""
    rng = np.random.default_rng(seed)
    t = batch["targets"].shape[1]
    keep = rng.random(batch["targets"].shape) < np.linspace(0.1, 0.9, len(batch["targets"]))[:, None]
    keep[0, : t // 2] = True  # every row counts something
    return dict(batch, loss_mask=keep.astype(np.int32))


@functools.cache
def _built(mesh_cfg, one_device=False, grad_accum=1, model=MODEL):
    """The training loop's steps (`build_steps`) of `model` on `mesh_cfg` (all 8 devices, or
    the first alone) and its jitted loss and grads, built once for the module: the tests that
    compare a mesh or a grad_accum with another share what each one compiles."""
    config = Config(model=model, optim=OptimConfig(warmup_steps=0), mesh=mesh_cfg,
                    train=TrainConfig(steps=10, batch_size=8, seq_len=16, grad_accum=grad_accum))
    built = build_steps(config, make_mesh(mesh_cfg, jax.devices()[:1] if one_device else None))
    grads = jax.jit(functools.partial(loss_and_grads, model=built.model, grad_accum=grad_accum),
                    in_shardings=(built.shardings.params, built.batch_sharding))
    return built, grads


def _sharded(mesh_cfg, one_device=False, grad_accum=1, steps=1, batch=None, model=MODEL):
    """(state after `steps` train steps, loss, grads of the initial params, metrics: None
    without steps) on a mesh, with the training loop's steps (`_built`), from a fresh init."""
    built, loss_and_grads_fn = _built(mesh_cfg, one_device, grad_accum, model)
    metrics = None
    with built.context():
        state = built.init(jax.random.PRNGKey(0))
        batch = jax.device_put(_batch() if batch is None else batch, built.batch_sharding)
        loss, grads = loss_and_grads_fn(state.params, batch)
        for _ in range(steps):
            state, metrics = built.train(state, batch)
    return state, float(loss), jax.device_get(grads), jax.device_get(metrics)


def test_mesh_shape_resolves_the_rest_and_reports_mismatch():
    assert mesh_shape(MeshConfig(data=-1, fsdp=2, tensor=2), 8) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert mesh_shape(MeshConfig(data=1, fsdp=-1, tensor=1), 8)["fsdp"] == 8
    with pytest.raises(ShardingError, match="needs 12 devices, but 8"):
        mesh_shape(MeshConfig(data=3, fsdp=2, tensor=2), 8)
    with pytest.raises(ShardingError, match="mesh.data=-1: 8 devices are not divisible by"):
        mesh_shape(MeshConfig(data=-1, fsdp=3, tensor=1), 8)


@dataclasses.dataclass(frozen=True)
class _SliceDevice:
    """A stand-in for a TPU device of a multi-slice job: what the layout reads of one."""

    id: int
    slice_index: int
    platform: str = "cpu"  # no TPU coordinates: one slice is laid out in device order
    device_kind: str = "cpu"


@pytest.mark.parametrize("slices,sizes", [(2, (2, 4, 1)), (2, (4, 2, 1)), (2, (2, 2, 2)),
                                          (2, (8, 1, 1)), (4, (4, 1, 2)), (4, (8, 2, 1))])
def test_a_multi_slice_mesh_crosses_slices_on_the_data_axis_only(slices, sizes):
    """Slice s holds the data rows [s·D/S, (s+1)·D/S) with all of fsdp and tensor: every fsdp
    and tensor group lies in one slice, and each device stands in the mesh once. The devices
    come in no particular order."""
    n = int(np.prod(sizes))
    devices = [_SliceDevice(i, i // (n // slices)) for i in range(n)][::-1]
    assert num_slices(devices) == slices
    grid = slice_devices(MeshConfig(*sizes), devices)
    assert grid.shape == sizes
    assert sorted(d.id for d in grid.flat) == list(range(n))
    per_slice = sizes[0] // slices
    for row in range(sizes[0]):
        assert {d.slice_index for d in grid[row].flat} == {row // per_slice}


def test_a_multi_slice_mesh_that_would_cross_slices_elsewhere_is_refused():
    devices = [_SliceDevice(i, i // 4) for i in range(8)]
    with pytest.raises(ShardingError, match=r"^mesh.data=1: the devices span 2 TPU slices of 4 "
                                            r"devices, and only the data axis crosses slices: "
                                            r"mesh.data must be a multiple of 2 \(mesh.fsdp × "
                                            r"mesh.tensor = 8 must divide 4\)$"):
        slice_devices(MeshConfig(data=1, fsdp=8), devices)
    uneven = [_SliceDevice(i, int(i >= 5)) for i in range(8)]
    with pytest.raises(ShardingError, match=r"2 TPU slices of unequal sizes \(\{0: 5, 1: 3\} "):
        slice_devices(MeshConfig(data=-1), uneven)
    assert num_slices(jax.devices()) == 1  # CPU devices have no slice_index
    assert make_mesh(MeshConfig(data=2, fsdp=4)).devices.shape == (2, 4, 1)


def test_divisibility_is_checked_before_compiling_naming_dimension_and_axis():
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=8))
    model = DecoderLM(ModelConfig(vocab_size=100, embed_dim=32, num_layers=1, num_heads=2))
    with pytest.raises(ShardingError, match=r"\['embed'\]: dimension 0 \('vocab', size 100\) is "
                                            r"not divisible by mesh axes 'tensor' \(size 8\)"):
        state_shardings(model, make_optimizer(OptimConfig(), 10), mesh, RULES)
    with pytest.raises(ShardingError, match=r"micro-batch is not divisible by the batch mesh axes"):
        check_batch(12, 2, make_mesh(MeshConfig(data=4, fsdp=2, tensor=1)), RULES)
    # a micro-batch is batch_size / grad_accum rows, over every axis of the batch rule (2 · 4)
    mesh = make_mesh(MeshConfig(data=2, fsdp=4, tensor=1))
    check_batch(16, 2, mesh, RULES)
    with pytest.raises(ShardingError, match=r"= 4 sequences a micro-batch is not divisible by the "
                                            r"batch mesh axes \('data', 'fsdp'\) \(size 8\)"):
        check_batch(16, 4, mesh, RULES)


def test_every_dimension_is_checked_and_a_replicated_one_may_have_any_size():
    """Not only a leaf's first dimension: (8, 6) with `mlp` on tensor 4 is refused naming
    dimension 1; a dimension no rule shards (`norm`, `head_dim`) divides nothing, odd or not."""
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=4))
    box = nn.LogicallyPartitioned
    check_divisible({"n": box(jax.ShapeDtypeStruct((7, 3), jnp.float32), ("norm", "head_dim"))},
                    mesh, RULES, "parameter")
    with pytest.raises(ShardingError, match=r"^parameter \['w'\]: dimension 1 \('mlp', size 6\) is "
                                            r"not divisible by mesh axes 'tensor' \(size 4\)"):
        check_divisible({"w": box(jax.ShapeDtypeStruct((8, 6), jnp.float32), ("embed", "mlp"))},
                        mesh, RULES, "parameter")


def test_the_default_rules_shard_parameters_as_documented():
    """docs/training.md: `embed` on fsdp; `heads`, `kv_heads`, `mlp`, `vocab` on tensor; the
    stacked `layers` axis of `model.scan_layers` unsplit, each layer sharded as unrolled."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    tx = make_optimizer(OptimConfig(), 10)
    model = dataclasses.replace(MODEL, num_kv_heads=2)
    for scan, layer in ((False, "layers_0"), (True, "layers")):
        _, shardings = state_shardings(DecoderLM(dataclasses.replace(model, scan_layers=scan)), tx,
                                       mesh, RULES)
        lead = (None,) if scan else ()  # the layers axis
        attn, ffn = shardings.params[layer]["attn"], shardings.params[layer]["ffn"]
        for proj in ("q_proj", "k_proj", "v_proj"):
            assert attn[proj]["kernel"].spec == P(*lead, "fsdp", "tensor"), proj
        assert attn["out_proj"]["kernel"].spec == P(*lead, "tensor", "fsdp")
        assert ffn["w_up"]["kernel"].spec == P(*lead, "fsdp", "tensor")
        # a vector of each layer (a norm's scale, λ's) whole on every device, stacked or not
        assert shardings.params[layer]["attn_norm"]["scale"].is_fully_replicated
        assert attn["lambda_q1"].is_fully_replicated
        assert shardings.params["embed"].spec == P("tensor", "fsdp")


def test_batch_arrays_are_split_by_the_batch_rule_and_whole_along_the_length():
    mesh = make_mesh(MeshConfig(data=2, fsdp=4, tensor=1))
    sharding = batch_sharding(mesh, RULES)
    assert sharding.spec == P(("data", "fsdp"), None)
    shards = jax.device_put(np.zeros((16, 5), np.int32), sharding).addressable_shards
    assert {s.data.shape for s in shards} == {(2, 5)}  # 16 rows over 2·4 devices
    assert batch_sharding(mesh, (("batch", "fsdp"),)).spec == P("fsdp", None)
    assert batch_sharding(mesh, (("embed", "fsdp"),)).spec == P(None, None)  # no rule: replicated


def test_make_mesh_over_given_devices_keeps_them_and_their_order():
    devices = jax.devices()[4:][::-1]
    mesh = make_mesh(MeshConfig(data=2, fsdp=2), devices)
    assert [d.id for d in mesh.devices.flat] == [d.id for d in devices]


class _FirstHalfOfTheDevices:
    """A sharding as process 0 of 2 sees it: its addressable devices are devices 0-3."""

    def __init__(self, sharding):
        self.sharding = sharding

    def addressable_devices_indices_map(self, shape):
        return {d: i for d, i in self.sharding.devices_indices_map(shape).items() if d.id < 4}


def test_each_process_must_hold_its_own_share_of_the_batch_rows(monkeypatch):
    """`check_process_rows`: a process's devices hold B/P distinct rows. In one process every
    batch sharding holds all 16 rows (split or replicated); as process 0 of 2 on devices 0-3,
    the batch over data × fsdp gives it rows [0, 8), but over fsdp alone the data axis, which
    spans the processes, leaves it all 16."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=4), jax.devices())
    for rules in (RULES, (("batch", None),)):
        check_process_rows(batch_sharding(mesh, rules), 16, 5)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    check_process_rows(_FirstHalfOfTheDevices(batch_sharding(mesh, RULES)), 16, 5)
    with pytest.raises(ShardingError, match=r"^this process's devices hold 16 of the 16 batch rows, "
                                            r"not 8: a mesh axis outside the `batch` rule spans "
                                            r"processes"):
        check_process_rows(_FirstHalfOfTheDevices(batch_sharding(mesh, (("batch", "fsdp"),))), 16, 5)


def test_two_logical_axes_of_one_array_on_one_mesh_axis_are_checked_as_flax_shards_them():
    # the rule listed first takes `tensor`; the other dimension stays whole, so its size need
    # not divide (vocab 100 on tensor 8 was refused although nothing shards it)
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=8))
    model = DecoderLM(ModelConfig(vocab_size=100, embed_dim=32, num_layers=1, num_heads=2))
    tx = make_optimizer(OptimConfig(), 10)
    rules = (("batch", ("data", "fsdp")), ("embed", "tensor"), ("vocab", "tensor"))
    _, shardings = state_shardings(model, tx, mesh, rules)
    assert shardings.params["embed"].spec == P(None, "tensor")
    with pytest.raises(ShardingError, match=r"\['embed'\]: dimension 0 \('vocab', size 100\)"):
        state_shardings(model, tx, mesh, (rules[0], rules[2], rules[1]))  # vocab first: sharded


def test_a_mesh_with_explicit_or_other_axes_is_refused_before_tracing():
    config = Config(model=MODEL, mesh=MeshConfig(data=2, fsdp=2, tensor=2),
                    train=TrainConfig(steps=10, batch_size=8, seq_len=16))
    with pytest.raises(ShardingError, match=r"mesh axis types \{'data': 'Explicit', 'fsdp': 'Auto', "
                                            r"'tensor': 'Explicit'\}: the model needs Auto axes"):
        Ex, Au = jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto
        build_steps(config, jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"),
                                          axis_types=(Ex, Au, Ex)))
    with pytest.raises(ShardingError, match=r"mesh axes \('x', 'fsdp', 'tensor'\) lack \['data'\]"):
        build_steps(config, jax.make_mesh((2, 2, 2), ("x", "fsdp", "tensor"),
                                          axis_types=(jax.sharding.AxisType.Auto,) * 3))


def test_the_sections_a_builder_takes_are_named_when_another_object_is_given():
    """`build_steps(config.model, mesh)`, `build_steps(config, None)` and `make_mesh(config)`
    failed in AttributeErrors on the first field they read."""
    config = Config(model=MODEL, train=TrainConfig(steps=10, batch_size=8, seq_len=16))
    mesh = make_mesh(config.mesh)
    with pytest.raises(TypeError, match=r"^build_steps takes the whole run Config .* got ModelConfig$"):
        build_steps(config.model, mesh)
    with pytest.raises(TypeError, match=r"^build_steps takes a jax Mesh \(diff_jax\.sharding\."
                                        r"make_mesh\(config\.mesh\)\), got NoneType$"):
        build_steps(config, None)
    with pytest.raises(TypeError, match=r"^make_mesh takes a MeshConfig \(a Config's \.mesh\), "
                                        r"got Config$"):
        make_mesh(config)


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_a_batch_without_a_key_or_with_an_unknown_one_is_one_error_listing_a_batchs_keys(grad_accum):
    """A batch without "positions" was a bare KeyError('positions') from inside the traced loss;
    a misspelt "segment_id" was ignored (documents attended to one another). train and eval say
    which keys are missing or unknown and the keys a batch holds."""
    built, _ = _built(MeshConfig(data=1, fsdp=1, tensor=1), True, grad_accum)
    holds = (r": a batch holds tokens, targets, positions and optionally segment_ids, loss_mask, "
             r"each \(B, T\), integers but loss_mask.s weights")
    batch = _batch()
    with built.context():
        state = built.init(jax.random.PRNGKey(0))
        no_positions = {k: x for k, x in batch.items() if k != "positions"}
        with pytest.raises(ValueError, match=r"^the batch lacks positions" + holds):
            built.train(state, no_positions)
        with pytest.raises(ValueError, match=r"^the batch lacks tokens, positions" + holds):
            built.eval(state.params, {"targets": batch["targets"]})
        misspelt = dict(batch, segment_id=batch.pop("segment_ids"))
        with pytest.raises(ValueError, match=r"^the batch has unknown segment_id" + holds):
            built.eval(state.params, misspelt)
        with pytest.raises(TypeError, match=r"^the batch must be a dict of \(B, T\) arrays, "
                                            r"got tuple"):
            built.eval(state.params, tuple(batch.values()))


def _with(key, change):
    """A masked batch (8, 16) with its `key` replaced by `change` of it."""
    batch = _masked(_batch())
    return dict(batch, **{key: change(batch[key])})


_OF_TOKENS = r"of the tokens' shape \(B, T\) = \(8, 16\), got "


@pytest.mark.parametrize("grad_accum", [1, 2])
@pytest.mark.parametrize("batch, says", [
    (_with("positions", lambda x: x[:, :-1]),
     r"^the batch's positions must be integers " + _OF_TOKENS + r"int32 of shape \(8, 15\)"),
    (_with("targets", lambda x: np.pad(x, ((0, 0), (0, 1)))),
     r"^the batch's targets must be integers " + _OF_TOKENS + r"int32 of shape \(8, 17\)"),
    (_with("targets", lambda x: x.astype(np.float32)),
     r"^the batch's targets must be integers " + _OF_TOKENS + r"float32 of shape \(8, 16\)"),
    (_with("segment_ids", lambda x: x[:4]),
     r"^the batch's segment_ids must be integers " + _OF_TOKENS + r"int32 of shape \(4, 16\)"),
    (_with("loss_mask", lambda x: x[:, :-1]),
     r"^the batch's loss_mask must be an array " + _OF_TOKENS + r"int32 of shape \(8, 15\)"),
    (_with("loss_mask", lambda x: x[:, :1]),
     r"^the batch's loss_mask must be an array " + _OF_TOKENS + r"int32 of shape \(8, 1\)"),
    (_with("positions", lambda x: None),
     r"^the batch's positions must be integers " + _OF_TOKENS + r"NoneType"),
    (_with("tokens", lambda x: x[..., None]),
     r"^the batch's tokens must be \(B, T\) integer ids, got int32 of shape \(8, 16, 1\)"),
    (_with("tokens", lambda x: x.astype(np.float32)),
     r"^the batch's tokens must be \(B, T\) integer ids, got float32 of shape \(8, 16\)")],
    ids=["positions_short", "targets_long", "targets_float", "segment_ids_rows",
         "loss_mask_short", "loss_mask_one_column", "positions_none", "tokens_rank3",
         "tokens_float"])
def test_a_batch_value_not_of_the_tokens_shape_or_not_integers_is_one_error_naming_its_key(
        grad_accum, batch, says):
    """A (B, 1) loss mask broadcast over the positions (the count was its B entries, the sum took
    every target of the rows they count); one of another T was a bare "mul got incompatible
    shapes"; positions None ran the default 0..T-1 across packed documents; the model's errors
    named the micro-batch's rows, not the batch's (B/grad_accum, or a (2, 16) slice of a (4, 16)
    segment_ids). train and eval name the batch's key, its dtype and shape and the tokens'
    (B, T), as they trace."""
    built, _ = _built(MeshConfig(data=1, fsdp=1, tensor=1), True, grad_accum)
    with built.context():
        state = built.init(jax.random.PRNGKey(0))
        with pytest.raises(ValueError, match=says):
            built.eval(state.params, batch)
        with pytest.raises(ValueError, match=says):
            built.train(state, batch)


def test_a_loss_mask_of_bools_or_floats_weighs_the_targets_as_ones_and_zeros_do():
    """The batch check asks integers of the ids only: a bool or float 0/1 loss mask gives the
    int mask's loss, as before it."""
    built, _ = _built(MeshConfig(data=1, fsdp=1, tensor=1), True)
    batch = _masked(_batch())
    with built.context():
        params = built.init(jax.random.PRNGKey(0)).params
        want = float(built.eval(params, batch))
        for dtype in (bool, np.float32):
            mask = batch["loss_mask"].astype(dtype)
            assert float(built.eval(params, dict(batch, loss_mask=mask))) == want, dtype


def test_a_rank_1_tokens_given_to_the_loss_is_one_error_naming_the_key():
    """Called without the steps' batch sharding (which refuses a value of rank < 2 itself,
    naming its key path batch['tokens']), `loss_and_grads` names tokens and (B, T)."""
    model = DecoderLM(MODEL)
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.PRNGKey(3),
                                               jnp.zeros((1, 1), jnp.int32)))["params"]
    batch = _with("tokens", lambda x: x[0])
    with pytest.raises(ValueError, match=r"^the batch's tokens must be \(B, T\) integer ids, got "
                                         r"int32 of shape \(16,\)"):
        jax.jit(functools.partial(loss_and_grads, model=model, grad_accum=1))(params, batch)


@pytest.mark.parametrize("step", ["train", "eval"])
def test_a_batch_that_grad_accum_does_not_divide_is_one_error(step):
    """A caller's batch of 6 rows with grad_accum 4 was a bare reshape error from inside the
    micro-batch split; train and eval name the rows, the micro-batches and train.grad_accum."""
    model = DecoderLM(MODEL)
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.PRNGKey(3),
                                               jnp.zeros((1, 1), jnp.int32)))["params"]
    batch = {k: x[:6] for k, x in _batch().items()}
    run = (functools.partial(loss_and_grads, model=model, grad_accum=4) if step == "train" else
           functools.partial(eval_step, model=model, micro_batches=4))
    with pytest.raises(ValueError, match=r"^a batch of 6 rows does not split into 4 micro-batches "
                                         r"\(train\.grad_accum\) of equal rows; give a multiple "
                                         r"of it"):
        jax.jit(run)(params, batch)
    good = {k: x[:8] for k, x in _batch().items()}
    assert np.isfinite(jax.tree.leaves(jax.jit(run)(params, good))[0]).all()


def test_sharded_step_equals_one_device_and_params_are_sharded_by_the_rules():
    state1, loss1, grads1, m1 = _sharded(MeshConfig(data=1, fsdp=1, tensor=1), one_device=True)
    state8, loss8, grads8, m8 = _sharded(MeshConfig(data=2, fsdp=2, tensor=2))
    np.testing.assert_allclose(loss8, loss1, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7), grads8, grads1)
    np.testing.assert_allclose(m8["grad_norm"], m1["grad_norm"], rtol=1e-5)
    # after Adam's normalisation float32 rounding in the gradients shows up at ~1e-6 absolute
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
                 jax.device_get(state8.params), jax.device_get(state1.params))
    q = state8.params["layers_0"]["attn"]["q_proj"]["kernel"]  # (embed, heads) -> (fsdp, tensor)
    assert q.sharding.spec == P("fsdp", "tensor")
    assert q.addressable_shards[0].data.shape == (q.shape[0] // 2, q.shape[1] // 2)
    emb = state8.params["embed"]  # (vocab, embed) -> (tensor, fsdp)
    assert emb.sharding.spec == P("tensor", "fsdp")
    assert emb.addressable_shards[0].data.shape == (32, 16)
    down = state8.params["layers_1"]["ffn"]["w_down"]["kernel"]  # (mlp, embed)
    assert down.sharding.spec == P("tensor", "fsdp")
    mu = state8.opt_state[1][0].mu["layers_0"]["attn"]["q_proj"]["kernel"]  # Adam moments too
    assert mu.sharding.spec == P("fsdp", "tensor")
    norm = state8.params["norm"]["scale"]
    assert norm.sharding.is_fully_replicated


def test_grad_accumulation_equals_one_step_on_the_whole_batch():
    state1, loss1, grads1, _ = _sharded(MeshConfig(data=2, fsdp=2, tensor=2), steps=2)
    state2, loss2, grads2, _ = _sharded(MeshConfig(data=2, fsdp=2, tensor=2), grad_accum=2, steps=2)
    np.testing.assert_allclose(loss2, loss1, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7), grads2, grads1)
    # after Adam's normalisation float32 rounding in the gradients shows up at ~1e-6 absolute
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
                 jax.device_get(state2.params), jax.device_get(state1.params))


def test_grad_accumulation_with_a_loss_mask_equals_one_step_on_the_whole_batch():
    # micro-batches count different numbers of targets: each divides by the whole batch's count
    batch = _masked(_batch())
    mesh = MeshConfig(data=2, fsdp=2, tensor=2)
    _, loss1, grads1, _ = _sharded(mesh, batch=batch)
    _, loss2, grads2, _ = _sharded(mesh, grad_accum=2, batch=batch)
    counts = batch["loss_mask"].reshape(4, 2, -1).sum(axis=(0, 2))  # micro-batch i: rows j·2 + i
    assert counts[0] != counts[1]
    np.testing.assert_allclose(loss2, loss1, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7), grads2, grads1)


def test_a_chunked_loss_on_the_mesh_equals_the_whole_loss():
    """`model.loss_chunk` 5 of T = 16 (a padded last chunk), with the vocabulary projection on
    `tensor` and the rows on `data` × `fsdp`: the loss and gradients of the unchunked loss on
    the same mesh (which the test above holds to one device's; float32, as there)."""
    mesh = MeshConfig(data=2, fsdp=2, tensor=2)
    _, loss, grads, _ = _sharded(mesh, steps=0)
    _, chunked, chunked_grads, _ = _sharded(mesh, steps=0, model=dataclasses.replace(MODEL, loss_chunk=5))
    np.testing.assert_allclose(chunked, loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7), chunked_grads, grads)


def test_loss_is_the_mean_cross_entropy_over_the_masked_targets():
    model = DecoderLM(MODEL)
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.PRNGKey(3),
                                               jnp.zeros((1, 1), jnp.int32)))["params"]
    batch = _masked(_batch(b=4))
    logits = np.asarray(jax.jit(model.apply)({"params": params}, batch["tokens"],
                                             positions=batch["positions"],
                                             segment_ids=batch["segment_ids"]), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    nll = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    mask = batch["loss_mask"]
    loss = jax.jit(lambda p, b: loss_fn(p, b, model))  # one compile per batch structure
    # float32 logits and sums: ~1e-6 relative
    np.testing.assert_allclose(float(loss(params, batch)), (nll * mask).sum() / mask.sum(),
                               rtol=2e-6)
    unmasked = {k: v for k, v in batch.items() if k != "loss_mask"}
    np.testing.assert_allclose(float(loss(params, unmasked)), nll.mean(), rtol=2e-6)
    ones = dict(unmasked, loss_mask=np.ones_like(mask))
    assert float(loss(params, ones)) == pytest.approx(float(loss(params, unmasked)), rel=1e-7)


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_a_batch_whose_mask_counts_no_target_has_loss_and_gradients_zero_not_nan(grad_accum):
    """`target_count` is at least 1: a batch whose loss_mask counts nothing (every target a
    prompt's, in a corpus prepared with --prompt-field) adds nothing to the update; divided by
    a count of 0, its loss and gradients were NaN, and one such batch made every parameter NaN."""
    model = DecoderLM(MODEL)
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.PRNGKey(3),
                                               jnp.zeros((1, 1), jnp.int32)))["params"]
    batch = _batch(b=4)
    batch["loss_mask"] = np.zeros_like(batch["targets"])
    loss, grads = jax.jit(functools.partial(loss_and_grads, model=model, grad_accum=grad_accum))(
        params, batch)
    assert float(loss) == 0.0
    assert not any(np.any(np.asarray(g)) for g in jax.tree.leaves(grads))  # NaN counts as nonzero


def test_weight_decay_mask_exempts_norms_lambdas_and_embeddings():
    model = DecoderLM(MODEL)
    params = nn.meta.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0),
                                          jnp.zeros((1, 1), jnp.int32)))["params"]
    mask = decay_mask(params, OptimConfig())
    attn = mask["layers_0"]["attn"]
    assert attn["q_proj"]["kernel"] and mask["layers_0"]["ffn"]["w_up"]["kernel"]
    assert not mask["embed"] and not attn["lambda_q1"] and not attn["subln"]["scale"]
    assert not mask["norm"]["scale"]
    everything = decay_mask(params, OptimConfig(decay_norms_and_lambdas=True, decay_embeddings=True))
    assert all(jax.tree.leaves(everything))
    # DIFF V2's λ comes from a projection matrix, which decays like every other matrix
    v2 = DecoderLM(dataclasses.replace(MODEL, variant="diff_v2"))
    params = nn.meta.unbox(jax.eval_shape(v2.init, jax.random.PRNGKey(0),
                                          jnp.zeros((1, 1), jnp.int32)))["params"]
    assert decay_mask(params, OptimConfig())["layers_0"]["attn"]["lambda_proj"] == {"kernel": True}


def test_weight_decay_mask_is_the_same_for_scanned_layers():
    """A stacked leaf counts its dimensions without the `layers` axis: a vector (here a bias,
    which none of the models has, so that the rule and not the name decides) stays exempt, a
    matrix decays, and every parameter of a scanned model decays as its unrolled twin's."""
    tree = {"layers": {"b": {"bias": jnp.zeros((3, 8))}, "w": {"kernel": jnp.zeros((3, 8, 8))}},
            "layers_0": {"b": {"bias": jnp.zeros(8)}}, "head": jnp.zeros((8, 4))}
    mask = decay_mask(tree, OptimConfig())
    assert mask == {"layers": {"b": {"bias": False}, "w": {"kernel": True}},
                    "layers_0": {"b": {"bias": False}}, "head": True}
    for variant in ("diff", "diff_v2", "transformer"):
        masks = []
        for scan in (False, True):
            model = DecoderLM(dataclasses.replace(MODEL, variant=variant, scan_layers=scan))
            params = nn.meta.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0),
                                                  jnp.zeros((1, 1), jnp.int32)))["params"]
            masks.append(decay_mask(params, OptimConfig()))
        unrolled, scanned = masks
        last = f"layers_{MODEL.num_layers - 1}"
        assert scanned["layers"] == unrolled["layers_0"] == unrolled[last]
        assert {k: v for k, v in scanned.items() if k != "layers"} == {
            k: v for k, v in unrolled.items() if not k.startswith("layers_")}


def test_schedule_warmup_then_linear_decay_to_the_floor():
    lr = schedule(OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="linear"), 110)
    np.testing.assert_allclose([lr(0), lr(5), lr(10), lr(60), lr(110), lr(200)],
                               [0.0, 0.5, 1.0, 0.55, 0.1, 0.1], rtol=1e-6)
    cos = schedule(OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0, schedule="cosine"), 100)
    np.testing.assert_allclose([cos(0), cos(50), cos(100)], [1.0, 0.5, 0.0], atol=1e-6)


def test_evaluation_runs_in_the_training_micro_batches_and_gives_the_whole_batch_mean():
    # validation and the pre-save check evaluate a training-sized batch: with grad_accum they must
    # not hold the activations of the whole batch at once (the reason grad_accum was set)
    mesh_cfg = MeshConfig(data=2, fsdp=-1, tensor=1)
    batch, vocab = _masked(_batch(b=32)), 4096
    losses, temp = {}, {}
    for k in (1, 4):
        config = Config(model=dataclasses.replace(MODEL, vocab_size=vocab), mesh=mesh_cfg,
                        train=TrainConfig(steps=10, batch_size=32, seq_len=16, grad_accum=k))
        built = build_steps(config, make_mesh(mesh_cfg))
        with built.context():
            state = built.init(jax.random.PRNGKey(0))
            sharded = jax.device_put(batch, built.batch_sharding)
            losses[k] = float(built.eval(state.params, sharded))
            temp[k] = built.eval.lower(state.params, sharded).compile().memory_analysis().temp_size_in_bytes
    np.testing.assert_allclose(losses[4], losses[1], rtol=1e-6)  # float32 sums in another order
    # float32 logits per device (the batch is split over all 8): 4 micro-batches hold a quarter
    # of them at a time, so evaluation's temporary memory drops by most of 3/4 of that
    logits = 32 * 16 * vocab * 4 // 8
    assert temp[1] - temp[4] > logits / 2, temp
