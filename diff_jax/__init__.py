"""diff-jax: the Differential Transformer (Ye et al., ICLR 2025) in JAX/Flax.

The model's classes and the config loader are read from their modules on first use, so that
`diff_jax.kernels` (the attention kernels, which need only jax) imports without Flax.
"""

import importlib

from diff_jax.platforms import default_to_cpu_without_accelerators

default_to_cpu_without_accelerators()  # before JAX reads its configuration (see platforms.py)

_PUBLIC = {  # name -> the module that defines it
    "MultiheadAttention": "diff_jax.attention", "MultiheadDiffAttn": "diff_jax.attention",
    "MultiheadDiffAttnV2": "diff_jax.attention", "lambda_init": "diff_jax.attention",
    "Config": "diff_jax.config", "ConfigError": "diff_jax.config",
    "ModelConfig": "diff_jax.config", "load_config": "diff_jax.config",
    "DecoderLayer": "diff_jax.transformer", "DecoderLM": "diff_jax.transformer",
    "layer_lambdas": "diff_jax.transformer",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    """`diff_jax.DecoderLM` and the other public names, imported from their module on first use."""
    if name not in _PUBLIC:
        raise AttributeError(f"module 'diff_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
