"""Ctrl-C in every command line (`diff_jax.command`): one `interrupted:` line saying what was
kept, exit status 130, no traceback; the process leaves without the interpreter's teardown."""

from __future__ import annotations

import importlib
import os
import multiprocessing
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _stop(*_args, **_kwargs):
    raise KeyboardInterrupt


def _stop_saved(*_args, **_kwargs):  # replicate's training saved its step after the first Ctrl-C
    raise KeyboardInterrupt("OUT/runs/diff-scaled-s0: training interrupted at step 7")


# (module, the function its main calls that the Ctrl-C lands in, argv, the interrupted line)
CASES = [
    ("diff_jax.eval", "run", ["task=ppl", "train.run_dir=RUN"],
     "stopped at once; each result file is whole (this run's or the earlier one)"),
    ("diff_jax.export.__main__", "export", ["RUN", "--out", "OUT"],
     "stopped at once; no half-written output is left at --out OUT"),
    ("diff_jax.export.hf_import", "read_hf", ["HF", "--out", "OUT"],
     "stopped at once; no half-written output is left at --out OUT"),
    ("diff_jax.data.__main__", "prepare", ["prepare", "stdlib", "OUT"],
     "stopped at once; no half-written output is left at OUT_DIR OUT"),
    ("diff_jax.experiments.replicate", "replicate", ["--preset", "micro", "--out", "OUT"],
     "stopped at once; what OUT holds is kept (the same command resumes)"),
    ("diff_jax.experiments.ablate", "ablate", ["OUT", "--set", "model.subln_init=0.5"],
     "stopped at once; what OUT holds is kept (the same command resumes)"),
    ("diff_jax.experiments.init_scale", "stdlib_rows", ["micro"],
     "stopped at once (it writes no file)"),
    ("diff_jax.summary", "summarize", [str(ROOT / "configs" / "tiny.yaml")],
     "stopped at once (it writes no file)"),
    ("diff_jax.interop", "run_reference", ["run-reference", "IN.npz", "OUT.npz"],
     "stopped at once; no half-written output is left at OUT.npz"),
]


@pytest.mark.parametrize("module,function,argv,line", CASES, ids=[c[0] for c in CASES])
def test_ctrl_c_is_one_interrupted_line_and_exit_130(module, function, argv, line, monkeypatch,
                                                     capsys):
    if module == "diff_jax.export.hf_import":
        pytest.importorskip("safetensors")
    cli = importlib.import_module(module)
    monkeypatch.setattr(cli, function, _stop)
    assert cli.main(argv) == 130
    err = capsys.readouterr().err
    assert err == f"interrupted: {line}\n", err


def test_replicate_names_the_run_whose_training_saved_its_step(monkeypatch, capsys):
    from diff_jax.experiments import replicate

    monkeypatch.setattr(replicate, "replicate", _stop_saved)
    assert replicate.main(["--preset", "micro", "--out", "OUT"]) == 130
    assert capsys.readouterr().err == (
        "interrupted: OUT/runs/diff-scaled-s0: training interrupted at step 7; what OUT holds is "
        "kept (the same command resumes)\n")


def test_ctrl_c_leaves_without_the_interpreters_teardown():
    """`python eval.py` stopped by Ctrl-C exits 130 with the interrupted line last: the
    teardown, which crashed or printed "lost sys.stderr" after a Ctrl-C that cut an XLA
    compilation short (by hand), is skipped. An exit handler that prints stands in for it."""
    script = "\n".join([
        "import atexit, runpy, sys",
        "import diff_jax.evaluation",
        "atexit.register(print, 'teardown ran', file=sys.stderr)",
        "def stopped(argv):",
        "    raise KeyboardInterrupt",
        "diff_jax.evaluation.run = stopped",
        "sys.argv = sys.argv[1:]",
        "runpy.run_path('eval.py', run_name='__main__')"])
    proc = subprocess.run([sys.executable, "-c", script, "eval.py", "task=ppl",
                           "train.run_dir=RUN"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "interrupted: stopped at once; each result file is whole (this run's or the earlier one)"]


@pytest.mark.parametrize("status", [2, 130])
def test_before_leaving_runs_as_the_process_leaves(status):
    """A `before_leaving` hook runs at the interpreter's exit, and before `leave` exits at once
    (where no exit handler runs)."""
    script = ("from diff_jax.command import before_leaving, leave\n"
              "before_leaving(lambda: print('hook ran', flush=True))\n"
              f"leave({status})")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert (proc.returncode, proc.stdout) == (status, "hook ran\n"), proc.stderr[-3000:]


def test_side_by_side_waits_for_its_workers_before_passing_ctrl_c_on(tmp_path, monkeypatch):
    """An exception (here a KeyboardInterrupt) while the parent waits: the parent sends its
    workers SIGTERM (each saves its step) and joins them before the exception leaves
    side_by_side (not leaving them running behind the shell's prompt)."""
    from diff_jax.experiments import presets, replicate

    def interrupted_wait(objects, timeout=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(replicate.multiprocessing.connection, "wait", interrupted_wait)
    runs = [("no-such-variant", 0, "scaled")]  # a worker that starts, then fails on its own
    with pytest.raises(KeyboardInterrupt):
        replicate.side_by_side(presets.PRESETS["micro"], runs, tmp_path,
                               replicate.cpu_shares(1))
    assert multiprocessing.active_children() == []


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # the child only exits
def test_a_side_by_side_worker_stopped_on_its_own_is_an_interruption_not_a_failure(tmp_path,
                                                                                   monkeypatch):
    """A worker that a SIGINT of its own stopped (exit 130, its step saved) was counted as a
    failed run, and the command exited 1 as for a bug. It is an interruption: no new run starts,
    and the KeyboardInterrupt (exit 130, one `interrupted:` line) names it, "stopped at once"
    where it sent nothing of a step saved."""
    from diff_jax.experiments import presets, replicate

    def worker(preset, variant, seed, init, out, cores, kept):  # forked: nothing to pickle
        os._exit(130 if variant == "diff" else 0)

    monkeypatch.setattr(replicate, "_pinned_worker", worker)
    fork = multiprocessing.get_context("fork")
    monkeypatch.setattr(replicate.multiprocessing, "get_context", lambda method: fork)
    runs = [("diff", 0, "scaled"), ("transformer", 0, "scaled"), ("diff_v2", 0, "scaled")]
    with pytest.raises(KeyboardInterrupt, match=rf"^{re.escape(str(tmp_path))}/runs/diff-scaled-"
                                                r"s0: stopped at once; 2 run\(s\) not started$"):
        replicate.side_by_side(presets.PRESETS["micro"], runs, tmp_path, replicate.cpu_shares(1))
    assert multiprocessing.active_children() == []


def _unread(script: list[str], buffered: bool, stderr_too: bool = False
            ) -> subprocess.CompletedProcess:
    """`script` run by Python from the repository root with its stdout (and, `stderr_too`, its
    stderr: `2>&1 | head`) a pipe whose reader is gone before it writes (`| head -0`, or a
    `head -3` that has read its lines), stdout `buffered` (block-buffered, as Python makes a
    pipe, the first write then coming at a flush) or not (PYTHONUNBUFFERED=1)."""
    read, write = os.pipe()
    os.close(read)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    try:
        return subprocess.run([sys.executable, "-c", "\n".join(script)], cwd=ROOT, env=env,
                              stdout=write, stderr=write if stderr_too else subprocess.PIPE,
                              text=True, timeout=300)
    finally:
        os.close(write)


# (module, the function its main's work calls, argv, the interrupted line) for each command
# whose stdout is read through a pipe: eval, the replication commands, a benchmark script
# (`command.concluded`)
UNREAD = [case for case in CASES if case[0] in ("diff_jax.eval", "diff_jax.experiments.replicate",
                                                 "diff_jax.experiments.ablate")] + [
    ("train_step", "measure", ["--out", "OUT"],
     "stopped at once; no half-written output is left at --out OUT")]


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("module,function,argv,line", UNREAD, ids=[c[0] for c in UNREAD])
def test_stdout_whose_reader_is_gone_is_one_interrupted_line_and_exit_130(
        module, function, argv, line, buffered):
    """`python eval.py ... | head` once head has gone: the next write to stdout raised
    BrokenPipeError (Python ignores SIGPIPE), which the commands took for bad input (`error:
    [Errno 32] Broken pipe`, exit 2), or, stdout block-buffered, which failed at the
    interpreter's exit flush ("Exception ignored", exit 120). Now it stops the command as a
    Ctrl-C does, its line saying why, exit 130; stdout is pointed at /dev/null, so the exit
    flush writes nowhere. The work, stood in for, prints a table."""
    proc = _unread([
        "import importlib, sys",
        "sys.path.insert(0, 'benchmarks')",
        "from diff_jax.command import leave",
        f"cli = importlib.import_module({module!r})",
        "def prints(*args, **kwargs):",
        "    print('a table of results')",
        "    return {'plots': [], 'label': 'changed', 'init': 'scaled'}",
        f"setattr(cli, {function!r}, prints)",
        f"leave(cli.main({argv!r}))"], buffered)
    assert (proc.returncode, proc.stderr) == (
        130, f"interrupted: the reader of stdout is gone (SIGPIPE); {line}\n"), proc.stderr[-3000:]


def test_an_error_line_into_a_pipe_whose_reader_is_gone_keeps_its_status():
    """`python eval.py ... 2>&1 | head` with bad input once head has gone: the `error:` line's
    write raised BrokenPipeError, a traceback into the pipe and exit 1. Now the line goes
    nowhere (stderr is pointed at /dev/null) and the status is still 2, bad input."""
    proc = _unread(["from diff_jax import eval",
                    "from diff_jax.command import leave",
                    "from diff_jax.evaluation import EvalError",
                    "def refuses(argv):",
                    "    raise EvalError('task=nope: expected one of ppl, ...')",
                    "eval.run = refuses",
                    "leave(eval.main(['task=nope']))"], buffered=False, stderr_too=True)
    assert proc.returncode == 2


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
def test_eval_help_into_a_pipe_whose_reader_is_gone_is_one_interrupted_line(buffered):
    """`python eval.py --help | head -3`: the help's write raised BrokenPipeError, a traceback
    and exit 1 (2 times in 5 by hand, as head went before or after the write). Now it is the
    Ctrl-C every command's closed stdout is."""
    proc = _unread(["from diff_jax import eval",
                    "from diff_jax.command import leave",
                    "leave(eval.main(['--help']))"], buffered)
    assert (proc.returncode, proc.stderr) == (
        130, "interrupted: the reader of stdout is gone (SIGPIPE); stopped at once (it writes no "
        "file)\n"), proc.stderr[-3000:]


FIXTURE = ROOT / "tests" / "fixtures" / "safetensors_export_v0"  # an export: a quick source

# (command, the lines of a script that run it on tiny inputs in TMP, its slow work stood in
# where it has one, setting `status`; the interrupted line's text after why; the file under TMP
# that holds its output, written whole before its last lines: None where none is)
FINISHED = [
    ("export", ["from diff_jax.export import __main__ as cli",
                f"status = cli.main([{str(FIXTURE)!r}, '--out', 'TMP/out'])"],
     "stopped once the output at --out TMP/out was written whole; it is kept", "out/export.json"),
    ("hf_import", ["from diff_jax.export import export, hf_import as cli",
                   f"export({str(FIXTURE)!r}, 'TMP/hf', 'hf-diffllama', tokenizer='none')",
                   "status = cli.main(['TMP/hf', '--out', 'TMP/out'])"],
     "stopped once the output at --out TMP/out was written whole; it is kept", "out/export.json"),
    ("data", ["from diff_jax.data import __main__ as cli",
              "status = cli.main(['prepare', 'TMP/text.txt', 'TMP/out'])"],
     "stopped once the output at OUT_DIR TMP/out was written whole; it is kept", "out/meta.json"),
    ("init_scale", ["from diff_jax.experiments import init_scale as cli, lm_report",
                    "cli.stdlib_rows = lambda tokenizer, seq_len: None",
                    "cli.residual_writes = lambda config, rows: None",
                    "lm_report.init_scale_table = lambda models, seq_len, corpus: ['a table']",
                    "status = cli.main(['micro'])"],
     "stopped at once (it writes no file)", None),
    ("attention", ["import attention",  # a row measured, as --smoke prints it
                   "attention._modes = lambda args, *_: print({'variant': 'fused'})",
                   "status = attention.command(['--smoke', '--out', 'TMP/out'])"],
     "stopped at once; no half-written output is left at --out TMP/out", None),
    # the benchmarks that write their output once, at the end, and print after it
    ("compile_cache", ["import compile_cache",
                       "compile_cache.run = lambda config, overrides, steps, repeats: {}",
                       "compile_cache.markdown = lambda result: 'a table'",
                       "status = compile_cache.main(['--out', 'TMP/out/cc'])"],
     "stopped once the output at --out TMP/out/cc was written whole; it is kept", "out/cc.md"),
    ("mosaic_ptxas", ["import types, mosaic_ptxas as m",
                      "m.sweep = lambda dims: []",
                      "m.gpu_devices = lambda topology: [types.SimpleNamespace(device_kind='H100')]",
                      "m.ptxas_version = lambda: 'ptxas'",
                      "status = m.main(['--out', 'TMP/out/ptx'])"],
     "stopped once the output at --out TMP/out/ptx was written whole; it is kept", "out/ptx.md"),
    ("generate", ["import generate",  # it printed its table before writing it: both were lost
                  "generate._run = lambda tree, args: {'tokens_per_s': 10.0, 'first_call_s': 1.0, "
                  "'loop_s': 1.0, 'device': 'cpu', 'jax': 'x'}",
                  "status = generate.main(['--rounds', '1', '--out', 'TMP/out/gen'])"],
     "stopped once the output at --out TMP/out/gen was written whole; it is kept", "out/gen.md"),
    ("continuations", ["import continuations",
                       "continuations.measure = lambda args: {'config': 'c', 'groups': 1, "
                       "'context': 4, 'labels': 2, 'label_tokens': 1, 'batch': 1, 'repeats': 1, "
                       "'device': 'cpu', 'jax': 'x', 'python': '3', 'max_abs_difference': 0.0, "
                       "'results': {name: {'median_s': 1.0, 'times_s': [1.0], 'first_call_s': 1.0} "
                       "for name in ('kv_cache', 'row_per_continuation')}}",
                       "status = continuations.main(['--out', 'TMP/out/cont'])"],
     "stopped once the output at --out TMP/out/cont was written whole; it is kept", "out/cont.md"),
    ("fit", ["import pathlib, fit",
             "fit.ROOT = pathlib.Path('TMP')",  # its results there, not in the repository's
             "fit.compile_one = lambda config, topology, impl, timeout: {'config': config, "
             "'topology': topology, 'impl': impl, 'error': 'compile > 1s'}",
             "status = fit.main(['--configs', 'diff-830m', '--impls', 'xla', '--slices', "
             "'v5p:2x2x2'])"],
     "stopped at once; the 1 row written so far is kept at benchmarks/results/tpu_fit.json",
     "benchmarks/results/tpu_fit.json"),
    ("mosaic_probe", ["import mosaic_probe",  # its first row's line: the row is written first
                      "mosaic_probe.probe = lambda name, *_: {'probe': name, 'status': 'ok'}",
                      "status = mosaic_probe.main(['--out', 'TMP/out', '--probes', "
                      "'fwd-d64,bwd-d128'])"],
     "stopped at once; the 1 row written so far is kept at --out TMP/out",
     "out/mosaic_probe.json"),
    ("kernel_profile", ["import kernel_profile",
                        "kernel_profile.profile = lambda d, schedule, args, out: {'d': d, "
                        "'schedule': schedule, 'T': args.t, 'error': 'exit 1'}",
                        "status = kernel_profile.main(['--out', 'TMP/out', '--head-dims', "
                        "'64,128', '--schedules', 'table'])"],
     "stopped at once; the 1 row written so far is kept at --out TMP/out",
     "out/kernel_profile.json"),
    ("hopper_session", ["import hopper_session",  # no time left: the stage is skipped
                        "status = hopper_session.main(['--out', 'TMP/out', '--stages', 'env', "
                        "'--total', '1'])"],
     "stopped at once; the 1 stage written so far is kept at --out TMP/out", "out/session.json"),
]


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("name,lines,kept,file", FINISHED, ids=[c[0] for c in FINISHED])
def test_the_last_lines_into_a_pipe_whose_reader_is_gone_are_one_interrupted_line(
        name, lines, kept, file, buffered, tmp_path):
    """`python -m diff_jax.export ... | head` once head has gone: the export, import, corpus
    and init_scale printed their last lines outside `command.as_ctrl_c`, and attention.py,
    fit.py and hopper_session.py ended in no `command.concluded`: a BrokenPipeError traceback
    (exit 1) or, stdout block-buffered, "Exception ignored" at the interpreter's exit flush
    (exit 120). Now it stops each as a Ctrl-C does, its line saying why, exit 130, and what
    was written is kept; the export, import and corpus, whole by then, say so, as do the
    benchmarks that write once, at their end, and print after it (compile_cache.py,
    mosaic_ptxas.py, generate.py; train_step.py measured), and fit.py, mosaic_probe.py,
    kernel_profile.py and hopper_session.py of the rows (stages) they wrote (their line said
    "no half-written output is left", as if nothing had been written); generate.py printed its
    table before writing it, and mosaic_probe.py and kernel_profile.py a row, which lost them."""
    if name == "hf_import":
        pytest.importorskip("safetensors")
    (tmp_path / "text.txt").write_text("a line of text to tokenize\n")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    proc = _unread(["import sys", "sys.path.insert(0, 'benchmarks')",
                    "from diff_jax.command import leave",
                    *(line.replace("TMP", str(tmp_path)) for line in lines),
                    "leave(status)"], buffered)
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == ("interrupted: the reader of stdout is gone (SIGPIPE); "
                                            + kept.replace("TMP", str(tmp_path)))
    if file:
        assert (tmp_path / file).is_file()


# (the signal, the signals `as_ctrl_c` is given, whether the block's code goes on after the
# collection)
DROPPED = {"SIGTERM, the code going on": ("SIGTERM", ("SIGTERM",), True),
           "SIGTERM as the block ends": ("SIGTERM", ("SIGTERM",), False),
           "Ctrl-C as the block ends": ("SIGINT", ("SIGINT",), False),
           "Ctrl-C under Python's own handler (signals=())": ("SIGINT", (), True)}


@pytest.mark.parametrize("case", list(DROPPED))
def test_a_signal_handled_inside_a_gc_callback_still_stops_the_block(case):
    """A SIGTERM (or Ctrl-C) whose handler runs while the interpreter calls a `gc.callbacks`
    entry (jax registers one, `_xla_gc_callback`) raises its KeyboardInterrupt there, where
    Python drops it as "Exception ignored": train.py signalled while it built its model trained
    to the end and exited 0. `as_ctrl_c` raises it again once the collection is over. Where the
    block ended first (the collection its last work), the signal was sent again after it: lost
    (a SIGTERM, its default action back) or a KeyboardInterrupt in the code after the block (a
    Ctrl-C); now the block ends in it. A Ctrl-C in a block that takes no signals (eval.py's,
    `concluded`'s) met Python's own handler, whose dropped KeyboardInterrupt was not raised
    again: the command ran on."""
    import gc
    import signal
    import time

    from diff_jax.command import as_ctrl_c

    name, taken, goes_on = DROPPED[case]

    def signalled_inside(phase, _info):
        if phase == "start":
            gc.callbacks.remove(signalled_inside)  # once
            signal.raise_signal(signal.Signals[name])  # its handler runs here, in the callback

    gc.callbacks.append(signalled_inside)
    stopped = []
    try:
        try:
            with as_ctrl_c(tuple(signal.Signals[s] for s in taken)):
                gc.collect()
                for _ in range(1000 if goes_on else 0):  # the code after the collection
                    time.sleep(0.01)
        except KeyboardInterrupt:
            stopped.append("the block")
        time.sleep(0.1)  # the code after the block
    except KeyboardInterrupt:  # caught: it would end the whole pytest session
        stopped.append("the code after it")
    finally:
        if signalled_inside in gc.callbacks:
            gc.callbacks.remove(signalled_inside)
    assert stopped == ["the block"]


@pytest.mark.parametrize("name", ["SIGINT", "SIGHUP", "SIGTERM"])
def test_a_stop_signal_the_process_was_started_ignoring_stays_ignored(name):
    """A shell script's `python train.py &` starts it with SIGINT ignored (the job shares the
    script's process group: a Ctrl-C meant for the script reaches it too), as `nohup` starts a
    command with SIGHUP ignored; `as_ctrl_c` and training's stop handler (both through
    `not_ignored`) installed their own handler for SIGINT over that, so the Ctrl-C stopped the
    background run. Now an ignored stop signal stays ignored inside the block, and SIGPIPE,
    which Python itself starts ignoring, is still taken (training's handler needs it)."""
    import signal
    import time

    from diff_jax.command import STOPS, as_ctrl_c, not_ignored

    signum = signal.Signals[name]
    before = signal.signal(signum, signal.SIG_IGN)
    try:
        assert not_ignored((*STOPS, signal.SIGPIPE)) == (
            *(s for s in STOPS if s != signum), signal.SIGPIPE)
        with as_ctrl_c():
            assert signal.getsignal(signum) == signal.SIG_IGN
            signal.raise_signal(signum)
            time.sleep(0.05)  # no KeyboardInterrupt
        assert signal.getsignal(signum) == signal.SIG_IGN
    finally:
        signal.signal(signum, before)


@pytest.mark.parametrize("presses", [2, 3])
def test_the_third_ctrl_c_ends_a_command_at_once_even_where_no_python_runs(presses):
    """Python runs a signal's handler only where the main thread runs Python; XLA compiling a
    step runs none for minutes, and there a second Ctrl-C took effect only once the compile was
    over. The third press now ends the process at once, wherever its main thread is: here a
    C call that holds it for minutes (PBKDF2, the GIL released, as XLA's compiler releases it),
    under a SIGINT handler that only notes a press, as training's first-press handler does. Two
    presses leave the command to its own handlers."""
    import signal
    import time

    from diff_jax.command import FORCE_PRESSES

    assert FORCE_PRESSES == 3
    rounds = 10**9 if presses == 3 else 10**4  # about 7 minutes, or at once
    script = "\n".join([
        "import hashlib, signal, time",
        "from diff_jax.command import as_ctrl_c",
        "seen = []",
        "with as_ctrl_c(signals=()):",
        "    signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))",
        "    print('ready', flush=True)",
        f"    hashlib.pbkdf2_hmac('sha256', b'key', b'salt', {rounds})",
        f"    while len(seen) < {presses}:",
        "        time.sleep(0.01)",
        "print('presses', len(seen), flush=True)"])
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        for _ in range(presses):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.2)
        out, err = proc.communicate(timeout=120)  # a hang guard: PBKDF2 runs for minutes
    finally:
        proc.kill()
    if presses == 3:
        assert proc.returncode == 130 and out == "", err[-3000:]
        assert err.splitlines()[-1] == (
            "interrupted: Ctrl-C pressed 3 times: stopped at once, as kill -9 stops it (what "
            "was committed is kept; a save in flight is not)")
    else:
        assert (proc.returncode, out, err) == (0, "presses 2\n", "")


def test_a_wakeup_fd_set_before_a_command_block_is_kept():
    """Where a wakeup fd is set already (an event loop's, an enclosing block's), `as_ctrl_c`
    counts no presses and leaves that fd in place: it was replaced by none (-1), which stopped
    the event loop's signal handling."""
    import signal

    from diff_jax.command import as_ctrl_c

    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    try:
        assert signal.set_wakeup_fd(write_end) == -1
        with as_ctrl_c(signals=()):
            assert signal.set_wakeup_fd(write_end) == write_end
        assert signal.set_wakeup_fd(-1) == write_end
        with as_ctrl_c(signals=()):  # none set: its own, removed on the way out
            own = signal.set_wakeup_fd(-1)
            signal.set_wakeup_fd(own, warn_on_full_buffer=False)
            assert own not in (-1, write_end)
        assert signal.set_wakeup_fd(-1) == -1
    finally:
        signal.set_wakeup_fd(-1)
        os.close(read_end)
        os.close(write_end)
