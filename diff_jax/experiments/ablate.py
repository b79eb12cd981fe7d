"""One setting changed against a finished replication, paired by seed.

    python -m diff_jax.experiments.ablate OUT --set model.KEY=VALUE [--set ...]
                                          [--variant diff] [--init INIT] [--seeds N]

OUT is a finished replication (`python -m diff_jax.experiments.replicate --out OUT`, its
results.json written). For each of its seeds (the first N with `--seeds`) this trains
`--variant` under the same recipe, init, corpus, data order and initialization key with the
`--set` overrides added (`model.*` or `optim.*` only: the data and the `train.*` budget stay
the replication's), in OUT/runs/LABEL-INIT-sSEED with LABEL = VARIANT+KEY=VALUE+... (re-running
resumes), scores it, and writes OUT/ablations/LABEL-INIT.json and .md: per seed the measures of
the changed model, the unchanged one and the Transformer, the paired differences changed −
unchanged and changed − Transformer (and unchanged − Transformer) with their spread over seeds
(`stats.paired`; a direction is measured only where every seed agrees in sign), and what the
three write into the residual stream at initialization (`init_scale`, on the first rows of seed
0's corpus).

A language-modeling replication: the held-out loss as its ppl job scores it and the periodic
validation losses (the unchanged model's and the Transformer's from its results.json). An
associative-recall one (`cpu-recall`): its whole evaluation (the grid and the learning-curve
checkpoints), the claims of its report (`recall_report.pair_claims`: grid-mean accuracy and
attention shares at and beyond the training length, steps to 90%), the unchanged model's and
the Transformer's read from their runs in OUT, which must be there.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from diff_jax import train_loop
from diff_jax.command import as_ctrl_c, leave, run_kept
from diff_jax.config import ConfigError, ModelConfig, parse_override
from diff_jax.experiments.layout import eval_json, field, read_eval, read_json, run_dir
from diff_jax.experiments.init_scale import residual_writes
from diff_jax.experiments.lm_report import (gap_cell, init_rows, init_scale_table, read_metrics,
                                             val_gaps_between, val_loss_at)
from diff_jax.experiments.presets import LABELS, VARIANTS, Preset, RecallPreset
from diff_jax.experiments.recall_report import SCOPES, claim_line, grid_mean, pair_claims, run_results
from diff_jax.experiments.replicate import recorded_preset, train_and_evaluate
from diff_jax.experiments.stats import describe, paired
from diff_jax.output_dir import write_whole

SETTABLE = ("model", "optim")  # what an ablation may change; the data and train.* stay
_LABEL_CHARS = re.compile(r"[A-Za-z0-9_.,=-]+")
PAIRS = (("changed", "unchanged"), ("changed", "transformer"), ("unchanged", "transformer"))


def label(variant: str, sets: tuple[str, ...]) -> str:
    """The changed model's name: VARIANT+KEY=VALUE+... (section prefixes dropped)."""
    return "+".join([variant, *(s.split(".", 1)[1] for s in sets)])


def check_sets(sets: tuple[str, ...]) -> None:
    """ConfigError unless every override is `model.KEY=VALUE` or `optim.KEY=VALUE` that can name
    a directory (letters, digits, `_ . , = -`)."""
    if not sets:
        raise ConfigError("--set: give at least one model.KEY=VALUE or optim.KEY=VALUE")
    for text in sets:
        keys, _ = parse_override(text)
        if len(keys) != 2 or keys[0] not in SETTABLE:
            raise ConfigError(f"--set {text}: expected model.KEY=VALUE or optim.KEY=VALUE (the "
                              "data and the train.* budget stay the replication's)")
        if keys[0] == "model" and keys[1] in ModelConfig.HOW_COMPUTED:
            raise ConfigError(f"--set {text}: model.{keys[1]} chooses how the same model is "
                              "computed, not the model or its training"
                              + (" (and draws other initial parameters from the same seed, "
                                 "which no pairing controls)" if keys[1] == "scan_layers" else "")
                              + "; an ablation changes what is trained")
        if not _LABEL_CHARS.fullmatch(text):
            raise ConfigError(f"--set {text}: use letters, digits and _ . , = - only (it names "
                              "the run's directory)")


def _replication(out: Path) -> tuple[Preset | RecallPreset, dict[str, Any]]:
    """The preset (at the training steps it ran) and results.json of the finished replication
    in `out`; ConfigError naming results.json and the field when it is missing, damaged, or
    lacks a field this reads or holds it of another type."""
    preset = recorded_preset(out)
    path = out / "results.json"
    try:
        results = read_json(path, "a JSON object (the replication's report)")
    except OSError as e:
        raise ConfigError(f"{out}: not a finished replication (python -m "
                          f"diff_jax.experiments.replicate --out {out}): {e}") from None
    field(results, path, "inits", list, "a list of init names", of=str)
    field(results, path, "seeds", list, "a list of seeds", of=int)
    field(results, path, "seq_len", int, "an integer")
    if isinstance(preset, RecallPreset):
        return preset, results
    init = (results["inits"] or preset.inits)[0]  # `replicate --inits` may have run others
    try:
        validated = "val_loss_at" in results["results"][init]["transformer"]["seeds"][0]
    except (ConfigError, IndexError, TypeError):  # a Record's missing key is a ConfigError
        raise ConfigError(f"{path}: has no results.{init}.transformer.seeds (expected each "
                          "model's results per seed)") from None
    if not validated or "init_scale" not in results:
        raise ConfigError(f"{path} predates the validation losses and init "
                          "scales it needs (val_loss_at, init_scale); re-run the replicate "
                          "command to rewrite it")
    return preset, results


def compare(out: Path, results: dict[str, Any], variant: str, init: str, name: str,
            seeds: list[int]) -> dict[str, Any]:
    """The changed runs' held-out and validation losses beside the replication's, paired."""
    changed = []
    for seed in seeds:
        run = run_dir(out, name, seed, init)
        _, val = read_metrics(run)
        ppl = eval_json(run, "ppl")
        changed.append({"loss": field(read_eval(ppl), ppl, "loss", (int, float), "a number"),
                        "val_loss_at": val_loss_at(val)})
    per = {"changed": changed,
           **{role: [results["results"][init][v]["seeds"][s] for s in seeds]
              for role, v in (("unchanged", variant), ("transformer", "transformer"))}}
    losses = {role: [s["loss"] for s in rows] for role, rows in per.items()}
    gaps = {f"{a}_minus_{b}": val_gaps_between(per[a], per[b], *per.values()) for a, b in PAIRS}
    steps = list(gaps["changed_minus_unchanged"])
    return {
        "heldout_loss": losses,
        "paired": {f"{a}_minus_{b}": paired(losses[a], losses[b]) for a, b in PAIRS},
        "val_loss_at": {role: [s["val_loss_at"] for s in rows] for role, rows in per.items()},
        "val_paired": {step: {name: gap[step] for name, gap in gaps.items()} for step in steps},
    }


def _recall_runs(preset: RecallPreset, out: Path, models: dict[str, str], init: str,
                 seeds: list[int]) -> dict[str, list[dict[str, Any]]]:
    """{role: [`run_results` of each seed]} of the runs in `out` named by `models` {role: run
    name}; a ConfigError naming the first whose evaluation is missing."""
    try:
        return {role: [run_results(preset, run_dir(out, name, s, init)) for s in seeds]
                for role, name in models.items()}
    except FileNotFoundError as e:
        raise ConfigError(f"{out}: {e.filename} is missing (an ablation of a recall replication "
                          "reads its runs' evaluations; run it where the replication ran)") from None


def compare_recall(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per role ("changed", "unchanged", "transformer") each seed's grid-mean accuracy at and
    beyond the training length and steps to 90%; per pair of `PAIRS` its `pair_claims`."""
    return {
        "grid_mean_accuracy": {scope: {role: [grid_mean(r, "accuracy", at) for r in rs]
                                       for role, rs in runs.items()}
                               for scope, at in SCOPES.items()},
        "steps_to_90": {role: [r["steps_to_90"] for r in rs] for role, rs in runs.items()},
        "claims": {f"{a}_minus_{b}": pair_claims(runs[a], runs[b]) for a, b in PAIRS},
    }


def _names(data: dict[str, Any]) -> dict[str, str]:
    return {"changed": data["label"], "unchanged": LABELS[data["variant"]],
            "transformer": LABELS["transformer"]}


def _header(data: dict[str, Any], scored: str) -> list[str]:
    """An ablation .md's title and what it ran, `scored` saying how the models are measured."""
    v = data["variant"]
    return [f"# Ablation `{data['label']}` against the `{data['preset']}` replication", "",
            f"Generated by `python -m diff_jax.experiments.ablate OUT "
            f"{' '.join('--set ' + s for s in data['sets'])} --variant {v} --init {data['init']} "
            f"--seeds {len(data['seeds'])}`. "
            f"{LABELS[v]} trained again with {', '.join(f'`{s}`' for s in data['sets'])} under "
            f"the replication's recipe (init `{data['init']}`, each seed's corpus, data order "
            "and initialization key), against the replication's own runs of the unchanged "
            f"model and the Transformer. {scored}", ""]


def _seed_table(data: dict[str, Any], values: dict[str, list[Any]], fmt) -> list[str]:
    """| seed | changed | unchanged | Transformer | rows of `values` {role: per seed}."""
    names = _names(data)
    return ["| seed | " + " | ".join(names.values()) + " |", "|---|---|---|---|",
            *(f"| {s} | " + " | ".join(fmt(values[r][i]) for r in names) + " |"
              for i, s in enumerate(data["seeds"])), ""]


def _init_scale_lines(data: dict[str, Any]) -> list[str]:
    names = _names(data)
    return ["What each sublayer adds to the residual stream at initialization, as the "
            "replication's report measures it:", "",
            *init_scale_table([(names[r], data["init_scale"][r]) for r in names],
                              data["seq_len"])]


def markdown_recall(data: dict[str, Any]) -> str:
    """A recall ablation's .md: per seed the grid-mean accuracies and steps to 90%, then the
    paired claims."""
    names = _names(data)
    lines = _header(data, "Scored on the replication's whole recall grid, as its report "
                          "scores it (accuracy: the share of queries greedy decoding "
                          "retrieves).")
    for scope, values in data["grid_mean_accuracy"].items():
        lines += [f"Grid-mean accuracy {scope}, per seed:", "",
                  *_seed_table(data, values, lambda x: f"{x:.3f}")]
    lines += ["Steps to 90% on the learning-curve cell, per seed (— : not reached):", "",
              *_seed_table(data, data["steps_to_90"], lambda x: "—" if x is None else str(x)),
              "Paired differences (same seed); a direction is stated only where every seed "
              "agrees in sign:", "",
              *(claim_line(f"{names[a]} − {names[b]}", key, p)
                for a, b in PAIRS for key, p in data["claims"][f"{a}_minus_{b}"].items()), ""]
    return "\n".join(lines + _init_scale_lines(data))


def markdown(data: dict[str, Any]) -> str:
    """ablation .md: the settings, the per-seed losses and the paired differences."""
    names = _names(data)
    lines = [*_header(data, "Held-out loss as the replication's ppl job scores it."),
             *_seed_table(data, data["heldout_loss"], lambda x: f"{x:.4f}"),
             "Paired differences (same seed):", "",
             *(f"- {names[a]} − {names[b]}: {describe(data['paired'][f'{a}_minus_{b}'])}."
               for a, b in PAIRS), ""]
    if data["val_paired"]:
        steps = list(data["val_paired"])
        row = lambda a, b: " | ".join(  # noqa: E731
            gap_cell(data["val_paired"][s][f"{a}_minus_{b}"]) for s in steps)
        lines += ["Periodic validation (held-out loss during training), paired by seed: mean (min "
                  "to max over seeds), * where every seed has the same sign.", "",
                  "| difference | " + " | ".join(f"step {s}" for s in steps) + " |",
                  "|---|" + "---|" * len(steps),
                  *(f"| {names[a]} − {names[b]} | {row(a, b)} |"
                    for a, b in PAIRS), ""]
    return "\n".join(lines + _init_scale_lines(data))


def ablate(out: Path, sets: tuple[str, ...], variant: str, init: str | None,
           seeds: int | None) -> dict[str, Any]:
    """Train, score and compare (the module docstring); returns the written JSON's content."""
    check_sets(sets)
    preset, results = _replication(out)
    if variant not in VARIANTS or variant == "transformer":
        raise ConfigError(f"--variant {variant}: expected one of diff, diff_v2")
    init = init or (results["inits"] or preset.inits)[0]
    if init not in results["inits"]:
        raise ConfigError(f"--init {init}: {out} was run under {', '.join(results['inits'])}")
    all_seeds = results["seeds"]
    if seeds is not None and not 1 <= seeds <= len(all_seeds):
        raise ConfigError(f"--seeds {seeds}: {out} has {len(all_seeds)} seed(s)")
    chosen = all_seeds[:seeds] if seeds else all_seeds
    if preset.config(variant, 0, out, init, sets) == preset.config(variant, 0, out, init):
        raise ConfigError(f"--set {' '.join(sets)}: changes nothing in {variant}'s config")
    name = label(variant, sets)
    recall = isinstance(preset, RecallPreset)
    baseline = {"unchanged": variant, "transformer": "transformer"}
    # a recall ablation reads the runs it compares against from OUT: before training, they are
    baseline_runs = _recall_runs(preset, out, baseline, init, chosen) if recall else {}
    for seed in chosen:
        print(f"== ablation {name}, init {init}, seed {seed} ==", flush=True)
        train_and_evaluate(preset, variant, seed, init, out, sets, name,
                           only=None if recall else ("ppl",))
    seq_len = results["seq_len"]
    rows = init_rows(out, seq_len)
    changed = preset.config(variant, 0, run_dir(out, name, 0, init), init, sets).model
    scale = {"changed": residual_writes(changed, rows)}
    for role, v in baseline.items():  # a recall report records no init scales
        scale[role] = (residual_writes(preset.config(v, 0, out, init).model, rows) if recall
                       else results["init_scale"][init][v])
    if recall:
        runs = {**_recall_runs(preset, out, {"changed": name}, init, chosen), **baseline_runs}
        measured = compare_recall(runs)
    else:
        measured = compare(out, results, variant, init, name, chosen)
    data = {"preset": preset.name, "label": name, "variant": variant, "init": init,
            "sets": list(sets), "seeds": chosen, "seq_len": seq_len, **measured,
            "init_scale": scale}
    stem = out / "ablations" / f"{name}-{init}"  # no with_suffix: the name may hold dots
    stem.parent.mkdir(exist_ok=True)
    write_whole(Path(f"{stem}.json"), json.dumps(data, indent=1) + "\n")
    write_whole(Path(f"{stem}.md"), markdown_recall(data) if recall else markdown(data))
    return data


def main(argv: list[str] | None = None) -> int:
    """The command line above; exit status 0, 2 on bad input (one `error:` line), 1 when the
    changed model diverged, 130 when a Ctrl-C, a SIGTERM or a SIGHUP (the terminal closed)
    stopped it (one `interrupted:` line; the changed model's training saves its step first)."""
    parser = argparse.ArgumentParser(prog="python -m diff_jax.experiments.ablate",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("out", help="a finished replication's --out directory")
    parser.add_argument("--set", action="append", default=[], dest="sets",
                        help="model.KEY=VALUE or optim.KEY=VALUE (repeatable)")
    parser.add_argument("--variant", default="diff", help="diff (default) or diff_v2")
    parser.add_argument("--init", default=None, help="one of the replication's inits "
                        "(default: its first)")
    parser.add_argument("--seeds", type=int, default=None,
                        help="the first N of the replication's seeds (default: all)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        with as_ctrl_c():  # a SIGTERM, SIGHUP or closed stdout too, at any phase: one line
            data = ablate(out, tuple(args.sets), args.variant, args.init, args.seeds)
            print(f"wrote {out / 'ablations' / (data['label'] + '-' + data['init'])}.json and .md")
    except train_loop.RUN_ERRORS as e:
        return train_loop.report(e, [(str(out), str(out))])
    except KeyboardInterrupt as e:  # the changed model's training saved its step, or Ctrl-C twice
        return run_kept(e, out)
    return 0


if __name__ == "__main__":
    leave(main())
