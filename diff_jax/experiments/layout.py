"""Where a replication keeps its runs, their evaluations and the machines they ran on, and how
their JSON files are read (one place for `replicate` and the reports that read them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from diff_jax.config import ConfigError
from diff_jax.experiments.presets import LABELS, VARIANTS

_JSON_TYPES = {dict: "a JSON object", list: "a JSON list", str: "a JSON string",
               bool: "a JSON boolean", int: "a JSON number", float: "a JSON number",
               type(None): "JSON null"}


def is_a(value: Any, kind: type | tuple[type, ...]) -> bool:
    """Whether the JSON `value` is a `kind` (a boolean is no number)."""
    return isinstance(value, kind) and not isinstance(value, bool)


class Record(dict):
    """A JSON object read from `where` (a file, or one of its lines): a key it lacks is one
    ConfigError naming `where` and the key (a file written by another version, or edited by
    hand), where a report reading it would stop in a KeyError's traceback."""

    def __init__(self, where: str, items: list[tuple[str, Any]]):
        super().__init__(items)
        self.where = where

    def __missing__(self, key: str) -> Any:
        raise ConfigError(f"{self.where}: has no {key} (a file another version wrote, or edited "
                          "by hand?)")


def parse_json(text: str | bytes, where: str, expected: str, kind: type = dict) -> Any:
    """The JSON value of `text` (read from `where`: a file, or one of its lines) when it is a
    `kind` (dict: an object; list: a list), each object in it a `Record`; ConfigError "WHERE:
    expected EXPECTED, got ..." when `text` is no JSON (cut short by a kill, edited by hand, not
    text) or another type."""
    try:
        value = json.loads(text, object_pairs_hook=lambda items: Record(where, items))
    except ValueError as e:  # JSONDecodeError, or bytes that decode to no text
        raise ConfigError(f"{where}: expected {expected}, got no valid JSON ({e})") from None
    if not isinstance(value, kind):
        got = next(name for t, name in _JSON_TYPES.items() if isinstance(value, t))  # a Record too
        raise ConfigError(f"{where}: expected {expected}, got {got}")
    return value


def read_json(path: Path, expected: str, kind: type = dict) -> Any:
    """The JSON value in the file `path` when it is a `kind` (`parse_json`: ConfigError naming
    `path` and `expected` otherwise); OSError when it cannot be read (a missing file among
    them)."""
    return parse_json(path.read_bytes(), str(path), expected, kind)


def field(record: dict[str, Any], path: Path, key: str, kind: type | tuple[type, ...],
          what: str, of: type | None = None) -> Any:
    """`record[key]` (of the JSON object in the file `path`) when it is a `kind` (`is_a`), each of
    its items a `of` where given; ConfigError naming the file and `key` otherwise, with `what`
    it should be."""
    if key not in record:
        raise ConfigError(f"{path}: has no {key} (expected {what})")
    value = record[key]
    if not is_a(value, kind) or (of is not None and not all(is_a(x, of) for x in value)):
        raise ConfigError(f"{path}: {key} must be {what}, got {value!r}")
    return value


def read_corpus_meta(corpus: Path) -> dict[str, Any]:
    """The meta.json of the prepared corpus in `corpus` (`replicate.prepare_corpus`), its
    record; ConfigError naming it unless it is a JSON object."""
    return read_json(corpus / "meta.json", "a JSON object (the corpus's record)")


def read_wall(run: Path) -> dict[str, float]:
    """RUN/wall.json, which `replicate` adds each stage's seconds to: {"train_s": …,
    "eval_JOB_s": …}. ConfigError naming the file (or its key) unless it is a JSON object of
    numbers; OSError when it cannot be read (a missing file among them)."""
    path = run / "wall.json"
    wall = read_json(path, "a JSON object of seconds per stage "
                           '({"train_s": …, "eval_JOB_s": …})')
    for key, seconds in wall.items():
        if not is_a(seconds, (int, float)):
            raise ConfigError(f"{path}: {key} must be a number of seconds, got {seconds!r}")
    return wall


def run_dir(out: Path, variant: str, seed: int, init: str) -> Path:
    """OUT/runs/VARIANT-INIT-sSEED: one trained model."""
    return out / "runs" / f"{variant}-{init}-s{seed}"


def eval_json(run: Path, name: str) -> Path:
    """Where eval job `name` writes: RUN/replicate/NAME/TASK.json (TASK: `name` up to its first
    '-'), a folder of its own, so that `eval.py` run by hand (which writes RUN/eval/) never
    replaces a replication result."""
    return run / "replicate" / name / f"{name.partition('-')[0]}.json"


def read_eval(path: Path) -> dict[str, Any]:
    """The result an eval job wrote to `path` (`eval_json`); ConfigError naming it unless it is
    a JSON object."""
    return read_json(path, "a JSON object (an evaluation's result)")


def recall_cell_name(pairs: int, distractors: float) -> str:
    """The eval job name of a recall grid cell, e.g. recall-N4-D50 (4 pairs, half distractors)."""
    return f"recall-N{pairs}-D{round(100 * distractors)}"


def device_json(run: Path) -> Path:
    """RUN/device.json: the machines that trained or evaluated the run (`replicate.record_device`),
    a list of {"device_kind", "platform", "devices", "jax"}."""
    return run / "device.json"


def read_devices(run: Path) -> list[dict[str, Any]]:
    """The machines RUN/device.json lists (`device_json`); [] when there is none. ConfigError
    naming the file unless it is a JSON list of objects, each with a string `device_kind`."""
    path = device_json(run)
    if not path.is_file():
        return []
    machines = read_json(path, 'a JSON list of machines ({"device_kind": …} each)', list)
    for i, entry in enumerate(machines):
        if not isinstance(entry, dict) or not isinstance(entry.get("device_kind"), str):
            raise ConfigError(f"{path}: entry {i} must be an object with a string device_kind, "
                              f"got {entry!r}")
    return machines


def device_kinds(runs: list[Path]) -> list[str]:
    """The distinct device kinds (jax's `device_kind`) recorded by `runs` (`read_devices`),
    sorted; runs without a record add none."""
    return sorted({entry["device_kind"] for run in runs for entry in read_devices(run)})


def run_devices(inits: tuple[str, ...], seeds: int, out: Path
                ) -> tuple[str | None, dict[str, list[str]]]:
    """(the device kinds of every run in `out` under `inits` and `seeds`, comma-joined, or None
    where no run recorded one; per variant, its runs' device kinds)."""
    runs = {v: [run_dir(out, v, s, i) for i in inits for s in range(seeds)] for v in VARIANTS}
    every = device_kinds([r for rs in runs.values() for r in rs])
    return ", ".join(every) or None, {v: device_kinds(rs) for v, rs in runs.items()}


def device_line(data: dict[str, Any]) -> list[str]:
    """Markdown lines naming the device of results.json `data` (per model where the models ran
    on different ones); none for a results.json that names no device."""
    if not data.get("device"):
        return []
    per_model = {v: ", ".join(m.get("devices", [])) for v, m in data["models"].items()}
    if len(set(per_model.values())) > 1:
        return ["Device: " + "; ".join(f"{LABELS[v]} on {d or 'an unrecorded device'}"
                                       for v, d in per_model.items()) + ".", ""]
    return [f"Device: {data['device']}.", ""]
