"""The replication reports' PNGs (matplotlib, the `plots` extra): loss curves, niah heatmaps,
quantization, DIFF V1's λ, and recall learning curves. Each returns False without drawing when
matplotlib is missing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from diff_jax.evaluation.plots import pyplot, save


def _save_lined(fig: Any, ax: Any, path: Path) -> None:
    """Grid, legend, and save a single-axes line plot."""
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save(fig, path)


def loss_curves(path: Path, curves: dict[str, dict[str, tuple[list[int], list[float]]]],
                labels: dict[str, str]) -> bool:
    """Per model (label key) its curves by name ("train", "validation": (steps, mean loss)) on
    one axis; validation dashed."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (v, named) in enumerate(curves.items()):
        for name, (steps, loss) in named.items():
            ax.plot(steps, loss, color=f"C{i}", ls="-" if name == "train" else "--",
                    marker=None if name == "train" else "o", label=f"{labels[v]} {name}")
    ax.set(title="Loss (mean over seeds)", xlabel="step", ylabel="cross-entropy (nats)")
    _save_lined(fig, ax, path)
    return True


def niah_heatmaps(path: Path, grids: dict[str, dict[str, np.ndarray]], labels: dict[str, str],
                  depths: list[int], lengths: list[int]) -> bool:
    """Accuracy heatmaps (depth × length): a row per model, a column per (N, R) name."""
    plt = pyplot()
    if plt is None:
        return False
    models = list(grids)
    columns = list(grids[models[0]])
    fig, axes = plt.subplots(len(models), len(columns), squeeze=False,
                             figsize=(1.6 + 2.2 * len(columns), 0.8 + 0.45 * len(depths) * len(models)))
    for i, v in enumerate(models):
        for j, name in enumerate(columns):
            acc = grids[v][name]
            ax = axes[i, j]
            ax.imshow(acc, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            ax.set_xticks(range(len(lengths)), [str(x) for x in lengths])
            ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths])
            for a in range(acc.shape[0]):
                for b in range(acc.shape[1]):
                    ax.text(b, a, f"{acc[a, b]:.2f}", ha="center", va="center", fontsize=7)
            ax.set_title(f"{labels[v]}: {name}", fontsize=9)
            if i == len(models) - 1:
                ax.set_xlabel("context length")
            if j == 0:
                ax.set_ylabel("answer depth")
    fig.tight_layout()
    save(fig, path, dpi=110)
    return True


def quantization(path: Path, bits: list[str], increase: dict[str, np.ndarray],
                 accuracy: dict[str, list[float]], labels: dict[str, str]) -> bool:
    """Perplexity increase over float (fraction) and niah accuracy per bit width, per model."""
    plt = pyplot()
    if plt is None:
        return False
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(bits))
    for i, v in enumerate(increase):
        a1.plot(x, 100 * increase[v], marker="o", color=f"C{i}", label=labels[v])
        a2.plot(x, accuracy[v], marker="o", color=f"C{i}", label=labels[v])
    for ax, ylabel in ((a1, "perplexity increase over float (%)"), (a2, "niah accuracy")):
        ax.set_xticks(list(x), bits)
        ax.set(xlabel="attention-logit bits", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    a2.set_ylim(-0.05, 1.05)
    fig.suptitle("Attention-logit quantization (mean over seeds)")
    fig.tight_layout()
    save(fig, path)
    return True


def lambdas(path: Path, steps: list[int], lam: np.ndarray) -> bool:
    """DIFF V1's λ (steps, layers) over training."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for layer in range(lam.shape[1]):
        ax.plot(steps, lam[:, layer], label=f"layer {layer}")
    ax.set(title="DIFF V1: λ per layer during training", xlabel="step", ylabel="λ")
    _save_lined(fig, ax, path)
    return True


def learning_curves(path: Path, curves: dict[str, dict[str, dict[str, Any]]],
                    labels: dict[str, str], *, threshold: float, title: str) -> bool:
    """Recall accuracy over training: a panel per init, a line per model (mean over seeds, a
    band of ± one std), and the threshold. curves[init][model] = {"steps", "accuracy" (stats)}."""
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, len(curves), squeeze=False, figsize=(5.5 * len(curves), 4))
    for ax, (init, per_variant) in zip(axes[0], curves.items()):
        for i, (v, c) in enumerate(per_variant.items()):
            mean = np.array([s["mean"] for s in c["accuracy"]])
            std = np.array([s["std"] for s in c["accuracy"]])
            ax.plot(c["steps"], mean, marker="o", color=f"C{i}", label=labels[v])
            ax.fill_between(c["steps"], mean - std, mean + std, color=f"C{i}", alpha=0.15)
        ax.axhline(threshold, color="gray", ls=":")
        ax.set(title=f"init {init}", xlabel="step", ylabel="query accuracy", ylim=(-0.02, 1.02))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title + " (mean ± std over seeds)")
    fig.tight_layout()
    save(fig, path)
    return True
