"""Where a replication keeps its runs and their evaluations (one place for `replicate` and the
reports that read them)."""

from __future__ import annotations

from pathlib import Path


def run_dir(out: Path, variant: str, seed: int, init: str) -> Path:
    """OUT/runs/VARIANT-INIT-sSEED: one trained model."""
    return out / "runs" / f"{variant}-{init}-s{seed}"


def eval_json(run: Path, name: str) -> Path:
    """Where eval job `name` writes: RUN/replicate/NAME/TASK.json (TASK: `name` up to its first
    '-'), a folder of its own, so that `eval.py` run by hand (which writes RUN/eval/) never
    replaces a replication result."""
    return run / "replicate" / name / f"{name.partition('-')[0]}.json"


def recall_cell_name(pairs: int, distractors: float) -> str:
    """The eval job name of a recall grid cell, e.g. recall-N4-D50 (4 pairs, half distractors)."""
    return f"recall-N{pairs}-D{round(100 * distractors)}"
