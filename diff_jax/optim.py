"""The optimizer: AdamW with warmup, stable and decay phases, global-norm clipping, decay masks.

Weight decay applies to matrices (projections, LM head); norms, λ vectors and the embedding are
exempt unless `optim.decay_norms_and_lambdas` / `optim.decay_embeddings` say otherwise.
Gradient accumulation is not an optimizer wrapper here: the train step sums micro-batch
gradients itself (`diff_jax.step.loss_and_grads`) and applies one update.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from diff_jax.config import OptimConfig
from diff_jax.transformer import LAYERS


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """The learning rate of update number t (0-based, as optax counts): linear warmup 0 -> lr
    over `warmup_steps`; then lr held until the decay's D last steps (D = `decay_steps`, or
    every step after the warmup), over which it falls to `min_lr` linearly, along a half cosine,
    or as 1 − √(s/D) (the cooldown of warmup-stable-decay runs), s counting from the decay's
    start; min_lr after `total_steps`. `constant`: lr after the warmup."""
    lr, low = cfg.lr, cfg.min_lr
    length = max(total_steps - cfg.warmup_steps, 1)
    span = length if cfg.decay_steps is None else min(cfg.decay_steps, length)
    if cfg.schedule == "linear":
        decay = optax.linear_schedule(lr, low, span)
    elif cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(lr, span, alpha=low / lr)
    elif cfg.schedule == "one_minus_sqrt":
        def decay(count):
            return low + (lr - low) * (1 - jnp.sqrt(jnp.clip(count / span, 0.0, 1.0)))
    else:
        decay = optax.constant_schedule(lr)
    parts, boundaries = [], []
    if cfg.warmup_steps:
        parts.append(optax.linear_schedule(0.0, lr, cfg.warmup_steps))
        boundaries.append(cfg.warmup_steps)
    if span < length:  # the stable phase
        parts.append(optax.constant_schedule(lr))
        boundaries.append(cfg.warmup_steps + length - span)
    if not parts:
        return decay
    return optax.join_schedules([*parts, decay], boundaries)


def decay_mask(params: Any, cfg: OptimConfig) -> Any:
    """True for leaves that get weight decay: matrices. A leaf of the scanned layers
    (`model.scan_layers`) counts its dimensions without the stacked `layers` axis, so each
    parameter decays as it does in the unrolled model."""

    def decays(path: tuple, leaf: Any) -> bool:
        names = [str(getattr(k, "key", k)) for k in path]
        name = names[-1]
        if name == "embed":
            return cfg.decay_embeddings
        ndim = leaf.ndim - (LAYERS in names[:-1])
        if name.startswith("lambda") or name in ("scale", "weight") or ndim < 2:
            return cfg.decay_norms_and_lambdas
        return True

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """clip_by_global_norm (when clip_norm > 0) then AdamW; build it once per run."""
    adamw = optax.adamw(schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=lambda p: decay_mask(p, cfg))
    if cfg.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
    return adamw
