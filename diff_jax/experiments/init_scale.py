"""What each sublayer of a freshly initialized model writes into the residual stream.

At initialization the token embedding (std `init_std`) is the only signal of which token stands
where. A sublayer that adds more than that to the residual stream at every position drowns it
until training shrinks the addition or makes it informative. DIFF V1 normalizes each head's
output (`subln`, unit RMS whatever the two softmax maps cancel) and scales it by (1 − λ_init),
so its attention writes about (1 − λ_init)·σ_o·√E at init (σ_o the output projection's std);
a standard attention writes a mix of the value vectors, whose average over the prefix shrinks
with its length. `residual_writes` measures both on real tokens.

    python -m diff_jax.experiments.init_scale PRESET [--init I] [--set model.KEY=VALUE ...]
                                                     [--variant diff|diff_v2]

prints the table for every model of a preset before anything trains (the replication's report
measures the same on its own corpus), with `--set` the changed `--variant` beside them: what an
ablation's setting does at init, e.g. at another preset's shape.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from diff_jax.command import as_ctrl_c, interrupted, leave
from diff_jax.config import ModelConfig
from diff_jax.transformer import DecoderLM, unstacked_layers


def _rms(x: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32))))


@functools.partial(jax.jit, static_argnames=("config", "seed"))
def _writes(tokens: jax.Array, config: ModelConfig, seed: int) -> dict[str, jax.Array]:
    """`residual_writes` as one program (op by op, a model's init and forward take seconds even
    when tiny); jax keeps it for each (config, seed, token shape) a process measures again."""
    model = DecoderLM(config)
    params = model.init(jax.random.key(seed), tokens[:1, :2])["params"]
    _, state = model.apply({"params": params}, tokens, capture_intermediates=lambda module,
                           method: method == "__call__" and module.name in ("attn", "ffn"))
    layers = unstacked_layers(state["intermediates"], config.num_layers)
    return {"embed": _rms(nn.meta.unbox(params)["embed"][tokens]),
            **{part: jnp.stack([_rms(layers[f"layers_{i}"][part]["__call__"][0])
                                for i in range(config.num_layers)])
               for part in ("attn", "ffn")}}


def residual_writes(config: ModelConfig, tokens: np.ndarray, seed: int = 0) -> dict[str, object]:
    """RMS of what a model initialized from `jax.random.key(seed)` adds to the residual stream
    on `tokens` (B, T) int: {"embed": the token embeddings', "attn": [per layer, the attention
    sublayer's output], "ffn": [per layer, the MLP's]}, each over every position and channel."""
    out = _writes(jnp.asarray(tokens, jnp.int32), config, seed)
    return {"embed": float(out["embed"]), "attn": [float(x) for x in out["attn"]],
            "ffn": [float(x) for x in out["ffn"]]}


ROWS = 8  # rows of `seq_len` tokens every model is measured on


def stdlib_rows(tokenizer: str, seq_len: int) -> np.ndarray:
    """(ROWS, seq_len) int32: the standard library's sources (`data.source=stdlib`'s documents,
    in order) under `tokenizer`, the first ROWS · seq_len tokens."""
    from diff_jax.data import encoding
    from diff_jax.data.sources import stdlib_documents

    enc, need, ids = encoding(tokenizer), ROWS * seq_len, []
    for text in stdlib_documents().texts:
        ids += enc.encode_ordinary(text)
        if len(ids) >= need:
            return np.asarray(ids[:need], np.int32).reshape(ROWS, seq_len)
    raise ValueError(f"the standard library holds fewer than {need:,} tokens")


def main(argv: list[str] | None = None) -> int:
    """The command line above; exit status 0, 2 on bad input (one `error:` line), 130 after
    Ctrl-C (one `interrupted:` line)."""
    from diff_jax import train_loop
    from diff_jax.config import ConfigError
    from diff_jax.experiments.ablate import check_sets, label
    from diff_jax.experiments.lm_report import init_scale_table
    from diff_jax.experiments.presets import INITS, LABELS, PRESETS, VARIANTS, Preset

    parser = argparse.ArgumentParser(prog="python -m diff_jax.experiments.init_scale",
                                     description="What each sublayer of every model of a preset "
                                                 "adds to the residual stream at initialization.")
    parser.add_argument("preset", help=", ".join(p for p in PRESETS
                                                 if isinstance(PRESETS[p], Preset)))
    parser.add_argument("--init", default=None, help=f"one of {', '.join(INITS)} (default: the "
                        "preset's own)")
    parser.add_argument("--set", action="append", default=[], dest="sets",
                        help="model.KEY=VALUE for --variant, shown beside the others (repeatable)")
    parser.add_argument("--variant", default="diff", help="diff (default) or diff_v2")
    args = parser.parse_args(argv)
    try:
        preset = PRESETS.get(args.preset)
        if not isinstance(preset, Preset):
            raise ConfigError(f"preset {args.preset!r}: expected one of "
                              f"{', '.join(p for p in PRESETS if isinstance(PRESETS[p], Preset))}")
        init = args.init or preset.inits[0]
        if init not in INITS:
            raise ConfigError(f"--init {init}: expected one of {', '.join(INITS)}")
        if args.variant not in ("diff", "diff_v2"):
            raise ConfigError(f"--variant {args.variant}: expected one of diff, diff_v2")
        sets = tuple(args.sets)
        if sets:
            check_sets(sets)
            other = [x for x in sets if not x.startswith("model.")]
            if other:
                raise ConfigError(f"--set {other[0]}: only model.* settings change a model at "
                                  "initialization")
        where = Path("init_scale")  # names no file: the configs' run directories are not made
        configs = [(LABELS[v], preset.config(v, 0, where, init)) for v in VARIANTS]
        if sets:
            configs.append((label(args.variant, sets),
                            preset.config(args.variant, 0, where, init, sets)))
        seq_len, tokenizer = configs[0][1].train.seq_len, configs[0][1].data.tokenizer
        rows = stdlib_rows(tokenizer, seq_len)
        models = [(name, residual_writes(cfg.model, rows)) for name, cfg in configs]
        command = " ".join(["python -m diff_jax.experiments.init_scale", preset.name, "--init",
                            init, *(x for setting in sets for x in ("--set", setting)),
                            *(["--variant", args.variant] if sets else [])])
        with as_ctrl_c(signals=()):  # a closed stdout (`| head`) is a Ctrl-C; SIGTERM as it was
            print(f"# `{preset.name}`, init `{init}`: what each sublayer adds to the residual "
                  f"stream at initialization\n\nGenerated by `{command}`.\n")
            print("\n".join(init_scale_table(models, seq_len,
                                              f"the standard library under {tokenizer}")))
    except train_loop.RUN_ERRORS as e:
        return train_loop.report(e, [])
    except KeyboardInterrupt:
        return interrupted("stopped at once (it writes no file)")
    return 0


if __name__ == "__main__":
    leave(main())
