"""`make_optimizer` against a float64 NumPy AdamW written from the equations.

The reference (Loshchilov & Hutter's decoupled AdamW with Adam's bias correction, after global-norm
clipping) takes nothing from diff_jax or optax: the learning rate at each step, the clipping, the
moments and which leaves decay are all written out here from the config's documented meaning.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diff_jax import optim
from diff_jax.config import ConfigError, OptimConfig, load_config
from diff_jax.optim import make_optimizer

# Leaves named as in DecoderLM's params (DIFF V1, one layer), with whether each one decays under
# the default config: matrices decay; the embedding, norm scales and λ vectors do not.
SHAPES = {
    ("embed",): ((11, 8), "embedding"),
    ("layers_0", "attn", "q_proj", "kernel"): ((8, 8), "matrix"),
    ("layers_0", "attn", "k_proj", "kernel"): ((8, 4), "matrix"),
    ("layers_0", "attn", "lambda_q1"): ((2,), "norm_or_lambda"),
    ("layers_0", "attn", "lambda_k2"): ((2,), "norm_or_lambda"),
    ("layers_0", "attn", "subln", "scale"): ((4,), "norm_or_lambda"),
    ("layers_0", "attn_norm", "scale"): ((8,), "norm_or_lambda"),
    ("layers_0", "ffn", "w_down", "kernel"): ((16, 8), "matrix"),
    ("norm", "scale"): ((8,), "norm_or_lambda"),
    ("lm_head",): ((8, 11), "matrix"),  # an untied head decays, unlike the embedding
}
# Global gradient norms per step: above and below clip_norm=1, and varying, so that clipping
# changes Adam's update (a constant rescaling of every step's gradient would nearly cancel in
# m / sqrt(v)).
GRAD_NORMS = (8.0, 0.25, 3.0, 0.5, 20.0, 0.1, 5.0)


def _nest(flat: dict) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def _flat(tree: dict, prefix=()) -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, prefix + (key,)))
        else:
            out[prefix + (key,)] = value
    return out


def _reference_lr(cfg: OptimConfig, total_steps: int, step: int) -> float:
    """The learning rate of update number `step` (0-based): linear warmup from 0 over
    `warmup_steps` updates; lr until the last `decay_steps` updates before `total_steps` (all
    the updates after the warmup when it is None), over which it falls from lr to min_lr
    linearly, along a half cosine or as 1 - sqrt(fraction); held at min_lr after; or constant
    lr."""
    w = cfg.warmup_steps
    if step < w:
        return cfg.lr * step / w
    d = max(total_steps - w, 1) if cfg.decay_steps is None else cfg.decay_steps
    start = max(total_steps, w + 1) - d  # the decay's first update
    if cfg.schedule == "constant" or step < start:
        return cfg.lr
    frac = min(step - start, d) / d
    shape = {"linear": 1 - frac, "cosine": 0.5 * (1 + math.cos(math.pi * frac)),
             "one_minus_sqrt": 1 - math.sqrt(frac)}[cfg.schedule]
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * shape


def _reference_adamw(cfg: OptimConfig, total_steps: int, params: dict, grads: list[dict]) -> dict:
    """Float64 AdamW: g <- g * min(1, c / ||g||_global) (c = clip_norm, 0: no clipping);
    m <- b1 m + (1 - b1) g; v <- b2 v + (1 - b2) g^2; m^ = m / (1 - b1^t); v^ = v / (1 - b2^t);
    p <- p - lr_t (m^ / (sqrt(v^) + eps) + wd p [decaying leaves only])."""
    decays = {k: {"matrix": True, "embedding": cfg.decay_embeddings,
                  "norm_or_lambda": cfg.decay_norms_and_lambdas}[kind]
              for k, (_, kind) in SHAPES.items()}
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v2 = {k: np.zeros_like(v) for k, v in p.items()}
    for i, g in enumerate(grads):
        t = i + 1
        g = {k: np.asarray(x, np.float64) for k, x in g.items()}
        norm = math.sqrt(sum(float(np.sum(x * x)) for x in g.values()))
        if cfg.clip_norm > 0 and norm > cfg.clip_norm:
            g = {k: x * (cfg.clip_norm / norm) for k, x in g.items()}
        lr = _reference_lr(cfg, total_steps, i)
        for k in p:
            m[k] = cfg.b1 * m[k] + (1 - cfg.b1) * g[k]
            v2[k] = cfg.b2 * v2[k] + (1 - cfg.b2) * g[k] ** 2
            m_hat = m[k] / (1 - cfg.b1 ** t)
            v_hat = v2[k] / (1 - cfg.b2 ** t)
            update = m_hat / (np.sqrt(v_hat) + cfg.eps)
            if decays[k]:
                update = update + cfg.weight_decay * p[k]
            p[k] = p[k] - lr * update
    return p


@pytest.mark.parametrize("cfg", [
    OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=2, schedule="linear", b1=0.8, b2=0.95,
                eps=1e-6, weight_decay=0.3, clip_norm=1.0),
    OptimConfig(lr=2e-2, min_lr=2e-3, warmup_steps=3, schedule="cosine", weight_decay=0.2,
                clip_norm=1.0, decay_norms_and_lambdas=True),
    OptimConfig(lr=1e-2, min_lr=0.0, warmup_steps=0, schedule="constant", weight_decay=0.2,
                clip_norm=0.0, decay_embeddings=True),
    OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=1, schedule="one_minus_sqrt",
                decay_steps=3, weight_decay=0.1),
], ids=["linear", "cosine-decay-norms", "constant-noclip-decay-embed", "wsd-one-minus-sqrt"])
def test_updates_equal_float64_adamw_from_the_equations(cfg):
    total_steps = 5  # fewer than the updates applied: the decay's end (held at min_lr) is reached
    rng = np.random.default_rng(0)
    params = {k: rng.normal(0, 1, shape).astype(np.float32) for k, (shape, _) in SHAPES.items()}
    grads = []
    for norm in GRAD_NORMS:
        g = {k: rng.normal(0, 1, shape) for k, (shape, _) in SHAPES.items()}
        total = math.sqrt(sum(float(np.sum(x * x)) for x in g.values()))
        grads.append({k: (x * norm / total).astype(np.float32) for k, x in g.items()})

    tx = make_optimizer(cfg, total_steps)
    state = tx.init(_nest({k: jnp.asarray(v) for k, v in params.items()}))

    @jax.jit
    def step(p, g, s):
        updates, s = tx.update(g, s, p)
        return jax.tree.map(lambda a, b: a + b, p, updates), s

    p = _nest({k: jnp.asarray(v) for k, v in params.items()})
    for g in grads:
        p, state = step(p, _nest({k: jnp.asarray(v) for k, v in g.items()}), state)
    got = {k: np.asarray(v) for k, v in _flat(p).items()}
    want = _reference_adamw(cfg, total_steps, params, grads)

    for k in SHAPES:
        # float32 storage rounds the params (|p| up to ~3) at each of the 7 updates: measured max
        # |got - want| 3.8e-7, ~0.11 of this tolerance (float32 ~1e-6). A dropped decay mask or
        # clipping that never applies moves the params by ~1e-3 or more.
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6, err_msg="/".join(k))


@pytest.mark.parametrize("shape,warmup,decay,total", [
    (shape, *sizes) for shape in ("linear", "cosine", "one_minus_sqrt", "constant")
    for sizes in ((0, None, 9), (3, None, 12), (3, 4, 12), (0, 5, 9), (2, 10, 12), (4, None, 3))
    if shape != "constant" or sizes[1] is None])  # constant with decay_steps: a config error
def test_the_schedule_is_warmup_stable_decay_from_the_equations(shape, warmup, decay, total):
    """Every update's rate, and 5 past `total_steps`, equals `_reference_lr` (float32: 1e-6);
    with `decay_steps` the rate is lr exactly from the warmup's end to the decay's start."""
    cfg = OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=warmup, schedule=shape,
                      decay_steps=decay)
    lr = optim.schedule(cfg, total)
    got = np.array([float(lr(t)) for t in range(total + 5)])
    want = np.array([_reference_lr(cfg, total, t) for t in range(total + 5)])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)
    if decay is not None:
        assert (got[warmup:total - decay + 1] == np.float32(3e-3)).all()  # stable, decay's s = 0
        assert abs(got[total] - 3e-4) < 1e-9


def test_a_longer_run_keeps_the_stable_phase_it_has_trained():
    """Warmup-stable-decay: raising train.steps moves the decay, not the rates before it, so a
    run resumed with more steps during its stable phase continues as if it had been planned so
    (the linear schedule without decay_steps changes every rate after the warmup)."""
    wsd = OptimConfig(lr=1e-3, min_lr=0.0, warmup_steps=10, decay_steps=20)
    short, longer = optim.schedule(wsd, 100), optim.schedule(wsd, 400)
    assert all(float(short(t)) == float(longer(t)) for t in range(80))
    plain = OptimConfig(lr=1e-3, min_lr=0.0, warmup_steps=10)
    assert float(optim.schedule(plain, 100)(50)) != float(optim.schedule(plain, 400)(50))


@pytest.mark.parametrize("overrides,message", [
    (["optim.decay_steps=0"], "optim.decay_steps: must be in [2, "),
    # the decay's first step runs at lr: one step would decay nothing (it was accepted, and the
    # run's last step ran at lr)
    (["optim.decay_steps=1"], "optim.decay_steps: must be in [2, 2147483647] or null (every step "
                              "after the warmup): the decay's first step runs at optim.lr, so 1 "
                              "would decay nothing"),
    (["optim.schedule=constant", "optim.decay_steps=5"],
     "optim.decay_steps: has nothing to decay with optim.schedule=constant"),
    (["train.steps=20", "optim.warmup_steps=10", "optim.decay_steps=11"],
     "optim.decay_steps: 11 plus optim.warmup_steps=10 is more than train.steps=20"),
    (["optim.schedule=wsd"], "optim.schedule"),
])
def test_a_decay_that_cannot_be_is_one_config_error(overrides, message):
    with pytest.raises(ConfigError) as failed:
        load_config(None, overrides)
    assert message in str(failed.value)
