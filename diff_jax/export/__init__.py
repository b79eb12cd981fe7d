"""Export a trained diff-jax model, and load exports (and training checkpoints) back.

    python -m diff_jax.export RUN_OR_CHECKPOINT --format safetensors|orbax-params|hf-diffllama \\
        --out DIR [--dtype bfloat16] [--overwrite]

- `safetensors`: `model.safetensors` with PyTorch-layout (out, in) tensors under the names of
  `diff_jax.export.state_dict` (the V1 attention tensors are the reference module's state dict),
  the model config as JSON in its metadata (`model_config`) and in `config.json` (loading
  builds the model from `config.json` and refuses one that gives another model than the
  metadata).
- `orbax-params`: a parameters-only orbax checkpoint (`params/`) and `config.json`, for inference.
- `hf-diffllama`: a `transformers` `DiffLlamaForCausalLM` directory (DIFF V1 only; see
  `diff_jax.export.hf` for the mapping and what is refused), with Hugging Face tokenizer files
  equal to the tiktoken encoding `--tokenizer` (default: the run's `data.tokenizer`, recorded in
  the exports made from it; for an import, the tokenizer.json it recorded where that file is
  unchanged, else none, with a note; `none` for none; see `diff_jax.export.tokenizer`).

Every format also writes `checksums.json`, the checksum of each stored tensor and of the JSON
of `config.json` and `export.json` (the training checkpoints' own), which loading verifies
(`diff_jax.export.sources`).

`python -m diff_jax.export.hf_import HF_DIR --out DIR` is the other direction: a local
`DiffLlamaForCausalLM` or `LlamaForCausalLM` checkpoint to an orbax-params export
(`diff_jax.export.hf_import`). Safetensors files are written and read with the `safetensors`
package (`diff_jax.export.safetensors_io`).

Every export also holds `export.json` (format, dtype, source, step, the run's data.tokenizer, and
the run's data section, train.seed and train.seq_len: `eval.py checkpoint=EXPORT` holds out the
run's own validation documents).
`load(PATH)` reads a safetensors or orbax-params export, a run directory (its latest checkpoint),
its `checkpoints/` directory, or one checkpoint step, and returns (model config, float32
parameters), on the first device or, `load(PATH, mesh)`, sharded over a mesh.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jax.sharding import Mesh

from diff_jax.config import DEFAULT_RULES, ModelConfig
from diff_jax.export.errors import ExportError
from diff_jax.export.sources import read_source
from diff_jax.export.state_dict import from_state_dict, state_dict_shapes, to_state_dict
from diff_jax.export.writer import DTYPES, FORMATS, export
from diff_jax.sharding import Rules

__all__ = ["DTYPES", "FORMATS", "ExportError", "export", "from_state_dict", "load",
           "state_dict_shapes", "to_state_dict"]


def load(path: str | Path, mesh: Mesh | None = None,
         rules: Rules = DEFAULT_RULES) -> tuple[ModelConfig, dict[str, Any]]:
    """(model config, float32 parameter tree for `DecoderLM.apply({"params": ...})`) from `path`
    (a run, one of its steps or an export), on this process's first device, or sharded over
    `mesh` (`diff_jax.sharding.make_mesh`) by the logical-axis `rules` as training shards them
    (apply the model inside `jax.set_mesh(mesh)` and `flax.linen.logical_axis_rules(rules)`);
    `ShardingError` naming a parameter whose dimension its mesh axes do not divide."""
    source = read_source(path, mesh, rules)
    return source.config, source.params
