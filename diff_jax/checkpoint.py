"""Checkpoints with orbax: train state, data-iterator state and the resolved config, saved async.

Layout: `<train.run_dir>/checkpoints/<step>/{state,data_iter,config}`. Orbax commits a step
atomically (a step directory appears only once complete), so a crash mid-save leaves the last
good checkpoint as the latest. The state is restored onto whatever mesh is live: the restore
target carries the new shardings. A checkpoint whose parameter shapes disagree with the config
is refused before anything is read, naming the parameter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from diff_jax.config import CheckpointConfig, Config


class CheckpointError(ValueError):
    """A checkpoint does not match the model the config describes."""


def manager(run_dir: str | Path, cfg: CheckpointConfig) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, create=True,
                                           enable_async_checkpointing=cfg.async_save)
    return ocp.CheckpointManager(Path(run_dir).resolve() / "checkpoints", options=options,
                                 item_names=("state", "data_iter", "config"))


def save(mngr: ocp.CheckpointManager, step: int, state: Any, data_iter: grain.DatasetIterator,
         config: Config) -> None:
    """Start saving `step` (async when configured); `mngr.wait_until_finished()` before exit."""
    mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data_iter=grain.checkpoint.CheckpointSave(data_iter),
        config=ocp.args.JsonSave(config.to_dict()),
    ), force=True)


def check_shapes(saved: Any, target: Any) -> None:
    """Raise `CheckpointError` naming the first parameter whose shape differs or is missing."""
    saved_leaves = dict(jax.tree_util.tree_flatten_with_path(saved)[0])
    target_leaves = dict(jax.tree_util.tree_flatten_with_path(target)[0])
    for path, leaf in target_leaves.items():
        name = "params" + jax.tree_util.keystr(path)
        if path not in saved_leaves:
            raise CheckpointError(f"checkpoint has no {name}; it was written for another model")
        shape = tuple(saved_leaves[path].shape)
        if shape != tuple(leaf.shape):
            raise CheckpointError(f"checkpoint {name} has shape {shape} but the config gives "
                                  f"{tuple(leaf.shape)}; the model config differs from the run's")
    for path in saved_leaves.keys() - target_leaves.keys():
        raise CheckpointError(f"checkpoint has params{jax.tree_util.keystr(path)}, which the "
                              "config's model does not; it was written for another model")


def restore(mngr: ocp.CheckpointManager, step: int, target: Any,
            data_iter: grain.DatasetIterator) -> Any:
    """Restore `step` onto the shardings in `target` (ShapeDtypeStructs); sets `data_iter`'s state."""
    check_shapes(mngr.item_metadata(step)["state"]["params"], target.params)
    restored = mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target),
        data_iter=grain.checkpoint.CheckpointRestore(data_iter),
    ))
    return restored["state"]

