"""`train.init_from=PATH`: start a fresh training run (fine-tuning) from existing parameters.

PATH is anything `diff_jax.export.load` reads: an export (orbax-params or safetensors, e.g. one
written by `diff_jax.export.hf_import`), a run directory, or one of its checkpoint steps. Only the
parameters are taken: the step, the optimizer state and the data position start afresh. The
config's model must be the one the parameters were saved for; fields that change what the
parameters compute are compared one by one (compute dtype, attention implementation, remat,
scan_layers, loss_chunk, max_seq_len and init_std may differ), and `data.tokenizer` must be the
tokenizer the parameters were trained with, where they record it; both are checked before the
run reads any data. A run that already has checkpoints resumes from them and ignores
`train.init_from`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np

from diff_jax.config import ConfigError, ModelConfig
from diff_jax.data.tokenizer import encoding, mismatch
from diff_jax.export.errors import ExportError
from diff_jax.export.sources import Source, read_source
from diff_jax.transformer import in_layout


def check_same_model(saved: ModelConfig, config: ModelConfig, where: str) -> None:
    """`ConfigError` naming the first field where `config` computes differently from `saved`
    (`ModelConfig.difference`)."""
    differs = config.difference(saved)
    if differs is not None:
        key, theirs, ours = differs
        raise ConfigError(f"train.init_from: {where} holds a model with {key}={theirs} but the "
                          f"config gives {ours}; set {key}={theirs} (and the rest of its model "
                          "section) to fine-tune it")


def starting_point(path: str | Path, config: ModelConfig, tokenizer: str | None = None) -> Source:
    """The parameters at `path` (`read_source`), checked against `config`; with `tokenizer`
    (the run's `data.tokenizer`), parameters that record the tokenizer they were trained with
    (`Source.trained_tokenizer`) and another one are a `ConfigError`: their embedding rows are
    that tokenizer's ids. The training loop calls it before it reads any data, so that a
    refusal does not wait for a corpus to be tokenized."""
    try:
        with jax.set_mesh(None):  # read on this process's first device, not on the training mesh
            source = read_source(path)
    except ExportError as e:
        raise ConfigError(f"train.init_from: {e}") from e
    check_same_model(source.config, config, str(path))
    if tokenizer is not None and source.trained_tokenizer is not None:
        problem = mismatch(source.trained_tokenizer, encoding(tokenizer), str(path), "trained")
        if problem is not None:
            raise ConfigError(f"train.init_from: {problem}")
    return source


def initial_params(start: str | Path | Source, config: ModelConfig, shardings: Any,
                   tokenizer: str | None = None) -> Any:
    """The float32 parameters at `start` (a path, read and checked by `starting_point` with
    `tokenizer`, or its `Source`), placed on `shardings` (a tree of `jax.sharding.Sharding`
    matching the parameter tree; every process reads the path)."""
    source = start if isinstance(start, Source) else starting_point(start, config, tokenizer)

    def place(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    # the other layer layout (`model.scan_layers`) is sliced or stacked on the host: jax refuses
    # to index or stack arrays of the reading device under a training mesh of several devices
    # (before: "Received incompatible devices for jitted computation" on a 2x2x2 mesh)
    host = jax.tree.map(lambda value: np.asarray(value, np.float32), source.params)
    return jax.tree.map(place, in_layout(host, config), shardings)
