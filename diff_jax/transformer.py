"""The decoder LM: token embedding, pre-RMSNorm layers (attention + SwiGLU), final norm, LM head."""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P

from diff_jax import variants
from diff_jax.attention import LAMBDA_VECTORS, Rope, diff_lambda, lambda_init
from diff_jax.attention_op import AttentionOp
from diff_jax.config import ModelConfig, check_section
from diff_jax.kernels.reference import is_array
from diff_jax.layers import RMSNorm, SwiGLU, residual_out_std
from diff_jax.rope import rope_tables

_REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


LAYERS = "layers"
"""The scanned layers' name in DecoderLM's collections (`model.scan_layers`): one subtree whose
every leaf has a leading axis of `num_layers`, where the unrolled model has `layers_0`, ...
`layers_{L-1}` (`unstacked_layers`, `stacked_layers`)."""


def _decoder_layer(module: nn.Module, x: jax.Array, depth: int | jax.Array, rope: Rope,
                   segment_ids: jax.Array | None, positions: jax.Array | None) -> jax.Array:
    """The body of `DecoderLayer` in `module` (its config, decode and attention_op): x (B, T, E)
    -> (B, T, E) at the 0-based layer index `depth` (an int, or a traced int32 in the scan)."""
    cfg = module.config
    dtype = jnp.dtype(cfg.dtype)
    attn = variants.spec(cfg.variant).module(cfg, depth=depth, decode=module.decode,
                                             attention_op=module.attention_op, name="attn")
    y = x + attn(RMSNorm(cfg.norm_eps, dtype, name="attn_norm")(x), rope=rope,
                 positions=positions, segment_ids=segment_ids)
    y = nn.with_logical_constraint(y, ("batch", "length", "act_embed"))
    ffn = SwiGLU(cfg.resolved_mlp_dim, dtype, cfg.init_std, residual_out_std(cfg), name="ffn")
    out = y + ffn(RMSNorm(cfg.norm_eps, dtype, name="ffn_norm")(y))
    module.sow("intermediates", "hidden", out)
    return nn.with_logical_constraint(out, ("batch", "length", "act_embed"))


class DecoderLayer(nn.Module):
    """Y = X + Attn(RMSNorm(X)); X' = Y + SwiGLU(RMSNorm(Y))."""

    config: ModelConfig
    depth: int
    decode: bool = False
    attention_op: AttentionOp | None = None

    @nn.compact
    def __call__(self, x: jax.Array, rope: Rope, segment_ids: jax.Array | None,
                 positions: jax.Array | None = None) -> jax.Array:
        """x (B, T, E) -> (B, T, E); `rope` (cos, sin) (B, T, d/2), `segment_ids` and
        `positions` (B, T) as in `DecoderLM`. Sows the output as `intermediates/hidden`."""
        return _decoder_layer(self, x, self.depth, rope, segment_ids, positions)


class _ScannedLayer(nn.Module):
    """`DecoderLayer` as one step of the layer scan (`model.scan_layers`): (x, depth) -> (x',
    None), `depth` the scanned layer index (int32), the other arguments the same in every
    layer."""

    config: ModelConfig
    decode: bool = False
    attention_op: AttentionOp | None = None

    @nn.compact
    def __call__(self, x: jax.Array, depth: jax.Array, rope: Rope, segment_ids: jax.Array | None,
                 positions: jax.Array | None) -> tuple[jax.Array, None]:
        return _decoder_layer(self, x, depth, rope, segment_ids, positions), None


def unstacked_layers(tree: dict, num_layers: int) -> dict:
    """A DecoderLM collection (parameters unboxed, intermediates, cache) with the scanned layers
    (`LAYERS`) as `layers_0` ... `layers_{L-1}`, the unrolled model's names; a tree without
    `LAYERS` as it is. The analyses, the reference layout and λ read layers one at a time.
    A `jax.ShapeDtypeStruct` leaf becomes one without the leading axis (its NamedSharding's spec
    too)."""
    if LAYERS not in tree:
        return tree
    held = {np.shape(a)[0] for a in jax.tree.leaves(tree[LAYERS])}
    if held - {num_layers}:
        raise ValueError(f"the stacked layers' leading axis holds {sorted(held)} layers, "
                         f"expected {num_layers} (model.num_layers)")

    def layer(a, i: int):
        if isinstance(a, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(a.shape[1:], a.dtype,
                                        sharding=_layers_axis(a.sharding, False))
        return a[i]

    out = {k: v for k, v in tree.items() if k != LAYERS}
    for i in range(num_layers):
        out[f"layers_{i}"] = jax.tree.map(lambda a, i=i: layer(a, i), tree[LAYERS])
    return out


def stacked_layers(tree: dict, num_layers: int) -> dict:
    """The inverse of `unstacked_layers`: `layers_0` ... `layers_{L-1}` as one `LAYERS` subtree
    (NumPy leaves stay NumPy; `jax.ShapeDtypeStruct`s gain the axis, unsplit in their
    NamedSharding); a tree that is stacked already as it is."""
    if LAYERS in tree:
        return tree
    names = [f"layers_{i}" for i in range(num_layers)]
    held = {k for k in tree if re.fullmatch(r"layers_\d+", k)}
    if held != set(names):
        raise ValueError(f"the tree holds {len(held)} layers named layers_N "
                         f"({', '.join(sorted(held, key=lambda k: int(k[7:]))[:4]) or 'none'}"
                         f"{', ...' if len(held) > 4 else ''}), expected layers_0 ... "
                         f"layers_{num_layers - 1} (model.num_layers={num_layers})")

    def stack(*leaves):
        first = leaves[0]
        if isinstance(first, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct((len(leaves), *first.shape), first.dtype,
                                        sharding=_layers_axis(first.sharding, True))
        return (jnp.stack(leaves) if isinstance(first, jax.Array)
                else np.stack([np.asarray(a) for a in leaves]))

    out = {k: v for k, v in tree.items() if k not in names}
    out[LAYERS] = jax.tree.map(stack, *(tree[n] for n in names))
    return out


def _layers_axis(sharding, stacked: bool):
    """An abstract leaf's sharding with a leading, unsplit layers axis added (`stacked`) or
    removed; None and shardings without a spec (one device) as they are."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = tuple(sharding.spec)
    return NamedSharding(sharding.mesh, P(*((None, *spec) if stacked else spec[1:])))


def _holds_layers(tree) -> bool:
    return isinstance(tree, dict) and (LAYERS in tree or "layers_0" in tree)


def in_layout(tree, config: ModelConfig):
    """`tree` with every collection of layers in it in the layout `config.scan_layers` gives:
    unboxed parameters of either layout (a checkpoint or export of the other read for this
    model: `train.init_from`, eval.py), or a whole train state, whose optimizer state holds the
    parameters' tree again (a run resumed in the other layout). Leaves: arrays (traced ones too),
    NumPy arrays, or `jax.ShapeDtypeStruct`s (an abstract target)."""
    convert = stacked_layers if config.scan_layers else unstacked_layers
    return jax.tree.map(lambda x: convert(x, config.num_layers) if _holds_layers(x) else x, tree,
                        is_leaf=_holds_layers)


def in_layout_placed(tree, config: ModelConfig, shardings):
    """`in_layout(tree, config)` for a tree of jax arrays (a train state restored in the other
    layout), each result placed on its sharding in `shardings` (a tree of the result's
    structure), one parameter's stack of layers at a time: each source array is deleted once
    its stack or its slices are placed, so the devices hold the tree and one parameter's layers
    more at the peak, not the tree twice."""
    num_layers = config.num_layers

    def convert(x, placed):
        if not _holds_layers(x):
            return x
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x)
        in_layout(abstract, config)  # the layer count's error, before anything is deleted
        if config.scan_layers == (LAYERS in x):
            return x
        if config.scan_layers:
            names = [f"layers_{i}" for i in range(num_layers)]
            out = {k: v for k, v in x.items() if k not in names}
            out[LAYERS] = jax.tree.map(lambda sharding, *parts: _stack_placed(parts, sharding),
                                       placed[LAYERS], *(x[n] for n in names))
            return out
        out = {k: v for k, v in x.items() if k != LAYERS}
        sliced = jax.tree.map(lambda a, *sh: _slices_placed(a, sh), x[LAYERS],
                              *(placed[f"layers_{i}"] for i in range(num_layers)))
        for i in range(num_layers):
            out[f"layers_{i}"] = jax.tree.map(lambda parts, i=i: parts[i], sliced,
                                              is_leaf=lambda t: isinstance(t, tuple))
        return out

    return jax.tree.map(convert, tree, shardings, is_leaf=_holds_layers)


# the parameters the model reads only after casting them to `model.dtype`: the projections'
# kernels (nn.Dense's dtype), the embedding (each row looked up is cast) and the LM head
CAST_AT_USE = ("kernel", "embed", "lm_head")


def in_compute_dtype(params, config: ModelConfig):
    """`params` (unboxed, either layout) for inference: each array of `CAST_AT_USE` stored in
    `config.dtype`, which the model casts it to before reading it, so that the outputs are the
    same bit for bit from half the memory under bfloat16; the norm scales and the λ vectors
    (read in float32) stay as they are. A cast array that is a jax array is deleted once its
    copy is made, so the devices hold the tree and one array more at the peak. Training keeps
    float32 parameters: the optimizer updates them."""
    dtype = jnp.dtype(config.dtype)

    def cast(path, x):
        if getattr(path[-1], "key", None) not in CAST_AT_USE or x.dtype == dtype:
            return x
        y = x.astype(dtype)
        if isinstance(x, jax.Array):
            x.delete()
        return y

    return jax.tree_util.tree_map_with_path(cast, params)


def _stack(*parts: jax.Array) -> jax.Array:
    return jnp.stack(parts)


def _slices(stacked: jax.Array, n: int) -> tuple[jax.Array, ...]:
    return tuple(stacked[i] for i in range(n))


def _stack_placed(parts: tuple[jax.Array, ...], sharding) -> jax.Array:
    stacked = jax.jit(_stack, out_shardings=sharding)(*parts)
    for part in parts:
        part.delete()
    return stacked


def _slices_placed(stacked: jax.Array, shardings: tuple) -> tuple[jax.Array, ...]:
    parts = jax.jit(_slices, static_argnums=1, out_shardings=shardings)(stacked, len(shardings))
    stacked.delete()
    return parts


def _vocab_logits(x: jax.Array, head: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """x (B, T, E) @ head (E, vocab) in `dtype` -> logits (B, T, vocab) float32."""
    logits = jnp.einsum("bte,ev->btv", x, head.astype(dtype), preferred_element_type=jnp.float32)
    return nn.with_logical_constraint(logits, ("batch", "length", "act_vocab"))


def _nll(x: jax.Array, head: jax.Array, targets: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """−log softmax(x @ head)[target] (B, T) float32, for x (B, T, E) and targets (B, T)."""
    logits = _vocab_logits(x, head, dtype)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


def next_token_nll(x: jax.Array, head: jax.Array, targets: jax.Array, dtype: jnp.dtype,
                   chunk: int) -> jax.Array:
    """The NLL (B, T) float32 of `targets` (B, T) under the logits x (B, T, E) @ head (E, vocab),
    computed in `dtype`, `chunk` positions at a time (0: all at once).

    Chunked, a `lax.scan` over the positions (T padded to a multiple of `chunk`) projects one
    (B, chunk) slice at a time under `jax.checkpoint`: the backward pass recomputes each slice's
    logits instead of keeping (B, T, vocab), at the cost of one more head matmul. `head` enters
    the scan in its own dtype (float32 parameters), so its gradient sums over the chunks in it.
    """
    b, t, e = x.shape
    if chunk == 0 or chunk >= t:
        return _nll(x, head, targets, dtype)
    pad = -t % chunk
    xs = jnp.pad(x, ((0, 0), (0, pad), (0, 0))).reshape(b, -1, chunk, e).swapaxes(0, 1)
    ts = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, -1, chunk).swapaxes(0, 1)
    xs = nn.with_logical_constraint(xs, (None, "batch", "length", "act_embed"))

    @jax.checkpoint
    def one(x_c: jax.Array, t_c: jax.Array) -> jax.Array:
        return _nll(x_c, head, t_c, dtype)

    _, nll = jax.lax.scan(lambda _, xt: (None, one(*xt)), None, (xs, ts))
    return nll.swapaxes(0, 1).reshape(b, -1)[:, :t]


def _array_like(name: str, x: Any) -> Any:
    """`x` as an array: a jax or NumPy array (a tracer too) and None as they are, another
    array-like (nested lists of ids) as NumPy; a ragged one is one error naming `name`."""
    if x is None or is_array(x):
        return x
    try:
        return np.asarray(x)
    except ValueError:  # NumPy's "inhomogeneous shape"
        raise ValueError(f"{name} must be array-like with one length per axis, got a ragged "
                         f"{type(x).__name__}") from None


def _check_per_token(name: str, x: Any, shape: tuple[int, int], what: str) -> None:
    """One ValueError naming `name`, the tokens' `shape` (B, T), `what` its entries are, and
    `x`'s dtype and shape, unless `x` (an array) is None or integers of that shape."""
    if x is not None and (x.shape != shape or not jnp.issubdtype(x.dtype, jnp.integer)):
        raise ValueError(f"{name} must be (B, T) = {shape} {what}, got {x.dtype} of shape "
                         f"{x.shape}")


class DecoderLM(nn.Module):
    """tokens (B, T) int32 -> logits (B, T, vocab) float32.

    `positions` (B, T) restart per packed segment (default 0..T-1); `segment_ids` (B, T) confine
    attention to a segment, causally, with 0 marking padding. Both are integers of the tokens'
    shape (another shape, or a float or bool array, is a ValueError naming it). With
    `decode=True` every attention layer keeps a KV cache in the `cache` collection (see
    `diff_jax.generate`), one sequence per row, as long as the `init` input (B, S):
    `segment_ids` are then refused, whatever they hold. A call with T > 1 is
    the prompt's prefill from position 0 (it attends within its own tokens, not to the cache; a
    prompt fed in chunks is not supported); a call with T = 1 and `positions` p (B, 1) in [0, S)
    writes entry p and attends to entries 0..p (pass them: the default is 0). A position outside
    [0, S) cannot be an error under jit: that row's logits are NaN. `logits_at` (B, K) int
    projects only those positions of each row onto the vocabulary: logits (B, K, vocab), for a
    caller that reads a few positions (a prompt's last token, the answer positions of a
    retrieval item) instead of materializing (B, T, vocab); under jit a position outside
    [−T, T) cannot be an error either: its logits are NaN. `targets` (B, T) int returns their
    next-token NLL (B, T) float32 instead of logits (`next_token_nll`, `model.loss_chunk`
    positions of the vocabulary projection at a time); a target ≥ vocab gives NaN, a negative
    one counts from the end as in NumPy.
    `attention_op`
    (`AttentionOp.build(config, mesh, rules)`; None: built from `config` on the context mesh)
    is the one attention call of every layer.

    Token ids must lie in [0, vocab_size); under jit they cannot be checked: an id ≥ vocab_size
    embeds as NaN (every logit of its row becomes NaN), a negative id wraps around.
    """

    config: ModelConfig
    decode: bool = False
    attention_op: AttentionOp | None = None

    def __post_init__(self) -> None:
        check_section(self.config, ModelConfig, "DecoderLM")
        super().__post_init__()

    def quantized(self, bits: jax.Array | None) -> DecoderLM:
        """This model with every layer's attention logits absmax fake-quantized to `bits`
        (`AttentionOp.quantized`: an int32 scalar, traceable, so build the model inside the
        traced function); itself when `bits` is None."""
        if bits is None:
            return self
        op = self.attention_op or AttentionOp.build(self.config)
        return self.clone(attention_op=op.quantized(bits))

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        logits_at: jax.Array | None = None,
        targets: jax.Array | None = None,
    ) -> jax.Array:
        """tokens (B, T) int32 -> logits (B, T, vocab) float32, or (B, K, vocab) at the positions
        `logits_at` (B, K), or the NLL (B, T) float32 of `targets` (B, T) (see the class
        docstring). Each argument may be any array-like (nested lists, NumPy) as well as a jax
        array: `apply(variables, [[1, 2]])` is `apply(variables, jnp.asarray([[1, 2]]))`."""
        tokens, positions, segment_ids, logits_at, targets = (
            _array_like(name, x) for name, x in (
                ("tokens", tokens), ("positions", positions), ("segment_ids", segment_ids),
                ("logits_at", logits_at), ("targets", targets)))
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be (B, T) integer ids, got {tokens.dtype} of shape "
                             f"{tokens.shape}")
        b, t = tokens.shape
        # float positions ran RoPE at fractional angles, bools as 0 and 1; (T,) or (1, T) ones
        # broadcast over the rows, others failed inside RoPE
        _check_per_token("positions", positions, (b, t),
                         "integers (each token's position in its segment)")
        if not self.decode:  # with a KV cache any segment_ids are refused (`_kv_cache`)
            _check_per_token("segment_ids", segment_ids, (b, t), "integers (0: padding)")
        if logits_at is not None and (
                logits_at.ndim != 2 or logits_at.shape[0] != b
                or not jnp.issubdtype(logits_at.dtype, jnp.integer)):
            raise ValueError(f"logits_at must be (B, K) = ({b}, K) integer positions, got "
                             f"{logits_at.dtype} of shape {logits_at.shape}")
        _check_per_token("targets", targets, (b, t), "integer ids")
        if targets is not None and logits_at is not None:
            raise ValueError("pass logits_at or targets, not both")
        embedding = self.param(
            "embed",
            nn.with_logical_partitioning(nn.initializers.normal(cfg.init_std), ("vocab", "embed")),
            (cfg.vocab_size, cfg.embed_dim), jnp.float32,
        )
        x = jnp.take(embedding, tokens, axis=0).astype(dtype)
        x = nn.with_logical_constraint(x, ("batch", "length", "act_embed"))
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        rope = rope_tables(positions, cfg.resolved_head_dim, cfg.rope_theta)  # (B, T, d/2)

        op = self.attention_op or AttentionOp.build(cfg)
        policy = _REMAT_POLICIES.get(cfg.remat)
        if cfg.scan_layers:  # one traced layer, its parameters stacked on a `layers` axis
            step = _ScannedLayer
            if cfg.remat != "none":
                step = nn.remat(_ScannedLayer, policy=policy, prevent_cse=False)
            stack = nn.scan(step, variable_axes={"params": 0, "cache": 0, "intermediates": 0},
                            split_rngs={"params": True}, length=cfg.num_layers,
                            in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
                            metadata_params={nn.PARTITION_NAME: "layers"})
            x, _ = stack(cfg, decode=self.decode, attention_op=op, name=LAYERS)(
                x, jnp.arange(cfg.num_layers, dtype=jnp.int32), rope, segment_ids, positions)
        else:
            layer_cls = DecoderLayer if cfg.remat == "none" else nn.remat(DecoderLayer,
                                                                          policy=policy)
            for i in range(cfg.num_layers):
                x = layer_cls(cfg, depth=i, decode=self.decode, attention_op=op,
                              name=f"layers_{i}")(x, rope, segment_ids, positions)
        x = RMSNorm(cfg.norm_eps, dtype, name="norm")(x)
        if logits_at is not None:  # as NumPy indexes: −1 is the last; outside [−T, T): NaN
            x = jnp.take_along_axis(x, logits_at[..., None], axis=1, mode="fill")

        if cfg.tie_embeddings:
            head = embedding.T
        else:
            head = self.param(
                "lm_head",
                nn.with_logical_partitioning(nn.initializers.normal(cfg.init_std), ("embed", "vocab")),
                (cfg.embed_dim, cfg.vocab_size), jnp.float32,
            )
        if targets is not None:
            return next_token_nll(x, head, targets, dtype, cfg.loss_chunk)
        return _vocab_logits(x, head, dtype)


def layer_lambdas(params: dict, config: ModelConfig) -> jax.Array:
    """λ of every layer (num_layers,) float32, from a parameter tree (`init`'s, boxed with its
    logical axis names, or unboxed; with or without its "params" key), for a variant whose λ is
    a layer scalar (`Variant.differential_op`: DIFF V1)."""
    if not variants.spec(config.variant).differential_op:
        raise ValueError(f"per-layer λ exists for variant diff only, not {config.variant!r}")
    params = unstacked_layers(nn.meta.unbox(params.get("params", params)), config.num_layers)
    return jnp.stack([
        diff_lambda(*(params[f"layers_{i}"]["attn"][n] for n in LAMBDA_VECTORS),
                    lambda_init(i, config.lambda_init))
        for i in range(config.num_layers)
    ])
