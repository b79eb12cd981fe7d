"""PNG figures, drawn only when matplotlib (the `plots` extra) is installed."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from diff_jax.evaluation.report import Report
from diff_jax.output_dir import write_whole

MISSING = "matplotlib is not installed (pip install 'diff-jax[plots]'): no PNG written"


def attach(report: Report, path: Path, drawn: bool) -> None:
    """Record the figure `path` in `report.files` when it was `drawn` (what `heatmap` and
    `lines` return), else add the note saying why no PNG was written."""
    if drawn:
        report.files.append(str(path))
    else:
        report.notes.append(MISSING)


def pyplot() -> Any:
    """`matplotlib.pyplot` on the Agg backend (no display needed), or None when matplotlib is
    not installed; every PNG of the evaluation and the replication reports is drawn through it."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path, dpi: int = 120) -> None:
    """`fig` as a PNG at `path`, replacing an earlier one whole or not at all (`write_whole`),
    then closed; every PNG of the evaluation and the replication reports is saved through it."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    pyplot().close(fig)
    write_whole(path, buffer.getvalue())


def heatmap(path: Path, values: np.ndarray, rows: Sequence[str], cols: Sequence[str], *,
            title: str, xlabel: str, ylabel: str) -> bool:
    """values (len(rows), len(cols)) in [0, 1] as an annotated heatmap; False if no matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(cols), 1.0 + 0.6 * len(rows)))
    im = ax.imshow(values, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(cols)), cols)
    ax.set_yticks(range(len(rows)), rows)
    for i in range(len(rows)):
        for j in range(len(cols)):
            ax.text(j, i, f"{values[i, j]:.2f}", ha="center", va="center", fontsize=8)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    save(fig, path)
    return True


def lines(path: Path, x: Sequence[float], series: dict[str, Sequence[float]], *, title: str,
          xlabel: str, ylabel: str, logx: bool = False) -> bool:
    """One line per series; False if no matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, y in series.items():
        ax.plot(x, y, label=label, marker="o" if len(x) < 20 else None)
    if logx:
        ax.set_xscale("log")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save(fig, path)
    return True
