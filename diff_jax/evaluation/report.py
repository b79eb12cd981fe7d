"""What a task hands back: its JSON fields, a short table for the terminal, and the files written;
and the progress line a long task draws on the way."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from diff_jax.metrics import Progress
from diff_jax.output_dir import write_whole

# seconds between progress lines off a terminal (a terminal's line is redrawn at every update)
PROGRESS_EVERY_S = 30.0


@dataclasses.dataclass
class Report:
    """One task's result: its JSON fields, the terminal table, and what else it wrote or skipped."""

    fields: dict[str, Any]  # written as RUN/eval/<task>.json
    table: list[tuple[str, str]]  # (label, value) rows printed to the terminal
    files: list[str] = dataclasses.field(default_factory=list)  # other outputs (PNG, .npy)
    notes: list[str] = dataclasses.field(default_factory=list)  # e.g. a skipped plot


def write(report: Report, out_dir: Path, task: str, header: dict[str, Any]) -> Path:
    """Write `<out_dir>/<task>.json` (header fields first), whole or not at all (a kill or a full
    disk part-way leaves an earlier result as it was: `write_whole`), and return its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{task}.json"
    body = {**header, **report.fields, "files": report.files, "notes": report.notes}
    write_whole(path, json.dumps(body, indent=1) + "\n")
    return path


def format_table(rows: list[tuple[str, str]]) -> str:
    """(label, value) rows as text lines, labels left-aligned to the widest."""
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def progress(total: int, unit: str) -> Progress:
    """A long task's progress line on stderr: `total` `unit`s (`Progress.draw` after each batch;
    used as `with progress(...) as bar:`, which ends the line however the block ends), redrawn
    on a terminal and a line every `PROGRESS_EVERY_S` seconds in a log, where a task quicker
    than that writes none."""
    return Progress(total, True, unit=unit, every_s=PROGRESS_EVERY_S)
