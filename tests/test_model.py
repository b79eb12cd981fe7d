"""DecoderLM: shapes, dtypes, logical axes, causality, packed-sequence isolation, remat."""

import dataclasses
import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from diff_jax.config import ModelConfig
from diff_jax.transformer import DecoderLM, layer_lambdas

V, T = 97, 16


def _cfg(variant: str, **kw) -> ModelConfig:
    fields = dict(variant=variant, vocab_size=V, embed_dim=64, num_layers=2,
                  num_heads=8 if variant == "transformer" else 4, num_kv_heads=2, max_seq_len=64)
    return ModelConfig(**{**fields, **kw})


def _init(cfg, b=2, t=T):
    model = DecoderLM(cfg)
    tokens = jax.random.randint(jax.random.key(0), (b, t), 0, V)
    variables = jax.jit(model.init)(jax.random.key(1), tokens)
    return model, variables, tokens


@pytest.mark.parametrize("variant", ["diff", "diff_v2", "transformer"])
@pytest.mark.parametrize("tie", [True, False])
def test_shapes_and_logical_axes(variant, tie):
    cfg = _cfg(variant, tie_embeddings=tie, dtype="bfloat16")
    model, variables, tokens = _init(cfg)
    logits = jax.jit(model.apply)(variables, tokens)
    chex.assert_shape(logits, (2, T, V))
    chex.assert_type(logits, jnp.float32)
    chex.assert_tree_all_finite(logits)
    # Every parameter is float32 and carries logical axis names of its rank.
    boxed = jax.tree.leaves(variables, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    assert boxed and all(isinstance(p, nn.Partitioned) for p in boxed)
    for p in boxed:
        assert p.value.dtype == jnp.float32 and len(p.names) == p.value.ndim
    params = nn.meta.unbox(variables)["params"]
    assert ("lm_head" in params) == (not tie)
    chex.assert_shape(params["embed"], (V, 64))
    names = {n for p in boxed for n in p.names}
    assert {"vocab", "embed", "heads", "kv_heads", "mlp", "norm"} <= names


@pytest.mark.parametrize("variant", ["diff", "diff_v2", "transformer"])
def test_causal_and_packed_segments_are_isolated(variant):
    """A packed row [doc A | doc B | pad] gives each doc the logits it gets alone."""
    cfg = _cfg(variant)
    model, variables, _ = _init(cfg)
    apply = jax.jit(model.apply)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, V, 7), rng.integers(0, V, 6)
    packed = np.concatenate([a, b, [0, 0, 0]])[None].astype(np.int32)
    seg = np.array([[1] * 7 + [2] * 6 + [0] * 3], np.int32)
    pos = np.array([list(range(7)) + list(range(6)) + [0, 0, 0]], np.int32)
    out = np.asarray(apply(variables, jnp.asarray(packed), positions=jnp.asarray(pos),
                           segment_ids=jnp.asarray(seg)))
    alone_a = np.asarray(apply(variables, jnp.asarray(a[None].astype(np.int32))))
    alone_b = np.asarray(apply(variables, jnp.asarray(b[None].astype(np.int32))))
    # float32, a different padded length only: measured max |Δ| ≤ 1.2e-7 (|logits| ≤ 1.4);
    # 2e-6 is about 17× that
    np.testing.assert_allclose(out[0, :7], alone_a[0], rtol=1e-6, atol=2e-6)
    np.testing.assert_allclose(out[0, 7:13], alone_b[0], rtol=1e-6, atol=2e-6)
    # Causality: changing a later token leaves earlier logits bit-identical.
    changed = packed.copy()
    changed[0, 10] = (changed[0, 10] + 1) % V
    out2 = np.asarray(apply(variables, jnp.asarray(changed), positions=jnp.asarray(pos),
                            segment_ids=jnp.asarray(seg)))
    np.testing.assert_array_equal(out2[0, :10], out[0, :10])
    assert not np.allclose(out2[0, 10:13], out[0, 10:13])


def test_remat_gives_identical_loss_and_grads():
    def loss(model, params, tokens):
        logits = model.apply({"params": params}, tokens)
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    base = _cfg("diff")
    _, variables, tokens = _init(base)
    params = nn.meta.unbox(variables)["params"]
    results = [
        jax.jit(jax.value_and_grad(functools.partial(loss, DecoderLM(dataclasses.replace(base, remat=r)))))(
            params, tokens)
        for r in ("none", "full", "dots")
    ]
    for value, grads in results[1:]:
        np.testing.assert_allclose(value, results[0][0], rtol=1e-6)
        chex.assert_trees_all_close(grads, results[0][1], rtol=1e-5, atol=1e-7)


def test_layer_lambdas():
    cfg = _cfg("diff", num_layers=3)
    _, variables, _ = _init(cfg)
    params = nn.meta.unbox(variables)["params"]
    lams = np.asarray(layer_lambdas(params, cfg))
    chex.assert_shape(lams, (3,))
    for i in range(3):
        a = params[f"layers_{i}"]["attn"]
        want = (np.exp(a["lambda_q1"] @ a["lambda_k1"]) - np.exp(a["lambda_q2"] @ a["lambda_k2"])
                + 0.8 - 0.6 * np.exp(-0.3 * i))
        np.testing.assert_allclose(lams[i], want, rtol=1e-6)
    # init's own output (boxed with logical axis names, under "params") gives the same λ
    np.testing.assert_array_equal(np.asarray(layer_lambdas(variables, cfg)), lams)
    with pytest.raises(ValueError, match="variant diff only"):
        layer_lambdas(params, _cfg("transformer"))
    # model.lambda_init moves every layer's λ to the same offset
    fixed = np.asarray(layer_lambdas(params, _cfg("diff", num_layers=3, lambda_init=0.5)))
    np.testing.assert_allclose(fixed, lams - (0.8 - 0.6 * np.exp(-0.3 * np.arange(3))) + 0.5,
                               rtol=1e-6)


def test_a_held_lambda_is_lambda_init_and_no_optimizer_step_moves_it():
    """model.learn_lambda=false: λ's vectors start at zero (λ = λ_init in every layer, exactly)
    and get no gradient, so AdamW steps leave λ where it was; every other parameter is drawn as
    with a learned λ (same key), and on the same parameters both settings compute the same
    loss and the same gradients for everything but λ's vectors, whose gradient is non-zero
    only when learned."""
    from diff_jax.attention import LAMBDA_VECTORS
    from diff_jax.config import OptimConfig
    from diff_jax.optim import make_optimizer

    learned = _cfg("diff", num_layers=3)
    held = dataclasses.replace(learned, learn_lambda=False)
    _, learned_vars, tokens = _init(learned)
    _, held_vars, _ = _init(held)
    params = nn.meta.unbox(held_vars)["params"]
    is_lambda = lambda path: path[-1].key in LAMBDA_VECTORS  # noqa: E731
    flat_learned = dict(jax.tree_util.tree_leaves_with_path(nn.meta.unbox(learned_vars)["params"]))
    n_lambda = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if is_lambda(path):
            n_lambda += 1
            np.testing.assert_array_equal(leaf, np.zeros_like(leaf))
            assert np.any(flat_learned[path] != 0)
        else:
            np.testing.assert_array_equal(leaf, flat_learned[path])
    assert n_lambda == 3 * len(LAMBDA_VECTORS)
    np.testing.assert_array_equal(np.asarray(layer_lambdas(params, held)),
                                  np.asarray([0.8 - 0.6 * np.exp(-0.3 * i) for i in range(3)],
                                             np.float32))

    def loss(cfg, p):
        logits = DecoderLM(cfg).apply({"params": p}, tokens)
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    # on the learned init's parameters (non-zero vectors, as train.init_from may bring): at zero
    # vectors λ's gradient is zero whether learned or not (d exp(q·k)/dq = exp(q·k)·k)
    learned_params = nn.meta.unbox(learned_vars)["params"]
    (v_held, g_held), (v_learned, g_learned) = (
        jax.jit(jax.value_and_grad(functools.partial(loss, cfg)))(learned_params)
        for cfg in (held, learned))
    np.testing.assert_array_equal(v_held, v_learned)
    for (path, gh), (_, gl) in zip(jax.tree_util.tree_leaves_with_path(g_held),
                                   jax.tree_util.tree_leaves_with_path(g_learned)):
        if is_lambda(path):
            np.testing.assert_array_equal(gh, np.zeros_like(gh))
            assert np.any(gl != 0), path
        else:
            chex.assert_trees_all_close(gh, gl, rtol=1e-6, atol=1e-9)

    opt = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0), total_steps=10)
    params = start = learned_params
    state = opt.init(params)

    @jax.jit  # one program for the step: optax op by op would compile each of its small ops
    def step(params, state):
        updates, state = opt.update(jax.grad(functools.partial(loss, held))(params), state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(3):
        params, state = step(params, state)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        moved = not np.array_equal(leaf, dict(jax.tree_util.tree_leaves_with_path(start))[path])
        assert moved != is_lambda(path), path


@pytest.mark.parametrize("tokens", [jnp.zeros((T,), jnp.int32), jnp.zeros((2, T), jnp.float32)])
def test_tokens_that_are_not_a_batch_of_ids_are_refused(tokens):
    """One error naming `tokens` and what they must be, not a bare unpacking or gather error."""
    model, variables, _ = _init(_cfg("diff", num_layers=1))
    with pytest.raises(ValueError, match=r"tokens must be \(B, T\) integer ids, got "):
        model.apply(variables, tokens)


_PER_TOKEN = {"positions": r"integers \(each token's position in its segment\)",
              "segment_ids": r"integers \(0: padding\)"}


def test_positions_and_segment_ids_that_are_not_integers_are_refused():
    """Float positions ran RoPE at fractional angles (np.arange(T, dtype=float) silently) and bool
    ones as 0 and 1; float or bool segment ids were refused only by the attention's own check,
    inside the first layer. Each is one error naming the argument, its dtype and (B, T)."""
    model, variables, tokens = _init(_cfg("diff", num_layers=1))
    for bad in (np.broadcast_to(np.arange(T, dtype=float), (2, T)), np.ones((2, T), bool)):
        for name, what in _PER_TOKEN.items():
            with pytest.raises(ValueError, match=rf"^{name} must be \(B, T\) = \(2, {T}\) {what}, "
                                                 rf"got {bad.dtype} of shape \(2, {T}\)"):
                model.apply(variables, tokens, **{name: bad})
    np.testing.assert_array_equal(  # integers of any width are positions
        model.apply(variables, tokens, positions=np.broadcast_to(np.arange(T, dtype=np.uint8), (2, T))),
        model.apply(variables, tokens))


@pytest.mark.parametrize("name", list(_PER_TOKEN))
@pytest.mark.parametrize("shape", [(2, T + 1), (2, T - 1), (T,), (2, 1), (1, T), (3, T), ()])
def test_positions_and_segment_ids_not_of_the_tokens_shape_are_refused(name, shape):
    """Positions (T,) or (1, T) broadcast silently over the rows; (B, T + 1), (B, 1) or another
    B failed inside RoPE ("RoPE tables ... do not fit x") or the attention. Each is one error
    naming the argument, its shape and the tokens' (B, T), before anything is computed."""
    model, variables, tokens = _init(_cfg("diff", num_layers=1))
    with pytest.raises(ValueError, match=rf"^{name} must be \(B, T\) = \(2, {T}\) {_PER_TOKEN[name]}, "
                                         rf"got int32 of shape {re.escape(str(shape))}"):
        model.apply(variables, tokens, **{name: jnp.zeros(shape, jnp.int32)})


def test_lists_of_ids_and_positions_are_taken_as_arrays():
    """Token ids, positions, segment ids, `logits_at` and `targets` as nested lists (or NumPy)
    give what their jnp arrays give; they failed in "'list' object has no attribute 'ndim'". A
    ragged list is one error naming the argument."""
    model, variables, tokens = _init(_cfg("diff", num_layers=1))
    at, targets = jnp.asarray([[0, T - 1], [3, 1]]), jnp.roll(tokens, -1, axis=1)
    positions, segments = jnp.broadcast_to(jnp.arange(T), (2, T)), jnp.ones((2, T), jnp.int32)
    for kw in (dict(logits_at=at), dict(targets=targets)):
        kw.update(positions=positions, segment_ids=segments)
        want = model.apply(variables, tokens, **kw)
        as_lists = {name: np.asarray(x).tolist() for name, x in kw.items()}
        np.testing.assert_array_equal(model.apply(variables, np.asarray(tokens).tolist(), **as_lists),
                                      want)
    with pytest.raises(ValueError, match=r"^tokens must be array-like with one length per axis, "
                                         r"got a ragged list"):
        model.apply(variables, [[1, 2], [3]])
    with pytest.raises(ValueError, match=r"^tokens must be \(B, T\) integer ids, got <U1 of shape"):
        model.apply(variables, [["a"]])


@pytest.mark.parametrize("tie", [True, False])
def test_logits_at_are_the_full_logits_at_those_positions(tie):
    """`logits_at` (B, K) gives the rows of the full (B, T, V) logits at those positions (float32:
    the same per-token computation, so within 1e-6); −1 is the last position, one past the end
    is NaN."""
    cfg = _cfg("diff", tie_embeddings=tie)
    model, variables, tokens = _init(cfg)
    full = np.asarray(jax.jit(model.apply)(variables, tokens), np.float64)
    at = np.array([[0, 5, 5, T - 1], [3, 0, T - 1, 1]])
    got = np.asarray(jax.jit(functools.partial(model.apply, logits_at=jnp.asarray(at)))(
        variables, tokens), np.float64)
    ref = full[np.arange(2)[:, None], at]
    chex.assert_shape(got, (2, 4, V))
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-6
    edge = model.apply(variables, tokens, logits_at=jnp.array([[-1, T], [T - 1, 0]]))
    np.testing.assert_allclose(edge[0, 0], full[0, T - 1], rtol=1e-5, atol=1e-6)
    assert np.isnan(edge[0, 1]).all() and np.isfinite(edge[1]).all()


@pytest.mark.parametrize("at", [jnp.zeros((2,), jnp.int32), jnp.zeros((3, 1), jnp.int32),
                                jnp.zeros((2, 1), jnp.float32)])
def test_logits_at_that_are_not_positions_per_row_are_refused(at):
    model, variables, tokens = _init(_cfg("diff", num_layers=1))
    with pytest.raises(ValueError, match=r"logits_at must be \(B, K\) = \(2, K\) integer positions, got "):
        model.apply(variables, tokens, logits_at=at)


def test_targets_give_the_float64_next_token_nll_and_chunks_change_neither_it_nor_its_gradients():
    """`targets` returns −log softmax(logits)[target] (B, T): against float64 NumPy from the full
    logits (float32: 1e-6), and with `loss_chunk` 5 (T = 16: three whole chunks and a padded
    one) the same values and parameter gradients as unchunked (1e-6: the same per-position
    arithmetic, summed in another order)."""
    cfg = _cfg("diff", tie_embeddings=False)
    model, variables, tokens = _init(cfg)
    targets = jnp.roll(tokens, -1, axis=1)
    logits = np.asarray(jax.jit(model.apply)(variables, tokens), np.float64)
    z = logits - logits.max(-1, keepdims=True)
    ref = np.log(np.exp(z).sum(-1)) - np.take_along_axis(z, np.asarray(targets)[..., None], -1)[..., 0]
    weights = jax.random.uniform(jax.random.key(2), (2, T))  # a masked, weighted loss

    def loss(params, chunk):
        m = DecoderLM(dataclasses.replace(cfg, loss_chunk=chunk))
        nll = m.apply(params, tokens, targets=targets)
        return jnp.sum(nll * weights), nll

    grads = {}
    for chunk in (0, 5):
        (_, nll), g = jax.jit(jax.value_and_grad(functools.partial(loss, chunk=chunk),
                                                 has_aux=True))(variables)
        chex.assert_shape(nll, (2, T))
        assert np.linalg.norm(np.asarray(nll, np.float64) - ref) / np.linalg.norm(ref) < 1e-6, chunk
        grads[chunk] = g
    flat = {c: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)]) for c, g in grads.items()}
    assert np.linalg.norm(flat[5] - flat[0]) / np.linalg.norm(flat[0]) < 1e-6


def test_a_chunked_loss_keeps_a_chunk_of_the_logits_not_all_of_them():
    """The compiled loss-and-gradient program's scratch memory (XLA's CPU memory analysis): the
    (B, T, vocab) float32 logits (32 MiB here) and their gradient unchunked, a (B, chunk, vocab)
    slice of them chunked. Measured: 97 MiB against 43 MiB (39 at chunk 16, 67 at 128)."""
    from diff_jax.step import loss_and_grads

    cfg = _cfg("diff", vocab_size=8192, embed_dim=32, num_heads=2, num_kv_heads=2,
               max_seq_len=256)
    tokens = jnp.zeros((4, 256), jnp.int32)
    batch = {"tokens": tokens, "targets": tokens, "positions": jnp.broadcast_to(jnp.arange(256), (4, 256))}
    params = jax.eval_shape(lambda: nn.meta.unbox(DecoderLM(cfg).init(jax.random.key(0), tokens[:, :1])))["params"]

    def temp_bytes(chunk: int) -> int:
        model = DecoderLM(dataclasses.replace(cfg, loss_chunk=chunk))
        step = jax.jit(functools.partial(loss_and_grads, model=model, grad_accum=1))
        return step.lower(params, batch).compile().memory_analysis().temp_size_in_bytes

    full, chunked = temp_bytes(0), temp_bytes(32)
    logits = 4 * 256 * 8192 * 4
    assert full - chunked > 1.5 * logits, (full, chunked)


_NOT_IDS = r"targets must be \(B, T\) = \(2, 16\) integer ids, got "


@pytest.mark.parametrize("kw, says", [
    (dict(targets=jnp.zeros((2, T - 1), jnp.int32)), _NOT_IDS + "int32 of shape"),
    (dict(targets=jnp.zeros((2, T), jnp.float32)), _NOT_IDS + "float32 of shape"),
    (dict(targets=jnp.zeros((2, T), jnp.int32), logits_at=jnp.zeros((2, 1), jnp.int32)),
     "pass logits_at or targets, not both")])
def test_targets_that_are_not_one_id_per_token_are_refused(kw, says):
    model, variables, tokens = _init(_cfg("diff", num_layers=1))
    with pytest.raises(ValueError, match=says):
        model.apply(variables, tokens, **kw)


def test_a_whole_config_is_refused_naming_the_model_section():
    """`DecoderLM(load_config(...))` (a `Config`, not its `.model`) failed at init in an
    AttributeError on the first field it read."""
    from diff_jax.config import Config

    with pytest.raises(TypeError, match=r"^DecoderLM takes a ModelConfig \(a Config's \.model\), "
                                        r"got Config$"):
        DecoderLM(Config())


def test_the_readme_python_example_runs_as_its_comments_say(monkeypatch):
    """The README's "From Python" block, executed as written from the repository root: the
    shapes its comments state, 8 new tokens, and the fused kernel (here its interpreter) equal
    to the oracle to float32 rounding (1e-5 relative)."""
    from pathlib import Path

    root = Path(__file__).parents[1]
    text = (root / "README.md").read_text().split("\n## From Python\n", 1)[1]
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("    "))
    end = next(i for i in range(start, len(lines)) if lines[i] and not lines[i].startswith("    "))
    monkeypatch.chdir(root)
    names: dict = {}
    exec(compile("\n".join(line[4:] for line in lines[start:end]), "README.md", "exec"), names)
    tokens, config = names["tokens"], names["config"]
    assert tokens.shape == (1, 6) and names["logits"].shape == (1, 6, config.vocab_size)
    np.testing.assert_allclose(names["last"][0, 0], names["logits"][0, -1], rtol=1e-5, atol=1e-6)
    assert len(names["new"]) == 1 and len(names["new"][0]) == 8
    assert all(0 <= i < config.vocab_size for i in names["new"][0])
    out, ref = names["out"], names["ref"]
    assert out.shape == (1, 256, 2, 128)
    assert float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)) < 1e-5
