"""diff-jax: the Differential Transformer (Ye et al., ICLR 2025) in JAX/Flax."""

from diff_jax.platforms import default_to_cpu_without_accelerators

default_to_cpu_without_accelerators()  # before JAX reads its configuration (see platforms.py)

from diff_jax.attention import (  # noqa: E402
    MultiheadAttention, MultiheadDiffAttn, MultiheadDiffAttnV2, lambda_init)
from diff_jax.config import Config, ConfigError, ModelConfig, load_config  # noqa: E402
from diff_jax.transformer import DecoderLayer, DecoderLM, layer_lambdas  # noqa: E402

__all__ = [
    "Config", "ConfigError", "DecoderLM", "DecoderLayer", "ModelConfig", "MultiheadAttention",
    "MultiheadDiffAttn", "MultiheadDiffAttnV2", "lambda_init", "layer_lambdas", "load_config",
]
