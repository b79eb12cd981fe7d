"""Read (model config, float32 parameters) from a training run, one of its checkpoints, or an export.

Training checkpoints are the orbax layout of `diff_jax.checkpoint`:
`<run_dir>/checkpoints/<step>/{state,data_iter,config}`, where `state` holds the train state (its
`params` are read alone) and `config` the resolved config as JSON. Exports carry `export.json`
(format, dtype, source) beside `config.json` (the model config) and their tensors.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import linen as nn

from diff_jax.config import ConfigError, ModelConfig, _build
from diff_jax.export.errors import ExportError
from diff_jax.export.safetensors_file import read_safetensors
from diff_jax.export.state_dict import check_shapes, from_state_dict
from diff_jax.transformer import DecoderLM

EXPORT_MARKER = "export.json"
CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
PARAMS_DIR = "params"


@dataclasses.dataclass(frozen=True)
class Source:
    """What was read: the model config, its float32 parameters, and where they came from."""

    config: ModelConfig
    params: dict[str, Any]
    origin: str  # the directory the parameters were read from
    step: int | None  # the training step, where known


def model_config_from_json(data: Any, where: str) -> ModelConfig:
    """A `ModelConfig` from its JSON dict; `ExportError` naming `where` when it is invalid."""
    if not isinstance(data, dict):
        raise ExportError(f"{where}: expected the model config as a JSON object, got {data!r}")
    try:  # the model section alone: train.seq_len etc. are not part of an export
        return _build(ModelConfig, data, "model")
    except ConfigError as e:
        raise ExportError(f"{where}: invalid model config: {e}") from e


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{'layers_0/attn/q_proj/kernel': shape, ...} of the parameters `config` describes."""
    boxed = jax.eval_shape(lambda: DecoderLM(config).init(jax.random.PRNGKey(0),
                                                           jnp.zeros((1, 1), jnp.int32)))["params"]
    is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)  # noqa: E731
    return _flat_shapes(jax.tree.map(lambda x: x.unbox(apply_constraint=False) if is_box(x) else x,
                                     boxed, is_leaf=is_box))


def _flat_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(str(getattr(k, "key", k)) for k in path): tuple(leaf.shape) for path, leaf in leaves}


def read_source(path: str | Path) -> Source:
    """Read an export directory, a run directory, its `checkpoints/` directory, or one step in it."""
    path = Path(path)
    if not path.exists():
        raise ExportError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise ExportError(f"{path}: expected a directory (a run, a checkpoint or an export)")
    if (path / EXPORT_MARKER).is_file():
        return _read_export(path)
    return _read_train_checkpoint(path)


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise ExportError(f"{path}: missing; the export is incomplete")
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"{path}: not valid JSON: {e}") from e


def _read_export(path: Path) -> Source:
    info = _read_json(path / EXPORT_MARKER)
    fmt = info.get("format") if isinstance(info, dict) else None
    if fmt not in ("safetensors", "orbax-params"):
        raise ExportError(f"{path / EXPORT_MARKER}: format {fmt!r} cannot be loaded back; "
                          "exports in formats safetensors and orbax-params can")
    config = model_config_from_json(_read_json(path / CONFIG_FILE), str(path / CONFIG_FILE))
    if fmt == "safetensors":
        file = path / SAFETENSORS_FILE
        if not file.is_file():
            raise ExportError(f"{file}: missing; the export is incomplete")
        tensors, _ = read_safetensors(file)
        params = jax.tree.map(jnp.asarray, from_state_dict(tensors, config, str(file)))
    else:
        params = _restore_params(path / PARAMS_DIR, config)
    step = info.get("step")
    return Source(config, params, str(path), step if isinstance(step, int) else None)


def _restore_params(path: Path, config: ModelConfig) -> dict[str, Any]:
    """A params-only orbax PyTree checkpoint -> float32 parameters, checked against `config`."""
    if not path.is_dir():
        raise ExportError(f"{path}: missing; the export is incomplete")
    checkpointer = ocp.PyTreeCheckpointer()
    try:
        saved = checkpointer.metadata(path).item_metadata
    except (OSError, ValueError) as e:
        raise ExportError(f"{path}: not a readable orbax checkpoint: {e}") from e
    check_shapes(_flat_shapes(saved), param_shapes(config), str(path))
    target, restore_args = _restore_target(saved)
    try:
        return checkpointer.restore(path, args=ocp.args.PyTreeRestore(target, restore_args))
    except (OSError, ValueError) as e:
        raise ExportError(f"{path}: could not read the parameters: {e}") from e


def _restore_target(saved: Any) -> tuple[Any, Any]:
    """Float32 targets on the default device for every array in the metadata tree `saved`."""
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, jnp.float32, sharding=sharding), saved)
    args = jax.tree.map(lambda m: ocp.ArrayRestoreArgs(sharding=sharding, dtype=jnp.float32), saved)
    return target, args


def _read_train_checkpoint(path: Path) -> Source:
    if (path / "checkpoints").is_dir():
        directory, step = path / "checkpoints", None
    elif path.name.isdigit() and ((path / "state").exists() or (path / "config").exists()):
        directory, step = path.parent, int(path.name)
    else:
        directory, step = path, None
    mngr = ocp.CheckpointManager(
        directory.resolve(), options=ocp.CheckpointManagerOptions(create=False, read_only=True),
        item_handlers={"state": ocp.PyTreeCheckpointHandler(), "config": ocp.JsonCheckpointHandler()})
    try:
        return _read_step(mngr, path, directory, step)
    finally:
        mngr.close()


def _read_step(mngr: ocp.CheckpointManager, path: Path, directory: Path, step: int | None) -> Source:
    steps = mngr.all_steps()
    unfinished = sorted(p.name for p in directory.iterdir() if "tmp" in p.name)
    hint = f"; unfinished save(s) there: {', '.join(unfinished)}" if unfinished else ""
    if step is None:
        if not steps:
            raise ExportError(
                f"{path}: no complete checkpoint in {directory}{hint}; expected a run directory "
                "(with checkpoints/), its checkpoints/ directory, one step in it, or an export "
                f"directory (with {EXPORT_MARKER})")
        step = max(steps)
    elif step not in steps:
        raise ExportError(f"{path}: not a complete checkpoint (complete steps in {directory}: "
                          f"{sorted(steps) or 'none'}){hint}")
    step_dir = directory / str(step)
    for item in ("state", "config"):
        if not (step_dir / item).is_dir():
            raise ExportError(f"{step_dir}: the checkpoint has no {item!r} item; it is partial "
                              "or was not written by diff_jax training")
    try:
        data = mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
    except (OSError, ValueError) as e:
        raise ExportError(f"{step_dir / 'config'}: could not read the saved config: {e}") from e
    model = data.get("model") if isinstance(data, dict) else None
    config = model_config_from_json(model, f"{step_dir / 'config'} (section model)")
    where = f"{step_dir / 'state'} params"
    state = mngr.item_metadata(step)["state"]
    if state is None or "params" not in state:
        raise ExportError(f"{where}: missing from the saved train state")
    saved = state["params"]
    check_shapes(_flat_shapes(saved), param_shapes(config), where)
    target, restore_args = _restore_target(saved)
    try:
        restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            {"params": target}, {"params": restore_args}, partial_restore=True)))
    except (OSError, ValueError) as e:
        raise ExportError(f"{where}: could not read the parameters: {e}") from e
    return Source(config, restored["state"]["params"], str(step_dir), step)
