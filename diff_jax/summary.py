"""Model size and cost from a config, without allocating anything.

    python -m diff_jax.summary CONFIG [key=value ...]
    python -m diff_jax.summary --config CONFIG [key=value ...]   # as train.py takes it

prints one JSON object. Parameter counts come from `jax.eval_shape` of the real `init`.

`flops_per_token` counts training model FLOPs (forward + backward = 3 × forward, one multiply-add
= 2 FLOPs) at `train.seq_len` = T:
  6 · N_matmul                          every projection and the LM head (E·V, tied or not)
  + 6 · L · T_eff · (W_qk + W_v)        attention scores and the value product
with T_eff = (T + 1) / 2 (the mean number of keys a causal query reads), W_qk = the summed width
of all query·key dot products of a token (DIFF: 2H·d = E; V2: 2h·d; Transformer: H·d_head) and
W_v = the summed width of the value products (DIFF: H·2d, one product with (A1 − λA2) per
head; V2: 2h·d; Transformer: H·d_head). A DIFF model and its Transformer twin therefore have
equal model FLOPs, as the paper's matched comparison intends; the fused kernel's extra work
(two value products per DIFF head, see `kernels`) is hardware cost, not model FLOPs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax
import jax.numpy as jnp

from diff_jax import variants
from diff_jax.command import concluded, failed, leave
from diff_jax.attention import lambda_init
from diff_jax.config import Config, ModelConfig, load_config
from diff_jax.sharding import unboxed
from diff_jax.transformer import DecoderLM


def boxed_params(config: ModelConfig) -> dict:
    """The parameter tree as ShapeDtypeStructs (float32) still boxed with their logical axis
    names (`nn.LogicallyPartitioned`), for `sharding.tree_shardings`; nothing is allocated.
    The shapes do not depend on `model.attention_impl`, so the init is traced with the xla op: a
    config for other devices (cudnn on a CPU machine) counts."""
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    traced = dataclasses.replace(config, attention_impl="xla")
    return jax.eval_shape(DecoderLM(traced).init, jax.random.key(0), tokens)["params"]


def abstract_params(config: ModelConfig, sharding: jax.sharding.Sharding | None = None) -> dict:
    """The parameter tree as ShapeDtypeStructs (float32), each with `sharding` if given.

    The logical-axis boxes are removed without sharding constraints, so this also works inside
    a mesh context (`boxed_params`)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                        unboxed(boxed_params(config)))


def flops_per_token(config: ModelConfig, seq_len: int, params: dict | None = None) -> float:
    """Training model FLOPs per token at sequence length `seq_len` (see the module docstring),
    counted on `params` (boxed, as `init` returns them, or not; None: `abstract_params`)."""
    params = abstract_params(config) if params is None else unboxed(params)
    n_matmul = sum(
        leaf.size for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
        if getattr(path[-1], "key", None) in ("kernel", "lm_head")
    )
    if config.tie_embeddings:
        n_matmul += config.vocab_size * config.embed_dim
    w_qk, w_v = variants.spec(config.variant).layout(config).attention_widths
    t_eff = (seq_len + 1) / 2
    return 6.0 * n_matmul + 6.0 * config.num_layers * t_eff * (w_qk + w_v)


def summarize(config: Config) -> dict:
    """Sizes, parameter counts and training FLOPs of `config` (the JSON `main` prints); λ_init
    per layer for a variant whose λ is a layer scalar, else None."""
    m = config.model
    params = abstract_params(m)
    total = sum(leaf.size for leaf in jax.tree.leaves(params))
    embedding = params["embed"].size + (0 if m.tie_embeddings else params["lm_head"].size)
    return {
        "variant": m.variant,
        "params": int(total),
        "params_embedding": int(embedding),
        "params_non_embedding": int(total - embedding),
        "layers": m.num_layers,
        "embed_dim": m.embed_dim,
        "heads": m.num_heads,
        "kv_heads": m.kv_heads,
        "head_dim": m.resolved_head_dim,
        "mlp_dim": m.resolved_mlp_dim,
        "seq_len": config.train.seq_len,
        "flops_per_token": flops_per_token(m, config.train.seq_len, params),
        "tokens_per_step": config.train.batch_size * config.train.seq_len,
        "lambda_init": ([lambda_init(i, m.lambda_init) for i in range(m.num_layers)]
                        if variants.spec(m.variant).differential_op else None),
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m diff_jax.summary [--config] CONFIG [key=value ...]`: print `summarize` as JSON;
    2 on a config error (one `error:` line), 130 after Ctrl-C (one `interrupted:` line)."""
    doc = __doc__.strip().splitlines()
    parser = argparse.ArgumentParser(
        prog="python -m diff_jax.summary", description=doc[0],
        usage="python -m diff_jax.summary [--config] CONFIG [key=value ...]")
    parser.add_argument("--config", help="YAML config file or a shipped config's name (or give it "
                        "as the first argument)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="section.key=value overrides")
    args = parser.parse_intermixed_args(argv)  # overrides before and after --config
    overrides = args.overrides
    if args.config is None:
        if not overrides or "=" in overrides[0]:
            parser.print_usage(sys.stderr)
            return failed("no config file: give CONFIG or --config CONFIG")
        args.config, *overrides = overrides
    return concluded(lambda: print(json.dumps(summarize(load_config(args.config, overrides)),
                                              indent=2)), None)


if __name__ == "__main__":
    leave(main())
