"""The pure training and evaluation steps, the sharded train state they act on, and the one
builder that jits them.

`build_steps(config, mesh)` is the only place the sharded step is assembled (the training loop,
the compile-only path `diff_jax.aot`, the benchmarks and the tests use it): the abstract state and
its shardings from `jax.eval_shape`, the batch sharding, and `init`, `train` and `eval` jitted
with explicit in/out shardings, the state donated to `train`. Gradient accumulation runs inside
`train_step`: the global batch
(B, T) is split into `grad_accum` micro-batches of B/k rows (row j·k + i goes to micro-batch i,
so every device keeps its own rows), gradients are summed in float32 with `lax.scan`, and one
optimizer update follows. The loss is the mean cross-entropy over the batch's counted targets
(`loss_mask`); every micro-batch divides its sum by the whole batch's count, so the k micro-batches
add up to exactly the loss and gradient of one step on B.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from diff_jax import variants
from diff_jax.attention_op import AttentionOp
from diff_jax.config import Config, ModelConfig, OptimConfig
from diff_jax.kernels.reference import is_array, kind_of
from diff_jax.optim import make_optimizer, schedule
from diff_jax.sharding import (batch_sharding, check_batch, check_divisible, check_mesh,
                               tree_shardings, unboxed)
from diff_jax.transformer import DecoderLM, layer_lambdas

# tokens, targets, positions and (optional) segment_ids: (B, T) integers; loss_mask (optional):
# (B, T) weights, 1 for the targets that count in the loss (without it, all do). The data
# pipeline gives int32 and always segment_ids (packed documents); without them each row is one
# document (causal masking only).
Batch = dict[str, jax.Array]
BATCH_KEYS = ("tokens", "targets", "positions")
OPTIONAL_BATCH_KEYS = ("segment_ids", "loss_mask")


def check_batch_arrays(batch: Batch) -> None:
    """One error unless `batch` is a dict holding every key of `BATCH_KEYS` and no key outside
    them and `OPTIONAL_BATCH_KEYS` (a misspelt optional key would be ignored), listing the keys
    a batch holds; then one ValueError naming the first key whose value is not an array of the
    tokens' shape (B, T), or not integers (all but `loss_mask`, whose weights may be bools or
    floats), with its dtype and shape. An optional key holding None counts as left out. The
    steps check it as they trace, on the host."""
    holds = (f"a batch holds {', '.join(BATCH_KEYS)} and optionally "
             f"{', '.join(OPTIONAL_BATCH_KEYS)}, each (B, T), integers but loss_mask's weights")
    if not isinstance(batch, Mapping):
        raise TypeError(f"the batch must be a dict of (B, T) arrays, got {type(batch).__name__}: "
                        f"{holds}")
    missing = [k for k in BATCH_KEYS if k not in batch]
    unknown = sorted(set(batch) - {*BATCH_KEYS, *OPTIONAL_BATCH_KEYS})
    wrong = ([f"lacks {', '.join(missing)}"] if missing else []) + (
        [f"has unknown {', '.join(unknown)}"] if unknown else [])
    if wrong:
        raise ValueError(f"the batch {' and '.join(wrong)}: {holds}")
    tokens = batch["tokens"]
    if not (is_array(tokens) and len(tokens.shape) == 2
            and jnp.issubdtype(tokens.dtype, jnp.integer)):
        raise ValueError(f"the batch's tokens must be (B, T) integer ids, got {_described(tokens)}")
    shape = tokens.shape
    for key in (*BATCH_KEYS[1:], *OPTIONAL_BATCH_KEYS):
        x = batch.get(key)
        if x is None and key in OPTIONAL_BATCH_KEYS:  # as `loss_fn` reads it: left out
            continue
        ids = key != "loss_mask"
        if not (is_array(x) and x.shape == shape
                and (not ids or jnp.issubdtype(x.dtype, jnp.integer))):
            raise ValueError(f"the batch's {key} must be {'integers' if ids else 'an array'} of "
                             f"the tokens' shape (B, T) = {shape}, got {_described(x)}")


def _described(x: Any) -> str:
    """An error's words for a batch value: "<dtype> of shape <shape>", or its Python type."""
    return f"{kind_of(x)} of shape {x.shape}" if is_array(x) else kind_of(x)


@flax.struct.dataclass
class TrainState:
    """Everything a training step reads and writes; a checkpoint saves it whole."""

    step: jax.Array  # () int32: optimizer updates done
    params: Any  # float32
    opt_state: Any  # float32
    # (2,) uint32: a key folded from the init key and saved with every checkpoint. Nothing reads
    # it (the model has no dropout or other stochastic layer); it stays so that checkpoints keep
    # one layout and a stochastic layer would resume exactly.
    rng: jax.Array


def _boxed_state(rng: jax.Array, model: DecoderLM, tx: optax.GradientTransformation) -> TrainState:
    """The initial state with parameters still boxed with their logical axis names."""
    params = model.init(rng, jnp.zeros((1, 1), jnp.int32))["params"]
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(nn.meta.unbox(params)),
                      jax.random.fold_in(rng, 1))


def state_shardings(model: DecoderLM, tx: optax.GradientTransformation, mesh: jax.sharding.Mesh,
                    rules: Any) -> tuple[TrainState, TrainState]:
    """(abstract state with shardings, shardings) from `jax.eval_shape`; checks divisibility."""
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)  # abstract: nothing runs, even for a remote mesh
    boxed = jax.eval_shape(lambda rng: _boxed_state(rng, model, tx), key)
    check_divisible(boxed.params, mesh, rules, "parameter")
    params = tree_shardings(boxed.params, mesh, rules)
    replicated = NamedSharding(mesh, P())
    opt = optax.tree_utils.tree_map_params(tx, lambda _, s: s, boxed.opt_state, params,
                                           transform_non_params=lambda _: replicated)
    shardings = TrainState(replicated, params, opt, replicated)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            unboxed(boxed), shardings)
    return abstract, shardings


def init_state(rng: jax.Array, model: DecoderLM, tx: optax.GradientTransformation) -> TrainState:
    """The initial state, unboxed (jit it with `out_shardings` from `state_shardings`)."""
    return nn.meta.unbox(_boxed_state(rng, model, tx))


def target_count(batch: Batch) -> jax.Array:
    """() float32: how many targets of the (B, T) batch count in the loss (at least 1)."""
    mask = batch.get("loss_mask")
    count = batch["targets"].size if mask is None else jnp.sum(mask)
    return jnp.maximum(jnp.asarray(count, jnp.float32), 1.0)


def loss_fn(params: Any, batch: Batch, model: DecoderLM, count: jax.Array | None = None) -> jax.Array:
    """Next-token cross-entropy () float32 summed over the counted targets of the (B, T) batch
    (`loss_mask`, default all) and divided by `count` (default: `target_count(batch)`, the mean)."""
    ce = model.apply({"params": params}, batch["tokens"], positions=batch["positions"],
                     segment_ids=batch.get("segment_ids"), targets=batch["targets"])
    mask = batch.get("loss_mask")
    total = jnp.sum(ce if mask is None else ce * mask)
    return total / (target_count(batch) if count is None else count)


def _micro_batches(batch: Batch, k: int) -> Batch:
    """The (B, T) batch as (k, B/k, T) micro-batches: micro-batch i holds rows j·k + i, so every
    device keeps its own rows. A ValueError unless k divides B."""
    rows = batch["tokens"].shape[0]
    if rows % k:
        raise ValueError(f"a batch of {rows} rows does not split into {k} micro-batches "
                         "(train.grad_accum) of equal rows; give a multiple of it")

    def split(x: jax.Array) -> jax.Array:
        x = x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)
        return nn.with_logical_constraint(x, (None, "batch", "length"))
    return jax.tree.map(split, batch)


def loss_and_grads(params: Any, batch: Batch, model: DecoderLM, grad_accum: int) -> tuple[jax.Array, Any]:
    """(mean loss () float32, its gradients shaped like `params`) over the counted targets of the
    (B, T) batch, in `grad_accum` sequential micro-batches of B / grad_accum rows."""
    check_batch_arrays(batch)
    grad_fn = jax.value_and_grad(loss_fn)
    count = target_count(batch)
    if grad_accum == 1:
        return grad_fn(params, batch, model, count)

    def body(acc: tuple, micro: Batch) -> tuple[tuple, None]:
        loss, grads = grad_fn(params, micro, model, count)  # this micro-batch's share of the mean
        return jax.tree.map(jnp.add, acc, (loss, grads)), None

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    total, _ = jax.lax.scan(body, zeros, _micro_batches(batch, grad_accum))
    return total


def train_step(state: TrainState, batch: Batch, *, model: DecoderLM, tx: optax.GradientTransformation,
               lr_schedule: optax.Schedule, grad_accum: int) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update on a (B, T) batch. Metrics: loss, grad_norm (before clipping), lr
    (all ()), and λ per layer (num_layers,) for a variant whose λ is a layer scalar (diff)."""
    loss, grads = loss_and_grads(state.params, batch, model, grad_accum)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": lr_schedule(state.step)}
    if variants.spec(model.config.variant).differential_op:
        metrics["lambda"] = layer_lambdas(state.params, model.config)
    new = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                        opt_state=opt_state)
    return new, metrics


def eval_step(params: Any, batch: Batch, *, model: DecoderLM, micro_batches: int = 1) -> jax.Array:
    """Mean validation loss () float32 over the counted targets of one (B, T) batch, computed in
    `micro_batches` sequential slices of B / micro_batches rows (the training step's
    `grad_accum`, so that evaluating a batch never holds more activations than training on it)."""
    check_batch_arrays(batch)
    count = target_count(batch)
    if micro_batches == 1:
        return loss_fn(params, batch, model, count)

    def body(total: jax.Array, micro: Batch) -> tuple[jax.Array, None]:
        return total + loss_fn(params, micro, model, count), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), _micro_batches(batch, micro_batches))
    return total


@dataclasses.dataclass(frozen=True)
class Steps:
    """One model's jitted, sharded functions on one mesh (from `build_steps`). Trace and run them
    inside `context()`, which makes the mesh and the logical-axis rules current."""

    model: DecoderLM  # with the attention op built for `mesh`
    tx: optax.GradientTransformation
    mesh: Mesh
    rules: Any  # the logical-axis rule table
    abstract: TrainState  # ShapeDtypeStructs carrying `shardings` (also the restore target)
    shardings: TrainState
    batch_sharding: NamedSharding  # for (B, T) batch arrays
    init: Callable[[jax.Array], TrainState]  # PRNG key -> the initial state, sharded
    train: Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]  # donates state
    eval: Callable[[Any, Batch], jax.Array]  # (params, batch) -> mean loss (), replicated

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """The mesh and the rules as the context every call (and trace) of the steps needs."""
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
            yield

    def abstract_batch(self, batch_size: int, seq_len: int) -> Batch:
        """ShapeDtypeStructs (B, T) int32 of a batch as the data pipeline makes it, with the batch
        sharding (for lowering)."""
        return {k: jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=self.batch_sharding)
                for k in BATCH_KEYS + OPTIONAL_BATCH_KEYS}


def build_steps(config: Config, mesh: Mesh) -> Steps:
    """The sharded steps of `config` on `mesh` (`diff_jax.sharding.make_mesh`).

    Checks that `mesh` has Auto axes `data`, `fsdp`, `tensor`, and that the micro-batch and
    every parameter divide their mesh axes (`ShardingError`) before anything compiles; nothing
    is allocated and nothing runs on the mesh's devices, so `mesh` may describe devices this
    machine does not have (AOT compilation for a TPU slice).

    The steps depend only on `config.model`, `config.optim`, `train.steps` (the schedule),
    `train.batch_size`, `train.grad_accum`, `mesh.rules` and `mesh`. A process asking again for
    the same ones (a run resumed or repeated in it, the seeds of a replication) gets the same
    `Steps` (the last 8 kept), whose jitted functions are already traced and compiled: neither
    traced nor looked up in a compilation cache again (a tiny model's repeated `train_loop.run`:
    1.2–1.5 s against 3.8–4.9 s with the programs read back from the persistent cache).
    """
    if not isinstance(config, Config):
        raise TypeError(f"build_steps takes the whole run Config (its model, optim, train and mesh "
                        f"sections), got {type(config).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"build_steps takes a jax Mesh (diff_jax.sharding.make_mesh(config.mesh)), "
                        f"got {type(mesh).__name__}")
    t = config.train
    return _build_steps(config.model, config.optim, t.steps, t.batch_size, t.grad_accum,
                        config.mesh.rules, mesh)


@functools.lru_cache(maxsize=8)
def _build_steps(model_config: ModelConfig, optim: OptimConfig, steps: int, batch_size: int,
                 grad_accum: int, rules: Any, mesh: Mesh) -> Steps:
    check_mesh(mesh)
    check_batch(batch_size, grad_accum, mesh, rules)
    model = DecoderLM(model_config, attention_op=AttentionOp.build(model_config, mesh, rules))
    tx = make_optimizer(optim, steps)
    with nn.logical_axis_rules(rules):  # no live mesh: optax's init runs small eager ops
        abstract, shardings = state_shardings(model, tx, mesh, rules)
    bsh, replicated = batch_sharding(mesh, rules), NamedSharding(mesh, P())
    train = functools.partial(train_step, model=model, tx=tx, lr_schedule=schedule(optim, steps),
                              grad_accum=grad_accum)
    return Steps(
        model=model, tx=tx, mesh=mesh, rules=rules, abstract=abstract, shardings=shardings,
        batch_sharding=bsh,
        init=jax.jit(functools.partial(init_state, model=model, tx=tx), out_shardings=shardings),
        train=jax.jit(train, in_shardings=(shardings, bsh), out_shardings=(shardings, replicated),
                      donate_argnums=0),
        eval=jax.jit(functools.partial(eval_step, model=model, micro_batches=grad_accum),
                     in_shardings=(shardings.params, bsh), out_shardings=replicated))
