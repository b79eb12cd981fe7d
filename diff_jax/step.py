"""The pure training and evaluation steps, and the sharded train state they act on.

`train_step(state, batch, …) -> (state, metrics)` is jitted once by the loop with explicit
in/out shardings and the state donated. Gradient accumulation runs inside it: the global batch
(B, T) is split into `grad_accum` micro-batches of B/k rows (row j·k + i goes to micro-batch i,
so every device keeps its own rows), gradients are summed in float32 with `lax.scan`, and one
optimizer update follows; with equal token counts per micro-batch this equals one step on B.
"""

from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P

from diff_jax.sharding import check_divisible, tree_shardings
from diff_jax.transformer import DecoderLM, layer_lambdas

Batch = dict[str, jax.Array]  # tokens, targets, segment_ids, positions: (B, T) int32


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # () int32: optimizer updates done
    params: Any  # float32
    opt_state: Any  # float32
    rng: jax.Array  # (2,) uint32: key for stochastic layers; saved with every checkpoint


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
                            _values(boxed), shardings)
    return abstract, shardings


def _values(tree: Any) -> Any:
    """Remove logical-axis boxes without adding sharding constraints (for abstract trees)."""
    is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)  # noqa: E731
    return jax.tree.map(lambda x: x.unbox(apply_constraint=False) if is_box(x) else x, tree,
                        is_leaf=is_box)


def init_state(rng: jax.Array, model: DecoderLM, tx: optax.GradientTransformation) -> TrainState:
    """The initial state, unboxed (jit it with `out_shardings` from `state_shardings`)."""
    return nn.meta.unbox(_boxed_state(rng, model, tx))


def loss_fn(params: Any, batch: Batch, model: DecoderLM) -> jax.Array:
    """Mean next-token cross-entropy over every position of the batch (float32)."""
    logits = model.apply({"params": params}, batch["tokens"], positions=batch["positions"],
                         segment_ids=batch["segment_ids"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def loss_and_grads(params: Any, batch: Batch, model: DecoderLM, grad_accum: int) -> tuple[jax.Array, Any]:
    """(mean loss, mean gradients) over the batch, in `grad_accum` sequential micro-batches."""
    grad_fn = jax.value_and_grad(loss_fn)
    if grad_accum == 1:
        return grad_fn(params, batch, model)

    def split(x: jax.Array) -> jax.Array:  # (B, T) -> (k, B/k, T), micro-batch i = rows j·k + i
        x = x.reshape(x.shape[0] // grad_accum, grad_accum, *x.shape[1:]).swapaxes(0, 1)
        return nn.with_logical_constraint(x, (None, "batch", "length"))

    def body(acc: tuple, micro: Batch) -> tuple[tuple, None]:
        loss, grads = grad_fn(params, micro, model)
        return jax.tree.map(jnp.add, acc, (loss, grads)), None

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    total, _ = jax.lax.scan(body, zeros, jax.tree.map(split, batch))
    return jax.tree.map(lambda x: x / grad_accum, total)


def train_step(state: TrainState, batch: Batch, *, model: DecoderLM, tx: optax.GradientTransformation,
               lr_schedule: optax.Schedule, grad_accum: int) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update. Metrics: loss, grad_norm (before clipping), lr, and λ per layer (diff)."""
    loss, grads = loss_and_grads(state.params, batch, model, grad_accum)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": lr_schedule(state.step)}
    if model.config.variant == "diff":
        metrics["lambda"] = layer_lambdas(state.params, model.config)
    new = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                        opt_state=opt_state)
    return new, metrics


def eval_step(params: Any, batch: Batch, *, model: DecoderLM) -> jax.Array:
    """Mean validation loss of one batch."""
    return loss_fn(params, batch, model)
