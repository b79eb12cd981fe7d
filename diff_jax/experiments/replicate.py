"""Train DIFF V1, DIFF V2 and the Transformer twin side by side and compare them.

    python -m diff_jax.experiments.replicate [--preset micro|cpu-small|cpu-recall|gpu-medium]
                                             [--seeds N] [--inits I,...] [--out DIR] [--jobs J]
                                             [--finished-from SRC] [--steps S]

For each init of the preset (`model.output_init`; `--inits` picks some of them), seed and model
it runs `train.py`'s loop (DIR/runs/VARIANT-INIT-sSEED; re-running resumes from the latest
checkpoint) and then the evaluations through `diff_jax.evaluation.evaluate`, each into
RUN/replicate/JOB/ (a job whose JSON already holds its step is skipped; each checkpoint step is
loaded once for all its jobs). First each seed's corpus
is written once (`prepare_corpus`, DIR/data/corpus-sSEED) and every model of the seed reads it
(DIR/replicate.json names the preset: a DIR holding another preset's runs is refused). A
language-modeling preset runs ppl, niah (one per (N, R) of its grid), attention, outliers and
quant; a recall preset runs recall once per grid cell and once per checkpoint on the
learning-curve cell. Then `lm_report` or `recall_report` writes DIR/results.json,
DIR/results.md and the PNGs. The models of a seed share data order, token budget and
optimizer; their parameter counts are checked to agree within ±0.5% before anything trains.
Each run lists the machines that trained or evaluated it in RUN/device.json; the reports name
them (`device`). A run whose every evaluation holds the final step is finished: it is neither
trained nor evaluated again, and needs no checkpoint.

`--finished-from SRC` takes the models another directory of the preset finished (SRC can be a
copy of its small files: configs, metrics, walls, evaluation JSONs, corpus meta) when they
trained on a corpus with the same digest under the same config (`adopt_finished`): a
replication longer than one machine's session (a lent GPU's 15 minutes) finishes over several,
and only the model a session cut short trains again.

`--steps S` trains every model S steps instead of the preset's, its learning-rate schedule
stretched to them and everything else the preset's (a recall preset keeps every checkpoint for
its learning curve): whether a difference at the preset's budget is one of budget. DIR's
replicate.json records the steps, and a DIR or SRC of the preset at other steps is refused.

`--jobs J` (CPU only) trains and evaluates J models at a time, each in a process of its own pinned
to its share of this process's CPU cores: small models use a second core poorly (the cpu-recall
Transformer's step takes 54 ms on 2 cores, 76 ms on one). XLA splits a matmul over the threads it
has, so a model trained on one core rounds differently from one trained on two: the cpu-recall
Transformer's loss agrees to 7 digits at step 100 and drifts to 0.458 against 0.464 by step 3000.
Every model of one invocation runs under the same J, so its paired comparisons are unaffected;
compare across invocations only within seed noise.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.resource_tracker
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from diff_jax import data, evaluation, recall, train_loop
from diff_jax.command import (EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_NON_FINITE, STOPS, as_ctrl_c,
                              failed, leave, not_ignored, off_the_terminal, positive_int,
                              run_kept)
from diff_jax.config import MAX_STEPS, Config, ConfigError, dump_config, read_yaml
from diff_jax.device_memory import fit_or_explain
from diff_jax.evaluation import EvalOptions
from diff_jax.evaluation.loading import eval_devices
from diff_jax.experiments import lm_report, recall_report
from diff_jax.experiments.layout import (device_json, eval_json, field, is_a, read_corpus_meta,
                                         read_devices, read_eval, read_json, read_wall,
                                         recall_cell_name, run_dir)
from diff_jax.experiments.presets import (PRESETS, VARIANTS, Preset, RecallPreset, check_matched,
                                          corpus_dir, preset_args)
from diff_jax.output_dir import made, staged, write_whole


def lm_jobs(preset: Preset) -> list[tuple[str, EvalOptions]]:
    """(name, options) of every evaluation of one language model."""
    depths, train_len = tuple(preset.depths), (preset.seq_len,)
    jobs = [("ppl", EvalOptions(task="ppl", batches=preset.eval_batches))]
    for n, r in preset.niah_grid:
        jobs.append((f"niah-N{n}R{r}", EvalOptions(
            task="niah", needles=n, queries=r, depths=depths, samples=preset.samples,
            lengths=tuple(preset.niah_lengths))))
    n, r = preset.quant_niah
    jobs += [
        ("attention", EvalOptions(task="attention", needles=preset.attention_needles, queries=1,
                                  depths=depths, samples=preset.samples, lengths=train_len)),
        ("outliers", EvalOptions(task="outliers", tokens=preset.outlier_tokens)),
        ("quant", EvalOptions(task="quant", bits=(16, 8, 6, 4), niah=True,
                              batches=preset.eval_batches, needles=n, queries=r, depths=depths,
                              samples=preset.samples, lengths=train_len)),
    ]
    return jobs


def recall_jobs(preset: RecallPreset) -> list[tuple[str, EvalOptions]]:
    """(name, options) of every evaluation of one recall model at its final step: the grid, and
    the learning curve's cell at every checkpoint step (`step=`)."""
    jobs = [(recall_cell_name(n, d), EvalOptions(
        task="recall", needles=n, queries=recall.max_queries(n, d), distractors=d,
        samples=preset.samples, lengths=tuple(preset.grid_lengths)))
        for n, d in preset.grid_cells]
    cfg = preset.config("diff", 0, Path("unused"))
    n, d = preset.curve_cell
    every, last = cfg.checkpoint.every_steps, cfg.train.steps  # the last step is saved too: a
    # curve of --steps 1000 ends at 1000, not 900, and one below every_steps has a point
    for step in sorted({*range(every, last + 1, every), last}):
        jobs.append((f"{recall_cell_name(n, d)}-step{step}", EvalOptions(
            task="recall", needles=n, queries=recall.max_queries(n, d), distractors=d,
            samples=preset.samples, lengths=(preset.grid_lengths[0],), step=step)))
    return jobs


def _add_wall(run: Path, key: str, seconds: float) -> None:
    """Add `seconds` to `key` of RUN/wall.json (`layout.read_wall`), making it when missing; the
    file is replaced whole or not at all (`write_whole`)."""
    path = run / "wall.json"
    wall = read_wall(run) if path.exists() else {}
    wall[key] = wall.get(key, 0.0) + seconds
    write_whole(path, json.dumps(wall, indent=1) + "\n")


def prepare_corpus(preset: Preset | RecallPreset, seed: int, out: Path) -> Path:
    """Write (once) the corpus that every model of `seed` reads (`presets.corpus_dir`).

    A recall preset: its training samples, one a row, with the loss mask of `preset.train_loss`.
    A language-modeling preset: the corpus its `data` overrides name (`data.load_corpus`: the
    sources mixed with the seed's synthetic needles), tokenized here once instead of in every
    run and evaluation; the runs split off the same validation documents from it. meta.json
    carries the unigram loss of the validation split under the training split's token
    frequencies (`data.unigram_loss`), the bar every model must clear. The corpus is written
    whole or not at all (`output_dir.staged`): written in place, a Ctrl-C or a kill inside its
    meta.json's write left that cut short, which the next run refused as damaged. DataError when
    a run would read a training document twice (the training split holds fewer rows than
    `train.steps` × `train.batch_size`); ConfigError, the file left as it is, when the corpus
    is there but its meta.json holds no JSON object (`layout.read_corpus_meta`).
    """
    path = corpus_dir(out, seed)
    cfg = preset.corpus_config(seed)
    if (path / "meta.json").exists():
        meta = read_corpus_meta(path)
        # prepared before meta.json carried these: add them from the saved corpus
        added = {}
        needs_loss = not isinstance(preset, RecallPreset) and "unigram_loss" not in meta
        if needs_loss or "sha256" not in meta:
            saved = data.load(path)
            if needs_loss:
                train, held_out = saved.split(cfg.data.validation_fraction, cfg.data.split_seed)
                added["unigram_loss"] = data.unigram_loss(train, held_out)
            if "sha256" not in meta:
                added["sha256"] = saved.sha256()
        if added:
            write_whole(path / "meta.json", json.dumps(meta | added, indent=1))
        return path
    t = cfg.train
    if isinstance(preset, RecallPreset):
        spec = {"length": t.seq_len - 1, "max_pairs": preset.max_pairs,
                "distractor_shares": tuple(preset.train_distractors)}
        samples = recall.training_samples(recall.train_rng(seed), count=t.steps * t.batch_size,
                                          **spec)
        with staged(path) as written:
            recall.write_training_corpus(written, samples, {"seed": seed, **spec},
                                         loss=preset.train_loss)
        return path
    corpus = data.load_corpus(cfg.data, seed)
    train, held_out = corpus.split(cfg.data.validation_fraction, cfg.data.split_seed)
    rows = len(data.PackedRows(train, t.seq_len, seed))
    if rows < t.steps * t.batch_size:
        raise data.DataError(
            f"{preset.name}: the training split of {cfg.data.mixture or cfg.data.source} "
            f"{list(cfg.data.paths)} holds {rows:,} rows of {t.seq_len} tokens, fewer than the "
            f"{t.steps:,} × {t.batch_size} the preset reads: documents would repeat; add text to "
            "the sources or run fewer --steps")
    with staged(path) as written:
        corpus.save(written, {"seed": seed, "sources": cfg.data.mixture or cfg.data.source,
                              "paths": list(cfg.data.paths), "tokenizer": cfg.data.tokenizer,
                              "validation_fraction": cfg.data.validation_fraction,
                              "train_tokens": int(len(train.tokens)), "train_rows": rows,
                              "rows_read": t.steps * t.batch_size,
                              "unigram_loss": data.unigram_loss(train, held_out)})
    return path


def train_and_evaluate(preset: Preset | RecallPreset, variant: str, seed: int, init: str,
                       out: Path, sets: tuple[str, ...] = (), label: str | None = None,
                       only: tuple[str, ...] | None = None) -> Path:
    """Train (or resume) one model, then run every evaluation not yet done at its step (those
    named in `only`, when given). An ablation adds `sets` to the recipe and trains in
    OUT/runs/LABEL-INIT-sSEED. ConfigError before any work when a record the run adds to is
    damaged (`_check_records`)."""
    run = run_dir(out, label or variant, seed, init)
    config = preset.config(variant, seed, run, init, sets)
    jobs = [j for j in _jobs_of(preset) if only is None or j[0] in only]
    todo = [(name, options) for name, options in jobs
            if not _evaluated(run, name, options.step or config.train.steps)]
    if not todo:  # finished: here, or on another machine (`adopt_finished`, no checkpoints)
        return run
    _check_records(run)
    t0 = time.perf_counter()
    result = train_loop.run(config)
    if result.status != "already done":  # a Ctrl-C'd run's steps are saved: its time counts
        _add_wall(run, "train_s", time.perf_counter() - t0)
    if result.status == "interrupted":
        raise KeyboardInterrupt(f"{run}: training interrupted at step {result.step}")
    record_device(run)
    devices, _ = eval_devices([])  # the first device: a preset's evaluations take no mesh.*
    step, loaded = -1, None  # the jobs of one checkpoint step follow each other: one load
    for name, options in todo:
        t0 = time.perf_counter()
        out_dir = eval_json(run, name).parent
        advice = f"{options.memory_advice(devices)} (the preset's evaluation {name} of {run})"
        with fit_or_explain(advice):
            if loaded is None or options.step != step:
                step, loaded = options.step, evaluation.load(_at(options, run, out_dir), [])
            evaluation.evaluate(dataclasses.replace(loaded, out_dir=out_dir), options)
        _add_wall(run, f"eval_{name}_s", time.perf_counter() - t0)
    return run


def _jobs_of(preset: Preset | RecallPreset) -> list[tuple[str, EvalOptions]]:
    return recall_jobs(preset) if isinstance(preset, RecallPreset) else lm_jobs(preset)


def _check_records(run: Path) -> None:
    """ConfigError naming the first of RUN's records that `train_and_evaluate` adds to and the
    reports read (wall.json: `layout.read_wall`; device.json: `layout.read_devices`) that is
    there but damaged (cut short by a kill, edited by hand): what it holds cannot be made again,
    so it is left for the user to mend."""
    if (run / "wall.json").exists():
        read_wall(run)
    read_devices(run)


def _json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`; None when the file is missing or unreadable (e.g. cut short by
    a kill) or holds no object (`layout.read_json` would refuse it)."""
    try:
        return read_json(path, "a JSON object")
    except (OSError, ConfigError):
        return None


def _json_field(path: Path, key: str, kind: type) -> Any:
    """`key` of the JSON object in `path` (`_json_object`) when it is a `kind` (a bool is no
    int), else None: no object there, or `key` absent or of another type."""
    value = (_json_object(path) or {}).get(key)
    return value if is_a(value, kind) else None


def _evaluated(run: Path, name: str, step: int) -> bool:
    """Whether eval job `name` of `run` has its JSON, written at `step` (an unreadable one is
    not: the job runs again and rewrites it)."""
    return _json_field(eval_json(run, name), "step", int) == step


def record_device(run: Path) -> None:
    """Add this process's machine (jax's device_kind and platform of its first device, the device
    count, the jax version) to RUN/device.json (`layout.read_devices`), unless listed; the file
    is replaced whole or not at all (`write_whole`)."""
    import jax

    dev = jax.devices()[0]
    entry = {"device_kind": dev.device_kind, "platform": dev.platform,
             "devices": jax.device_count(), "jax": jax.__version__}
    path = device_json(run)
    seen = read_devices(run)
    if entry not in seen:
        write_whole(path, json.dumps([*seen, entry], indent=1) + "\n")


# What a finished model's directory holds that its report reads (`adopt_finished` copies them,
# all but device.json required: the reports read wall.json's training time): no checkpoint,
# which a finished model's report never reads.
REQUIRED_FILES = ("config.yaml", "metrics.jsonl", "wall.json")
FINISHED_FILES = (*REQUIRED_FILES, "device.json")


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def _config_differences(recorded: dict, expected: dict, recorded_out: Path, out: Path) -> list[str]:
    """'section.key: RECORDED there, EXPECTED here' for every setting of two config dicts that
    differs once `recorded_out` (the directory the recorded run was trained in) reads as `out`
    in its paths. A setting the recorded config lacks was added to the code after that run
    trained; it differs only where `expected` gives it a value other than its default (a new
    setting's default is the behaviour the code had before it)."""
    def here(value: Any) -> Any:
        if isinstance(value, str):
            return value.replace(str(recorded_out), str(out))
        return [here(x) for x in value] if isinstance(value, list) else value

    a, b = _flat(recorded), _flat(expected)
    defaults = _flat(Config().to_dict())
    a |= {k: defaults[k] for k in b.keys() - a.keys() if k in defaults}
    return [f"{k}: {a.get(k)!r} there, {b.get(k)!r} here" for k in sorted(a.keys() | b.keys())
            if here(a.get(k)) != b.get(k)]


def adopt_finished(preset: Preset | RecallPreset, seed: int, init: str, out: Path,
                   source: Path) -> list[str]:
    """Take the models of (`seed`, `init`) that `source` finished as finished in `out`; one
    line per model of `source` saying what was taken, or why not.

    `source` is another directory of this preset's replication, or a copy of its small files
    (`benchmarks/hopper_session.py` brings them back from a GPU machine: no checkpoints, no
    corpus). A model is finished there when its `REQUIRED_FILES` exist, every evaluation holds
    the final step and its records are readable: the note of one whose record (an evaluation
    JSON, config.yaml, ...) is there but damaged (cut short, edited by hand, not UTF-8:
    `_damaged`, `_recorded_config`) names the file. It is taken when `out`'s corpus of the seed
    is the one it trained on (meta.json's `sha256`, which `prepare_corpus` writes),
    its recorded config is the one this preset gives it (its training directory read as
    `out`'s), and `out` holds no run of it yet. Taking copies `FINISHED_FILES` and its
    evaluations (RUN/replicate/) and writes RUN/adopted.json naming `source`;
    `train_and_evaluate` then neither trains nor evaluates it. So a replication too long for one
    machine's session finishes over several: each session's finished models are kept, and only
    a model cut short (or one whose records were damaged there) is trained again.
    """
    notes = []
    ours = _json_field(corpus_dir(out, seed) / "meta.json", "sha256", str)
    theirs_path = corpus_dir(source, seed) / "meta.json"
    theirs = _json_field(theirs_path, "sha256", str)
    for variant in VARIANTS:
        src, dst = run_dir(source, variant, seed, init), run_dir(out, variant, seed, init)
        if not src.is_dir():
            continue
        config = preset.config(variant, seed, dst, init)
        steps = {name: options.step or config.train.steps for name, options in _jobs_of(preset)}
        if all(_evaluated(dst, name, step) for name, step in steps.items()):
            continue  # finished here
        missing = [f"{name} at step {step}" for name, step in steps.items()
                   if _unevaluated(src, name, step)]
        missing += [f for f in REQUIRED_FILES if not (src / f).is_file()]
        why = None
        if missing:
            why = f"not finished there (no {', '.join(missing)})"
        elif (damaged := _damaged(src, list(steps))) is not None:
            why = damaged
        elif dst.exists():
            why = f"{dst} exists: a run of it started here"
        elif theirs is None:
            why = f"{theirs_path} records no corpus digest (sha256) to compare"
        elif theirs != ours:
            why = (f"trained on another corpus (sha256 {theirs[:12]}… there, {str(ours)[:12]}… "
                   "here)")
        else:
            try:
                recorded, recorded_out = _recorded_config(src)
            except ConfigError as e:
                recorded, why = None, str(e)
            if recorded is not None:
                diffs = _config_differences(recorded, yaml.safe_load(dump_config(config)),
                                            recorded_out, out)
                if diffs:
                    why = "another config: " + "; ".join(diffs)
        if why is not None:
            notes.append(f"{src.name}: not taken: {why}")
            continue
        with staged(dst) as taken:  # whole or not at all: a part taken would count as a start
            for name in FINISHED_FILES:
                if (src / name).is_file():
                    shutil.copy(src / name, taken / name)
            shutil.copytree(src / "replicate", taken / "replicate")
            write_whole(taken / "adopted.json", json.dumps(
                {"from": str(src.resolve()), "corpus_sha256": ours}, indent=1) + "\n")
        notes.append(f"{src.name}: taken as finished from {src}")
    return notes


def _unevaluated(run: Path, name: str, step: int) -> bool:
    """Whether `run` lacks eval job `name`'s JSON at `step`: it is missing, or a readable one of
    another step (one that is there but damaged is not: `_damaged` names it)."""
    path = eval_json(run, name)
    return not path.is_file() or _json_field(path, "step", int) not in (None, step)


def _damaged(run: Path, jobs: list[str]) -> str | None:
    """What `_check_records`, `lm_report.read_metrics` or `layout.read_eval` says of the first
    damaged record of the finished `run`, its evaluation JSONs of `jobs` among them (one without
    an integer step too); None when they are readable."""
    try:
        _check_records(run)
        lm_report.read_metrics(run)
        for path in (eval_json(run, name) for name in jobs):
            field(read_eval(path), path, "step", int, "the checkpoint step it evaluated (an "
                                                      "integer)")
    except ConfigError as e:
        return str(e)
    return None


def _recorded_config(run: Path) -> tuple[dict[str, Any], Path]:
    """The settings RUN/config.yaml records (`config.read_yaml`) and the directory the run was
    trained in (OUT of its train.run_dir, OUT/runs/RUN); ConfigError naming the file when it is
    no YAML text of sections (not UTF-8, cut short, edited by hand) or names no such run_dir."""
    path = run / "config.yaml"
    recorded = read_yaml(path)
    train = recorded.get("train")
    run_dir_there = train.get("run_dir") if isinstance(train, dict) else None
    if not isinstance(run_dir_there, str) or len(Path(run_dir_there).parents) < 2:
        raise ConfigError(f"{path}: train.run_dir must name the run's directory (OUT/runs/RUN), "
                          f"got {run_dir_there!r}")
    return recorded, Path(run_dir_there).parents[1]


def _at(options: EvalOptions, run: Path, out_dir: Path) -> EvalOptions:
    """`options` evaluating the checkpoint of `run` into `out_dir`."""
    return dataclasses.replace(options, checkpoint=str(run), out_dir=str(out_dir))


# {"preset": NAME, "steps": N}: the preset whose corpora and runs OUT holds, at N training
# steps (`--steps`; a marker without them is at the preset's own)
PRESET_MARKER = "replicate.json"


def _preset_record(path: Path) -> tuple[str, int | None] | None:
    """(preset name, steps) that `path` (a `PRESET_MARKER` or results.json) records, steps None
    where it records none; None when it is missing or unreadable or names no preset.
    ConfigError naming the file and field when `preset` is not a string or `steps` not an
    integer in [1, MAX_STEPS]. A `PRESET_MARKER` that is there but damaged (no JSON object, no
    `preset`) is a ConfigError too, the file left as it is: read as missing, the directory went
    to whichever preset ran there next, which evaluated and reported its runs as its own."""
    if path.name == PRESET_MARKER and path.exists():
        recorded = read_json(path, 'a JSON object ({"preset": NAME, "steps": N}: the preset '
                                   "whose runs the directory holds)")
    else:
        recorded = _json_object(path)
        if recorded is None or recorded.get("preset") is None:
            return None
    name = field(recorded, path, "preset", str, "a preset's name (a string)")
    steps = recorded.get("steps")
    if steps is not None and (not is_a(steps, int) or not 1 <= steps <= MAX_STEPS):
        raise ConfigError(f"{path}: steps must be an integer in [1, {MAX_STEPS}], got {steps!r}")
    return name, steps


def _recorded_presets(directory: Path) -> list[tuple[Path, str, int | None]]:
    """(file, preset name, steps) for each of `directory`'s `PRESET_MARKER` and results.json
    that names a preset (`_preset_record`)."""
    paths = (directory / PRESET_MARKER, directory / "results.json")
    return [(path, *record) for path in paths if (record := _preset_record(path)) is not None]


def _holds_other(preset: Preset | RecallPreset, directory: Path) -> str | None:
    """'--preset NAME [--steps N] (FILE)' of the first record in `directory` of another preset,
    or of this one at other training steps (a record without steps is at its preset's own);
    None when there is none."""
    for path, name, steps in _recorded_presets(directory):
        if steps is None and name in PRESETS:
            steps = PRESETS[name].steps
        if (name, steps) != (preset.name, preset.steps):
            return f"{preset_args(name, steps)} ({path})"
    return None


def recorded_preset(out: Path) -> Preset | RecallPreset:
    """The preset whose runs `out` holds, at the training steps its `PRESET_MARKER` records;
    ConfigError when it has no readable marker, one of the wrong types (`_preset_record`), or
    names a preset this version does not know."""
    record = _preset_record(out / PRESET_MARKER)
    if record is None:
        raise ConfigError(f"{out}: holds no replication (python -m diff_jax.experiments."
                          f"replicate --out {out} writes its {PRESET_MARKER} naming a preset)")
    name, steps = record
    if name not in PRESETS:
        raise ConfigError(f"{out}: holds --preset {name}, which this version does not know")
    return PRESETS[name] if steps is None else PRESETS[name].with_steps(steps)


def refuse_other(preset: Preset | RecallPreset, out: Path) -> None:
    """ConfigError when `out` already holds another preset's corpora and runs, or this preset's
    at other steps (its marker, or the `preset` and `steps` of its results.json), which this one
    would otherwise read as its own and resume."""
    other = _holds_other(preset, out)
    if other is not None:
        raise ConfigError(f"--out {out}: holds the runs of {other}; choose another --out for "
                          f"{preset_args(preset.name, preset.steps)}")


def claim_out(preset: Preset | RecallPreset, out: Path) -> None:
    """Mark `out` as `preset`'s at its training steps (`PRESET_MARKER`), or ConfigError (nothing
    written) when it holds another's (`refuse_other`)."""
    refuse_other(preset, out)
    out.mkdir(parents=True, exist_ok=True)
    write_whole(out / PRESET_MARKER, json.dumps({"preset": preset.name, "steps": preset.steps})
                + "\n")


def replicate(preset: Preset | RecallPreset, seeds: int, out: Path, jobs: int = 1,
              finished_from: Path | None = None) -> dict:
    """Every (init, seed, model) trained and evaluated, `jobs` models at a time (`side_by_side`),
    then the report; returns results.json's content. With `finished_from`, the models it
    finished are taken first (`adopt_finished`). ValueError (before any work) when this
    process cannot give `jobs` models a core each; ConfigError when `finished_from` is `out` or
    holds another preset's runs."""
    shares = cpu_shares(jobs) if jobs > 1 else None
    summaries = check_matched(preset)
    if finished_from is not None:
        _check_source(preset, finished_from, out)
    refuse_other(preset, out)  # before anything is written into it
    # made before the corpora are tokenized (an OUT that cannot be made fails first); a corpus
    # too small for the steps is refused before OUT is claimed, and OUT is removed again
    with made(out):
        for seed in range(seeds):
            prepare_corpus(preset, seed, out)
    claim_out(preset, out)
    runs = []
    for init in preset.inits:
        for seed in range(seeds):
            if finished_from is not None:
                for note in adopt_finished(preset, seed, init, out, finished_from):
                    print(f"--finished-from: {note}", flush=True)
            runs += [(variant, seed, init) for variant in VARIANTS]
    if shares is None:
        for variant, seed, init in runs:
            _train_and_evaluate_one(preset, variant, seed, init, out)
    else:
        side_by_side(preset, runs, out, shares)
    if isinstance(preset, RecallPreset):
        return recall_report.write(preset, seeds, out, summaries)
    return lm_report.write(preset, seeds, out, summaries)


def _check_source(preset: Preset | RecallPreset, source: Path, out: Path) -> None:
    """ConfigError unless `source` is a directory other than `out` that holds no other preset's
    runs, nor this one's at other training steps (its `PRESET_MARKER` or results.json)."""
    if not source.is_dir():
        raise ConfigError(f"--finished-from {source}: " + ("not a directory" if source.exists()
                                                            else "no such directory"))
    if source.resolve() == out.resolve():
        raise ConfigError(f"--finished-from {source}: is --out itself; its finished models are "
                          "kept anyway")
    if not _recorded_presets(source):  # e.g. OUT/runs for OUT: nothing would be taken, unsaid
        raise ConfigError(f"--finished-from {source}: holds no replication (no {PRESET_MARKER} "
                          "or results.json); name the directory a replicate --out wrote")
    other = _holds_other(preset, source)
    if other is not None:
        raise ConfigError(f"--finished-from {source}: holds the runs of {other}, not "
                          f"{preset_args(preset.name, preset.steps)}")


def _train_and_evaluate_one(preset: Preset | RecallPreset, variant: str, seed: int, init: str,
                            out: Path) -> None:
    print(f"== {preset.name}: {variant}, init {init}, seed {seed} ==", flush=True)
    train_and_evaluate(preset, variant, seed, init, out)


def core_shares(cores: list[int], jobs: int) -> list[list[int]]:
    """`cores` dealt out to `jobs` disjoint, non-empty shares (round robin); ValueError when there
    are fewer cores than jobs."""
    if jobs < 1 or len(cores) < jobs:
        raise ValueError(f"--jobs {jobs}: this process may use {len(cores)} CPU core(s) "
                         f"({cores}); expected 1 <= jobs <= {len(cores)}")
    ordered = sorted(cores)
    return [ordered[i::jobs] for i in range(jobs)]


def cpu_shares(jobs: int) -> list[list[int]]:
    """This process's CPU cores (its affinity) dealt out to `jobs` (`core_shares`); ValueError
    where there are too few or the platform cannot pin a process to cores."""
    if not hasattr(os, "sched_getaffinity"):
        raise ValueError(f"--jobs {jobs} pins processes to CPU cores, which this platform does "
                         "not support: use --jobs 1")
    return core_shares(sorted(os.sched_getaffinity(0)), jobs)


def _pinned_worker(preset: Preset | RecallPreset, variant: str, seed: int, init: str, out: Path,
                   cores: list[int], kept: multiprocessing.connection.Connection) -> None:
    """One model in a spawned process: pinned to `cores` before JAX starts its CPU client.

    It starts with `STOPS` blocked (`_start_blocked`): a signal sent while Python starts up
    (importing modules) waits. First it leaves the command's process group, so that a Ctrl-C at
    the terminal reaches it once, forwarded by `side_by_side`; it takes SIGINT, SIGTERM and SIGHUP
    alike, as a Ctrl-C (outside training it stops at once; in training `train_loop` saves the
    step on the first; a SIGHUP points its stdout and stderr off the closed terminal); it writes
    to the terminal from the background (SIGTTOU ignored, for `stty tostop`). Then it unblocks
    them: one sent before it trains stops it before training.
    Stopped by either, it sends what it kept (the KeyboardInterrupt's text: the step its
    training saved; "RUN: stopped before training"; or "" when it stopped at once) through
    `kept` and exits `EXIT_INTERRUPTED` without a line of its own: `side_by_side`'s one
    `interrupted:` line says it for every run."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    unsaved = f"{run_dir(out, variant, seed, init)}: stopped before training"
    try:
        with as_ctrl_c():  # the worker starts with Python's SIGTERM action; a closed stdout too
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)  # those sent so far arrive
            os.sched_setaffinity(0, cores)
            import jax

            if jax.default_backend() != "cpu":
                sys.exit(failed(f"--jobs > 1 trains models side by side on CPU cores, but JAX's "
                                f"default backend here is {jax.default_backend()}: use --jobs 1"))
            unsaved = ""  # from here on a stop without a saved step is "stopped at once"
            _train_and_evaluate_one(preset, variant, seed, init, out)
    except train_loop.RUN_ERRORS as e:  # one line, as the serial path; its status says why
        sys.exit(train_loop.report(e, [(f"--out {out}", str(out))]))
    except KeyboardInterrupt as e:  # a signal `side_by_side` forwarded, one of its own, or a
        kept.send(str(e) or unsaved)  # closed stdout (`as_ctrl_c`, around the handlers above)
        leave(EXIT_INTERRUPTED)


def _start_blocked(process: multiprocessing.process.BaseProcess) -> None:
    """Start `process` with `STOPS` blocked: a spawned process keeps the mask through exec,
    and a signal sent to it waits until `_pinned_worker` unblocks it. multiprocessing's resource
    tracker is started first (where it is not running): starting it unblocks both signals
    (`resource_tracker.ensure_running`), and the first worker would start unprotected."""
    multiprocessing.resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _send(pid: int, signum: int, group: bool = False) -> None:
    """Send `signum` to the worker `pid`, or where `group` to its process group (its own,
    `_pinned_worker`; to `pid` alone while it has not made its group yet). A worker that has
    exited and been reaped since is skipped (`side_by_side` reads its exit): multiprocessing
    reaps its finished children as it starts another, so a worker still among the running could
    be gone, and the signal forwarded to it ended the command in a ProcessLookupError."""
    with contextlib.suppress(ProcessLookupError):
        if group:
            try:
                os.killpg(pid, signum)
                return
            except ProcessLookupError:
                pass
        os.kill(pid, signum)


def _suspend(pids: list[int]) -> None:
    """Ctrl-Z for `side_by_side` (SIGTSTP, which reaches the command's process group alone):
    stop each worker of `pids` (SIGSTOP to its group), then this process (the default action of
    SIGTSTP, raised with the handler set aside), and once it is continued (fg, bg: SIGCONT)
    continue the workers. Before, the command stopped and its workers trained on, the terminal
    given back to the shell, and fg continued the command alone. A stop the kernel discards (a
    process group without a parent in its session to resume it) continues them at once."""
    for pid in pids:
        _send(pid, signal.SIGSTOP, group=True)
    handler = signal.signal(signal.SIGTSTP, signal.SIG_DFL)
    try:
        signal.raise_signal(signal.SIGTSTP)  # returns once continued
    finally:
        signal.signal(signal.SIGTSTP, handler)
    for pid in pids:
        _send(pid, signal.SIGCONT, group=True)


def _read_signals(fd: int) -> list[int]:
    """The signal numbers written to the non-blocking `fd` (`_signals_woken`) since the last
    read; [] when none."""
    try:
        return list(os.read(fd, 512))
    except BlockingIOError:
        return []


@contextlib.contextmanager
def _signals_woken(caught: list[int]) -> Iterator[int]:
    """For the duration (main thread only) the signals of `STOPS` and SIGTSTP (Ctrl-Z,
    `_suspend`) do nothing here but write their number to a pipe, whose read end is yielded (to
    wait on and `_read_signals`), a SIGHUP once stdout and stderr are off the closed terminal
    (`off_the_terminal`). On the way out the previous handlers are restored, then the numbers of
    `STOPS` still unread are appended to `caught`."""
    read, write = os.pipe()
    for fd in (read, write):
        os.set_blocking(fd, False)  # set_wakeup_fd requires it of `write`
    previous = {s: signal.signal(s, lambda signum, frame: off_the_terminal(signum))
                for s in not_ignored((*STOPS, signal.SIGTSTP))}
    previous_fd = signal.set_wakeup_fd(write)
    try:
        yield read
    finally:
        signal.set_wakeup_fd(previous_fd)
        for s, handler in previous.items():
            signal.signal(s, handler)
        caught += [s for s in _read_signals(read) if s in STOPS]
        os.close(read)
        os.close(write)


class RunsFailed(RuntimeError):
    """Runs of `side_by_side` that failed; `status` is the exit status for them all: 2 when any
    failed on bad input (its worker exited 2), else 1."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def side_by_side(preset: Preset | RecallPreset, runs: list[tuple[str, int, str]], out: Path,
                 shares: list[list[int]]) -> None:
    """`train_and_evaluate` of every (variant, seed, init) in `runs`, one per share of CPU cores
    at a time (`cpu_shares`), each in a spawned process pinned to its share (`_pinned_worker`).

    After a run fails no new one starts; those running finish (each checkpoints as it goes), then
    `RunsFailed` names the failed runs with their exit status (each worker has printed why: one
    `error:` line for a `train_loop.RUN_ERRORS`, else a traceback). Re-running resumes, as the
    serial path does.

    Each worker runs in a process group of its own, so a Ctrl-C at the terminal (SIGINT to the
    command's group) reaches only this process, as does a SIGINT or SIGTERM sent to it alone
    (`kill`, `timeout`, a job scheduler): each one it gets is forwarded once to every worker
    running, started or still starting (`_signals_woken`), and no new run starts. As in the
    serial path, the first SIGINT or a SIGTERM makes each worker save its step and exit, a second
    SIGINT stops each at once. Once the running workers have exited, a KeyboardInterrupt says
    what each kept (`_stopped`): the workers print no `interrupted:` line, so the command prints
    one (exit status 130 for either signal, as the serial path's). A worker that a SIGINT of its
    own stopped, exit `EXIT_INTERRUPTED`, is an interruption too, not a failure: no new run
    starts, and once the others have finished the KeyboardInterrupt says what it kept (a
    signal here ends it so even where a run failed too: that run's output says why). A SIGHUP
    (the terminal closed) is a SIGTERM, forwarded as itself: each worker, writing to the same
    terminal, points its stdout and stderr off it, as this process does. Ctrl-Z (SIGTSTP) stops
    the running workers and then this process, and fg or bg continues them with it
    (`_suspend`); SIGQUIT ends it without its workers. Left by any other exception, it first
    sends the running workers SIGTERM and waits for them to exit.
    """
    spawn = multiprocessing.get_context("spawn")
    pending, free = list(runs), list(range(len(shares)))
    running: dict[int, tuple[int, multiprocessing.process.BaseProcess, tuple[str, int, str],
                             tuple[multiprocessing.connection.Connection, ...]]] = {}
    failures: list[tuple[str, int]] = []
    stopped: list[tuple[str, str]] = []  # (run, what it kept) of each a signal stopped
    caught: list[int] = []  # the signals this process got, each forwarded to the workers

    def finish(sentinel: int) -> None:
        slot, process, run, (kept, sends) = running.pop(sentinel)
        process.join()
        free.append(slot)
        path = run_dir(out, *run)
        if process.exitcode == EXIT_INTERRUPTED:
            stopped.append((path.name, (kept.recv() if kept.poll() else "")
                            or f"{path}: stopped at once"))
        elif process.exitcode != 0:
            failures.append((path.name, process.exitcode))
        kept.close()
        sends.close()

    def forward(signals: list[int]) -> None:
        pids = [process.pid for _, process, _, _ in running.values()]
        for signum in signals:  # any other signal with a Python handler: not forwarded
            if signum == signal.SIGTSTP:
                _suspend(pids)
            elif signum in STOPS:
                for pid in pids:
                    _send(pid, signum)

    with _signals_woken(caught) as woken:
        try:
            while running or (pending and not (failures or stopped or caught)):
                while pending and free and not (failures or stopped or caught):
                    slot, run = free.pop(0), pending.pop(0)
                    pipe = spawn.Pipe(duplex=False)  # (received here, sent by the worker)
                    process = spawn.Process(target=_pinned_worker,
                                            args=(preset, *run, out, shares[slot], pipe[1]))
                    _start_blocked(process)
                    running[process.sentinel] = (slot, process, run, pipe)
                for ready in multiprocessing.connection.wait([*running, woken]):
                    if ready == woken:
                        signals = _read_signals(woken)
                        caught += [s for s in signals if s in STOPS]
                        forward(signals)
                    else:
                        finish(ready)
        except BaseException:  # not left running behind the shell's prompt
            forward([signal.SIGTERM])
            for sentinel in list(running):
                finish(sentinel)
            raise
    if failures and not caught:
        names = ", ".join(f"{name} (exit {code})" for name, code in failures + [
            (name, EXIT_INTERRUPTED) for name, _ in stopped])
        raise RunsFailed(f"{preset.name}: {names} failed (its output above says why); "
                         f"{len(pending)} run(s) not started; re-run to resume",
                         EXIT_BAD_INPUT if any(code == EXIT_BAD_INPUT for _, code in failures)
                         else EXIT_NON_FINITE)
    if caught or stopped:
        raise _stopped(stopped, len(pending))


def _stopped(stopped: list[tuple[str, str]], pending: int) -> KeyboardInterrupt:
    """The KeyboardInterrupt of `side_by_side` stopped by a signal (Ctrl-C, SIGTERM): its text
    says what each run it `stopped` kept ((run, text) each) and how many runs did not start; ""
    when neither."""
    said = [kept for _, kept in stopped] + ([f"{pending} run(s) not started"] if pending else [])
    return KeyboardInterrupt("; ".join(said))


def _jobs(text: str) -> int:
    """`--jobs`: an integer >= 1 that this process's CPU cores can serve (`cpu_shares`)."""
    jobs = positive_int(text)
    if jobs > 1:
        try:
            cpu_shares(jobs)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return jobs


def _steps(text: str) -> int:
    """`--steps`: an integer in [1, MAX_STEPS]."""
    try:
        steps = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if not 1 <= steps <= MAX_STEPS:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, {MAX_STEPS}], got {steps}")
    return steps


def main(argv: list[str] | None = None) -> int:
    """The command line above; returns the exit status: 0, 2 on bad input (config, data, a
    refused checkpoint, a file in DIR that cannot be written, or read where damaged: one `error:`
    line, as train.py), 1 when a model diverged (or, with --jobs > 1, a model's process failed
    otherwise), 130 when a Ctrl-C, a SIGTERM or a SIGHUP (the terminal closed) stopped it (one
    `interrupted:` line, `as_ctrl_c`)."""
    parser = argparse.ArgumentParser(prog="python -m diff_jax.experiments.replicate",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu-small",
                        help="default: cpu-small")
    parser.add_argument("--seeds", type=int, default=None,
                        help="number of seeds (0, 1, …); default: the preset's")
    parser.add_argument("--inits", default=None,
                        help="comma list of the preset's inits to run (default: all of them)")
    parser.add_argument("--out", default=None, help="output directory (default: runs/replicate-PRESET)")
    parser.add_argument("--finished-from", default=None, metavar="DIR",
                        help="another directory of this preset's replication (or a copy of its "
                             "small files, no checkpoints needed): its finished models trained "
                             "on the same corpus with the same config are taken, not trained "
                             "again")
    parser.add_argument("--steps", type=_steps, default=None,
                        help="train every model this many steps instead of the preset's (the "
                             "schedule stretches with them; is a difference a matter of "
                             "budget?); --out must not hold the preset's runs at other steps")
    parser.add_argument("--jobs", type=_jobs, default=1,
                        help="models trained at a time, each pinned to its share of the CPU cores "
                             "(CPU only; default 1)")
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    seeds = preset.seeds if args.seeds is None else args.seeds
    if seeds < 1:
        parser.error("--seeds must be >= 1")
    if args.inits is not None:
        inits = tuple(args.inits.split(","))
        if not inits or not set(inits) <= set(preset.inits) or len(set(inits)) < len(inits):
            parser.error(f"--inits {args.inits}: expected distinct names among the preset's "
                         f"inits {','.join(preset.inits)}")
        preset = dataclasses.replace(preset, inits=inits)
    if args.steps is not None:
        preset = preset.with_steps(args.steps)
    out = Path(args.out or f"runs/replicate-{preset.name}")
    try:
        with as_ctrl_c():  # a SIGTERM, SIGHUP or closed stdout too: at any phase, any --jobs
            results = replicate(preset, seeds, out, args.jobs,
                                None if args.finished_from is None else Path(args.finished_from))
            print(f"wrote {out / 'results.md'}, {out / 'results.json'} and "
                  f"{len(results['plots'])} plots")
    except train_loop.RUN_ERRORS as e:  # what is saved stays; re-running resumes
        return train_loop.report(e, [(f"--out {out}", str(out))])
    except RunsFailed as e:
        return failed(str(e), e.status)
    except KeyboardInterrupt as e:  # a run's training saved its step and stopped, or Ctrl-C twice
        return run_kept(e, out)
    return 0


if __name__ == "__main__":
    leave(main())
