"""Evaluate a checkpoint: python -m diff_jax.eval task=NAME train.run_dir=RUN [key=value ...]

Where diff-jax is installed and from a clone's root alike; a clone's `python eval.py` is the same
command.
Tasks: ppl, score (input=FILE), niah, recall, attention, outliers, quant, generate (prompt="..."
or input=PROMPTS.jsonl), choice (input=ITEMS.jsonl), icl (input=EXAMPLES.jsonl);
or checkpoint=PATH (a run, a step directory RUN/checkpoints/N, or a safetensors or orbax-params
export) instead of train.run_dir, and step=N for another step of a run. Writes RUN/eval/NAME.json
(a step named by step=N or its directory: RUN/eval/step-N/NAME.json; out_dir=DIR: DIR/NAME.json).
It runs on the first device; mesh.* shards the parameters over this machine's devices
(mesh.data=1 mesh.fsdp=-1: each parameter split over all of them).
Every task's keys and defaults: docs/evaluation.md in diff-jax's source, which the package does
not install (a key no task takes is refused with the list of those that are). Exit status: 0
done, 2 bad input (arguments, config, a missing or damaged checkpoint, a file that cannot be read
or written, a task too big for the devices' memory), 1 a result that is NaN (the JSON is still
written), 130 stopped by Ctrl-C or by stdout's reader gone, `| head` (each result file is whole:
this run's or the earlier one).
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from diff_jax.checkpoint import CheckpointError, quiet_abandoned_io
from diff_jax.command import (EXIT_BAD_INPUT, EXIT_NON_FINITE, as_ctrl_c, concluded, failed,
                              interrupted, leave)
from diff_jax.config import ConfigError
from diff_jax.data import DataError
from diff_jax.device_memory import DeviceMemoryError
from diff_jax.evaluation import EvalError, run
from diff_jax.evaluation.options import PATH_OPTIONS
from diff_jax.file_errors import describe
from diff_jax.sharding import ShardingError

PATH_KEYS = ("train.run_dir", *PATH_OPTIONS)  # the keys naming files


def nan_fields(value: Any, key: str = "") -> list[str]:
    """The dotted keys (with [i] for list items) of every NaN float in a task's JSON fields."""
    if isinstance(value, float):
        return [key] if math.isnan(value) else []
    if isinstance(value, dict):
        return [k for name, v in value.items()
                for k in nan_fields(v, f"{key}.{name}" if key else name)]
    if isinstance(value, list):
        return [k for i, v in enumerate(value) for k in nan_fields(v, f"{key}[{i}]")]
    return []


def main(argv: list[str] | None = None) -> int:
    """The command line above (`argv`: None reads sys.argv); returns the exit status."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):  # `--help | head` too is one line, no traceback
        return concluded(lambda: print(__doc__), None) or (0 if args else EXIT_BAD_INPUT)
    try:
        with as_ctrl_c(signals=()):  # a closed stdout (`| head`) is a Ctrl-C; SIGTERM as it was
            path = run(args)
    except (ConfigError, CheckpointError, DataError, EvalError, DeviceMemoryError,
            ShardingError) as e:
        quiet_abandoned_io()  # a damaged checkpoint's reads: this line stays the last
        return failed(str(e))
    except OSError as e:  # an output directory or file that cannot be made or written
        quiet_abandoned_io()
        named = [(arg, arg.partition("=")[2]) for arg in args
                 if arg.partition("=")[0].strip() in PATH_KEYS]
        return failed(describe(e, named))
    except KeyboardInterrupt:
        return interrupted("stopped at once; each result file is whole (this run's or the "
                           "earlier one)")
    nan = nan_fields(json.loads(path.read_text()))
    if nan:
        more = f" and {len(nan) - 3} more" if len(nan) > 3 else ""
        return failed(f"the result is NaN ({', '.join(nan[:3])}{more}; written to {path}): the "
                      "checkpoint's parameters give non-finite outputs", EXIT_NON_FINITE)
    return 0


if __name__ == "__main__":
    leave(main())  # after Ctrl-C without the interpreter's teardown (diff_jax.command)
