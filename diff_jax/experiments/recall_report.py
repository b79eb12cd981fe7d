"""results.json, results.md and the learning-curve PNG of an associative-recall replication
(`RecallPreset`): accuracy and attention shares per grid cell, steps to 90%, and for every claim
the paired difference against the Transformer with its spread over seeds (`stats.paired`), under
each init."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from diff_jax.experiments import plots
from diff_jax.experiments.layout import (device_line, eval_json, read_eval, read_wall,
                                         recall_cell_name, run_devices, run_dir)
from diff_jax.experiments.presets import LABELS, VARIANTS, RecallPreset, replicate_command
from diff_jax.experiments.stats import describe, mean_std, paired, paired_censored, stat
from diff_jax.recall import max_queries
from diff_jax.output_dir import write_whole

THRESHOLD = 0.9  # "steps to reach 90%"
MEASURES = ("accuracy", "answer_share", "noise_share")


def run_results(preset: RecallPreset, run: Path) -> dict[str, Any]:
    """One model's numbers: per grid cell and length the three `MEASURES`, the learning curve
    (checkpoint step, accuracy on the curve cell) and steps to 90% (None: never reached)."""
    cells = {}
    for n, d in preset.grid_cells:
        job = read_eval(eval_json(run, recall_cell_name(n, d)))
        cells[(n, d)] = {m: job[m] for m in MEASURES}
    n, d = preset.curve_cell
    curve = sorted((int(p.parent.name.rpartition("-step")[2]), read_eval(p)["accuracy"][0])
                   for p in (run / "replicate").glob(f"{recall_cell_name(n, d)}-step*/recall.json"))
    reached = [s for s, a in curve if a >= THRESHOLD]
    wall = read_wall(run)
    return {"cells": cells, "curve": curve, "steps_to_90": reached[0] if reached else None,
            "train_s": wall.get("train_s", 0.0),
            "eval_s": sum(v for k, v in wall.items() if k.startswith("eval_"))}


SCOPES = {"at the training length": slice(0, 1), "beyond the training length": slice(1, None)}


def grid_mean(result: dict[str, Any], measure: str, lengths: slice = slice(None)) -> float:
    """The mean of `measure` over every cell of one model's grid, at the `lengths` (indices into
    the preset's grid_lengths; all by default)."""
    return float(np.mean([v[measure][lengths] for v in result["cells"].values()]))


def collect(preset: RecallPreset, seeds: int, out: Path) -> dict[str, dict[str, list[dict]]]:
    """{init: {variant: [run_results of seed 0, 1, …]}}."""
    return {init: {v: [run_results(preset, run_dir(out, v, s, init)) for s in range(seeds)]
                   for v in VARIANTS} for init in preset.inits}


def cells_json(preset: RecallPreset, runs: dict) -> list[dict[str, Any]]:
    """results.json's `cells`: per init, pairs, distractor share and length, per model the mean
    and std over seeds of each of `MEASURES`, and each seed's accuracy."""
    out = []
    for init, per_variant in runs.items():
        for n, d in preset.grid_cells:
            for j, length in enumerate(preset.grid_lengths):
                models = {}
                for v, seeds in per_variant.items():
                    values = {m: [s["cells"][(n, d)][m][j] for s in seeds] for m in MEASURES}
                    models[v] = {**{m: stat(x) for m, x in values.items()},
                                 "accuracy_per_seed": values["accuracy"]}
                out.append({"init": init, "pairs": n, "distractors": d,
                            "queries": max_queries(n, d), "length": length, "models": models})
    return out


def pair_claims(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, Any]:
    """Paired differences a − b of two models' `run_results` (the same seeds, in order): the
    grid-mean of each of `MEASURES` at and beyond the training length (keys "MEASURE SCOPE")
    and steps to 90% (`paired_censored`: a seed that never reached 90% is known only to need
    more than the last step checked)."""
    c = {f"{m} {scope}": paired([grid_mean(s, m, at) for s in a], [grid_mean(s, m, at) for s in b])
         for scope, at in SCOPES.items() for m in MEASURES}
    last = max(s["curve"][-1][0] for s in a + b)  # the last step checked
    c["steps_to_90"] = paired_censored([s["steps_to_90"] for s in a],
                                       [s["steps_to_90"] for s in b], last)
    return c


def comparisons(runs: dict) -> dict[str, dict[str, dict[str, Any]]]:
    """Per init, per DIFF variant: `pair_claims` against the Transformer."""
    return {init: {v: pair_claims(per_variant[v], per_variant["transformer"])
                   for v in ("diff", "diff_v2")} for init, per_variant in runs.items()}


CLAIM_NAMES = {"accuracy": "grid-mean accuracy", "answer_share": "grid-mean answer attention share",
               "noise_share": "grid-mean noise attention share", "steps_to_90": "steps to 90%"}


def claim_line(what: str, key: str, p: dict[str, Any]) -> str:
    """One markdown claim: `what` (e.g. "DIFF V1 − Transformer"), the measure and scope `key`
    names (a `pair_claims` key) and its paired difference (steps in whole steps)."""
    measure, _, scope = key.partition(" ")
    digits = 0 if measure == "steps_to_90" else 3
    return (f"- {what}, {CLAIM_NAMES[measure]}{' ' + scope if scope else ''}: "
            f"{describe(p, digits)}.")


def init_gaps(preset: RecallPreset, runs: dict) -> dict[str, dict[str, Any]]:
    """Per model: the paired difference of its grid-mean accuracy at the training length,
    second init minus first."""
    if len(preset.inits) < 2:
        return {}
    a, b = preset.inits[1], preset.inits[0]
    at = SCOPES["at the training length"]
    return {v: paired([grid_mean(s, "accuracy", at) for s in runs[a][v]],
                      [grid_mean(s, "accuracy", at) for s in runs[b][v]]) for v in VARIANTS}


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    line = lambda cells: "| " + " | ".join(cells) + " |"  # noqa: E731
    return [line(header), line(["---"] * len(header)), *(line(r) for r in rows)]


_LOSS_WORDS = {"all": "every token a training target",
               "queries": "loss on the query part only: its keys, values and end-of-text"}


def _checked(every: int, steps: int) -> str:
    """When the learning curve was measured (`replicate.recall_jobs`: every checkpoint, and the
    last step wherever it falls)."""
    if steps < every:
        return f"at step {steps:,} only"
    return f"every {every} steps" + ("" if steps % every == 0 else f" and at the last, {steps:,}")


def markdown(preset: RecallPreset, data: dict[str, Any]) -> str:
    """results.md: setup, per init the grid, shares and learning speed, then the claims."""
    seeds = len(data["seeds"])
    lines = [
        f"# Associative recall: `{preset.name}` preset", "",
        f"Generated by `{replicate_command(preset, seeds)}`: DIFF V1, DIFF V2 and the "
        f"Transformer at matched parameters, {seeds} seeds each, under the inits "
        f"{', '.join(f'`{i}`' for i in preset.inits)} (`model.output_init`). Task: "
        "`diff_jax.recall` (keys of two tokens, near-duplicate distractor keys, a counting "
        "haystack); accuracy = share of queries whose value greedy decoding retrieves. Cells "
        "are mean ± sample std over seeds.", "",
        f"Setup: {data['train_tokens']:,} training tokens per model ({data['steps']} steps × "
        f"{data['batch_size']} rows × {data['seq_len']} tokens, one recall sample of "
        f"{data['seq_len'] - 1} tokens a row, pairs 1–{preset.max_pairs}, distractor shares "
        f"{list(preset.train_distractors)}; {_LOSS_WORDS[preset.train_loss]}), identical data "
        "order, optimizer and schedule for "
        f"every model, fixed before any comparison. Evaluation: {preset.samples} samples per "
        f"cell from a seed stream of their own (not training's; an easy cell's few possible "
        f"samples can recur in training), lengths "
        f"{list(preset.grid_lengths)} ({preset.grid_lengths[0]} is the training length). "
        f"Sized for: {preset.budget}.", "",
        *device_line(data),
        *_table(["model", "params", "non-embedding", "heads", "kv heads", "head dim"],
                [[LABELS[v], f"{m['params']:,}", f"{m['non_embedding_params']:,}",
                  str(m["heads"]), str(m["kv_heads"]), str(m["head_dim"])]
                 for v, m in data["models"].items()]), "",
    ]
    (n0, d0), length = preset.grid_cells[0], preset.grid_lengths[0]
    easiest = {c["init"]: c["models"]["transformer"]["accuracy"] for c in data["cells"]
               if (c["pairs"], c["distractors"], c["length"]) == (n0, d0, length)}
    n, d = preset.curve_cell
    curve = {i: data["learning_curve"][i]["transformer"]["accuracy"][-1] for i in preset.inits}
    lines += [f"Learnability: the Transformer's accuracy on the easiest cell (N={n0}, "
              f"distractors={d0:g}, length {length}) is "
              + ", ".join(f"{mean_std(easiest[i])} under `{i}`" for i in preset.inits)
              + f"; on the learning-curve cell (N={n}, distractors={d:g}) it ends at "
              + ", ".join(f"{mean_std(curve[i])} under `{i}`" for i in preset.inits)
              + f" (the bar is {THRESHOLD:.0%}).", ""]
    for init in preset.inits:
        cells = [c for c in data["cells"] if c["init"] == init]
        lines += [f"## Init `{init}`", "", "Accuracy per cell (N pairs, distractor share, length; "
                  "R = the N − distractors pairs, each queried once). The last two columns are the "
                  "paired difference against the Transformer, mean [min, max] over seeds; * marks "
                  "a difference whose seeds all share its sign.", ""]
        rows = []
        for c in cells:
            m = c["models"]
            diffs = []
            for v in ("diff", "diff_v2"):
                p = paired(m[v]["accuracy_per_seed"], m["transformer"]["accuracy_per_seed"])
                diffs.append(f"{p['mean']:+.2f} [{p['min']:+.2f}, {p['max']:+.2f}]"
                             + ("*" if p["outside_spread"] else ""))
            rows.append([str(c["pairs"]), f"{c['distractors']:g}", str(c["length"]),
                         *(mean_std(m[v]["accuracy"]) for v in VARIANTS), *diffs])
        lines += [*_table(["N", "distractors", "length", *(LABELS[v] for v in VARIANTS),
                           "V1 − Transformer", "V2 − Transformer"], rows), ""]
        lines += ["Attention of query 0's key tokens (Table 3's measure, normalized; same items): "
                  "share on the queried pair's triple (answer) and on the rest of the context "
                  "(noise).", ""]
        rows = [[str(c["pairs"]), f"{c['distractors']:g}", str(c["length"]),
                 *(f"{mean_std(c['models'][v]['answer_share'])} / "
                   f"{mean_std(c['models'][v]['noise_share'])}" for v in VARIANTS)] for c in cells]
        lines += [*_table(["N", "distractors", "length",
                           *(f"{LABELS[v]} answer / noise" for v in VARIANTS)], rows), ""]
        n, d = preset.curve_cell
        curve = data["learning_curve"][init]
        checked = _checked(data["checkpoint_every"], preset.steps)
        lines += [f"Steps to {THRESHOLD:.0%} accuracy on N={n}, distractors={d:g} at length "
                  f"{preset.grid_lengths[0]} (checked {checked}; "
                  "— : not reached within the budget), per seed:", "",
                  *_table(["model", "steps to 90% (per seed)", "final accuracy"],
                          [[LABELS[v], ", ".join("—" if s is None else str(s)
                                                 for s in curve[v]["steps_to_90"]),
                            mean_std(curve[v]["accuracy"][-1])] for v in VARIANTS]), ""]
    lines += ["## Claims", "",
              "Each line is a paired difference (same seed, same data order) with its spread "
              "over seeds; a direction is stated only where every seed agrees in sign.", ""]
    for init, per_variant in data["paired"].items():
        for v, c in per_variant.items():
            lines += [claim_line(f"`{init}` init, {LABELS[v]} − Transformer", key, p)
                      for key, p in c.items()]
    for v, p in data["init_gap"].items():
        lines.append(f"- {LABELS[v]}, grid-mean accuracy at the training length "
                     f"`{preset.inits[1]}` − `{preset.inits[0]}` init: {describe(p)}.")
    lines += ["", "## Plots", "", *(f"![{p}]({p})" for p in data["plots"]), ""]
    return "\n".join(lines)


def write(preset: RecallPreset, seeds: int, out: Path, summaries: dict[str, dict]) -> dict[str, Any]:
    """Collect every run's numbers, write OUT/results.json, OUT/results.md and the PNG."""
    runs = collect(preset, seeds, out)
    cfg = preset.config("diff", 0, out)
    curves = {init: {v: {"steps": [s for s, _ in seeds_[0]["curve"]],
                         "accuracy": [stat([r["curve"][i][1] for r in seeds_])
                                      for i in range(len(seeds_[0]["curve"]))],
                         "steps_to_90": [r["steps_to_90"] for r in seeds_]}
                     for v, seeds_ in per_variant.items()} for init, per_variant in runs.items()}
    n, d = preset.curve_cell
    drawn = plots.learning_curves(out / "learning_curves.png", curves, LABELS, threshold=THRESHOLD,
                                  title=f"Recall accuracy on N={n}, distractors={d:g}")
    plot_names = ["learning_curves.png"] if drawn else []
    device, devices = run_devices(preset.inits, seeds, out)
    data = {
        "preset": preset.name, "budget": preset.budget, "seeds": list(range(seeds)),
        "inits": list(preset.inits), "train_loss": preset.train_loss, "steps": cfg.train.steps,
        "batch_size": cfg.train.batch_size,
        "seq_len": cfg.train.seq_len, "checkpoint_every": cfg.checkpoint.every_steps,
        "train_tokens": cfg.train.steps * cfg.train.batch_size * cfg.train.seq_len,
        "device": device,
        "models": {v: {"params": summaries[v]["params"],
                       "non_embedding_params": summaries[v]["params_non_embedding"],
                       "devices": devices[v],
                       "heads": summaries[v]["heads"], "kv_heads": summaries[v]["kv_heads"],
                       "head_dim": summaries[v]["head_dim"]} for v in VARIANTS},
        "grid": {"cells": [list(c) for c in preset.grid_cells],
                 "lengths": list(preset.grid_lengths), "samples": preset.samples,
                 "curve_cell": list(preset.curve_cell)},
        "cells": cells_json(preset, runs),
        "learning_curve": curves,
        "paired": comparisons(runs),
        "init_gap": init_gaps(preset, runs),
        "wall_s": {init: {v: {"train": stat([r["train_s"] for r in rs]),
                              "eval": stat([r["eval_s"] for r in rs])}
                          for v, rs in per_variant.items()} for init, per_variant in runs.items()},
        "plots": plot_names,
    }
    write_whole(out / "results.json", json.dumps(data, indent=1) + "\n")
    write_whole(out / "results.md", markdown(preset, data))
    return data
