"""eval.py's tasks on a checkpoint: ppl, score, niah, attention, outliers, quant, generate, recall,
choice, icl.

`run(argv)` parses `task=NAME [key=value ...] [section.key=value ...]`, loads the checkpoint,
runs the task, prints a table and writes `<RUN>/eval/<task>.json` (`<RUN>/eval/step-N/` for a step
named by `step=N` or its directory; docs/evaluation.md lists each task's keys and fields).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from diff_jax.device_memory import fit_or_explain
from diff_jax.evaluation import analysis, choice, generation, icl, recall, retrieval, scoring
from diff_jax.evaluation.loading import Loaded, eval_devices, load
from diff_jax.evaluation.options import TASKS, EvalError, EvalOptions, parse_args
from diff_jax.evaluation.report import Report, format_table, write
from diff_jax.output_dir import made

TASK_FUNCTIONS: dict[str, Callable[[Loaded, EvalOptions], Report]] = {
    "ppl": scoring.ppl,
    "score": scoring.score,
    "niah": retrieval.niah,
    "attention": analysis.attention,
    "outliers": analysis.outliers,
    "quant": analysis.quant,
    "generate": generation.run,
    "recall": recall.recall_task,
    "choice": choice.choice_task,
    "icl": icl.icl_task,
}
assert tuple(TASK_FUNCTIONS) == TASKS

__all__ = ["EvalError", "EvalOptions", "Loaded", "Report", "evaluate", "load", "parse_args", "run",
           "run_task"]


def run_task(options: EvalOptions, overrides: Sequence[str]) -> tuple[Report, Path]:
    """Load, run `options.task`, write its JSON; (report, JSON path)."""
    return evaluate(load(options, overrides), options)


def evaluate(loaded: Loaded, options: EvalOptions) -> tuple[Report, Path]:
    """Run `options.task` on what `load` returned, write its JSON into `loaded.out_dir`; (report,
    JSON path). Several tasks of one checkpoint load it once (a replication's evaluations)."""
    # the output directory is removed again, with its new parents, if the task fails
    with made(loaded.out_dir), loaded.context():
        report = TASK_FUNCTIONS[options.task](loaded, options)
    header = {"task": options.task, "checkpoint": loaded.source, "step": loaded.step,
              "variant": loaded.config.model.variant}
    return report, write(report, loaded.out_dir, options.task, header)


def run(argv: Sequence[str]) -> Path:
    """The command line: run the task, print its table, return the JSON path. Raises
    `DeviceMemoryError` where the model or the task's arrays do not fit in device memory."""
    options, overrides = parse_args(argv)
    with fit_or_explain(options.memory_advice(*eval_devices(overrides))):
        report, path = run_task(options, overrides)
    print(format_table([("task", options.task), *report.table, ("json", str(path))]))
    for note in report.notes:
        print(f"note: {note}")
    return path
