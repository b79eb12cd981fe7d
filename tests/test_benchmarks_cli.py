"""The benchmark scripts' command lines end as the project's commands do (`diff_jax.command`):
bad input in one `error:` line naming the argument, file or field and what was expected, exit
status 2, no traceback (an argument refused by argparse: its usage and one error line); a Ctrl-C
in one `interrupted:` line, exit status 130. All refused before anything compiles."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import limited_run
import pytest

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "kernels" / "tuning" / "mosaic_gpu.json"


def _refused(capsys, main, argv: list[str]) -> str:
    """The one `error:` line `main(argv)` printed, returning exit status 2."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err.strip()


def _usage_error(capsys, main, argv: list[str]) -> str:
    """argparse's error line for `argv` (after its usage), exit status 2."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ") and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


# (script, argv, the end of argparse's error line)
ARGUMENTS = [
    ("train_step", ["--steps", "0"], "argument --steps: expected an integer >= 1, got 0"),
    ("generate", ["--batch", "0"], "argument --batch: expected an integer >= 1, got 0"),
    ("generate", ["--repeats", "-1"], "argument --repeats: expected an integer >= 1, got -1"),
    ("generate", ["--baseline-tree", "/"],
     "argument --baseline-tree: expected a checkout of diff-jax (a directory holding "
     "diff_jax/__init__.py), got '/'"),
    ("compile_cache", ["--repeats", "0"], "argument --repeats: expected an integer >= 1, got 0"),
    ("continuations", ["--labels", "0"], "argument --labels: expected an integer >= 1, got 0"),
    ("prepare_memory", ["--sizes", "0"], "argument --sizes: expected an integer >= 1, got 0"),
    ("attention", ["--smoke", "--head-dims", "64,x"],
     "argument --head-dims: expected a comma list of integers >= 1, got '64,x'"),
    ("attention", ["--smoke", "--block", "64,0"],
     "argument --block: expected a comma list of integers >= 1, got '64,0'"),
    ("kernel_profile", ["--t", "8192", "--tokens", "4096"],
     "--tokens 4096: expected a multiple of --t 8192 (whole sequences)"),
    ("kernel_profile", ["--t", "4096", "--tokens", "10000"],
     "--tokens 10000: expected a multiple of --t 4096 (whole sequences)"),
    ("attention", ["--smoke", "--seqs", "2048,3000,5000", "--tokens", "32768"],
     "--tokens 32768: expected a multiple of every sequence length (--seqs, --tune-t), not of "
     "3000, 5000"),
    ("attention", ["--head-dims", "64,72,300"],
     f"--head-dims 64,72,300: {TABLE} has no bfloat16 row for d = 72, 300; it has d = 64, 96, 128, "
     "and the Triton kernel takes d a multiple of 16 in [16, 256]"),
    ("attention", ["--tune", "--head-dims", "128,80"],
     f"--head-dims 128,80: {TABLE} has no bfloat16 row for d = 80; it has d = 64, 96, 128"),
    ("kernel_profile", ["--head-dims", "128,80"],
     f"--head-dims 128,80: {TABLE} has no bfloat16 row for d = 80; it has d = 64, 96, 128"),
    ("mosaic_probe", ["--limit", "0"], "argument --limit: expected a number > 0, got '0'"),
    ("mosaic_probe", ["--split-registers", "256,20"],
     "argument --split-registers: expected K,V: two register counts, multiples of 8 in [24, 256] "
     "(what setmaxnreg takes), got '256,20'"),
    ("fit", ["--target", "h100", "--slices", "v5p:2x2x2"],
     "--slices: unknown v5p:2x2x2 for --target h100; expected some of h100:8, h100:16, h100:32, "
     "h100:64"),
]


def test_head_dims_are_refused_only_where_no_kernel_takes_them():
    """attention.py's --bench runs "fused" at a width the Mosaic GPU table lacks on Triton
    (d = 80: a multiple of 16), which --tune, starting from the table's row, cannot; --check
    and --smoke take no --head-dims."""
    import argparse

    import attention

    def why(head_dims, **modes):
        args = dict.fromkeys(("tune", "bench", "check", "smoke"), False) | modes
        return attention._untaken_head_dims(argparse.Namespace(head_dims=head_dims, **args))

    assert why([64, 80, 96]) is None and why([80], bench=True, check=True) is None
    assert why([80], tune=True).endswith("has no bfloat16 row for d = 80; it has d = 64, 96, 128")
    assert why([72], check=True) is None and why([72], smoke=True) is None
    assert why([72], smoke=True, tune=True) is not None


@pytest.mark.parametrize("script,argv,line", ARGUMENTS,
                         ids=[f"{a[0]}:{a[1][-2]}" for a in ARGUMENTS])
def test_a_bad_argument_is_refused_by_argparse(script, argv, line, capsys, tmp_path):
    """Each ran on (a negative --steps or --repeats found no median to take; a --baseline-tree
    that is no checkout failed in its subprocess after measuring this one; --head-dims with a
    letter raised ValueError; a --head-dims width no kernel takes was a refused row per route
    and length after the others compiled, under --tune a traceback, in kernel_profile.py a
    refused row per schedule; fit.py ranked an unknown slice after compiling on it)."""
    main = importlib.import_module(script).main
    out = [] if script == "fit" else ["--out", str(tmp_path / "out")]  # fit.py writes its own
    assert _usage_error(capsys, main, [*argv, *out]).endswith(f"error: {line}")


def test_a_bad_config_is_one_error_line_naming_it(capsys, tmp_path):
    """A missing config file or an unknown override: train_step.py names the model it was given
    for; generate.py and compile_cache.py read the config before any measurement (they ran
    their subprocesses, which each failed with a traceback of their own)."""
    import compile_cache
    import continuations
    import generate
    import train_step

    out = ["--out", str(tmp_path / "out")]
    missing = tmp_path / "missing.yaml"
    assert _refused(capsys, train_step.main, ["--diff", str(missing), *out]) == (
        f"error: --diff {missing}: config file not found: {missing}")
    assert _refused(capsys, train_step.main, ["--set", "model.bogus=1", *out]).startswith(
        "error: --diff configs/tiny.yaml: model.bogus: unknown key")
    assert _refused(capsys, generate.main, ["--config", str(missing), *out]) == (
        f"error: config file not found: {missing}")
    assert _refused(capsys, generate.main, ["--prompt", "500", "--new", "100", *out]) == (
        f"error: --prompt 500 + --new 100: more than the model.max_seq_len (512) of "
        f"{ROOT / 'configs/tiny.yaml'}")
    assert _refused(capsys, compile_cache.main, ["--set", "model.bogus=1", *out]).startswith(
        "error: model.bogus: unknown key")
    assert _refused(capsys, continuations.main, ["--context", "500", "--label-tokens", "14",
                                                 *out]) == (
        f"error: --context 500 + --label-tokens 14: more than the model.max_seq_len (512) of "
        f"{ROOT / 'configs/tiny.yaml'}")


# (script, arguments that keep the measurement small, had it run)
SMALL = [("train_step", ["--steps", "1", "--no-data", "--set", "model.num_layers=1"]),
         ("generate", ["--batch", "1", "--prompt", "4", "--new", "2", "--repeats", "1",
                       "--rounds", "1"]),
         ("compile_cache", ["--steps", "1", "--repeats", "1"]),
         ("continuations", ["--context", "4", "--labels", "2", "--groups", "1", "--repeats", "1"]),
         ("prepare_memory", ["--sizes", "1"])]


@pytest.mark.parametrize("script,small", SMALL, ids=[s[0] for s in SMALL])
def test_an_out_that_cannot_be_made_is_one_error_line_before_any_measurement(script, small,
                                                                             capsys, tmp_path):
    """--out under a file: refused first, naming --out (it was found after every measurement,
    a traceback)."""
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "out"
    main = importlib.import_module(script).main
    assert _refused(capsys, main, [*small, "--out", str(out)]) == (
        f"error: --out {out}: {tmp_path / 'file'}: File exists and is not a directory")


# (script, arguments that keep the run small, had it run): --out DIR is the directory they write in
DIRECTORY_OUT = [("kernel_profile", ["--head-dims", "64", "--schedules", "table"]),
                 ("mosaic_probe", ["--probes", "fwd-d64"])]


@pytest.mark.parametrize("script,small", DIRECTORY_OUT, ids=[s[0] for s in DIRECTORY_OUT])
def test_an_out_directory_that_cannot_be_made_is_one_error_line_before_any_child(
        script, small, capsys, tmp_path, monkeypatch):
    """kernel_profile.py and mosaic_probe.py: --out under a file is refused naming --out before
    a child (ncu, a probe) starts (it was a NotADirectoryError traceback, exit status 1)."""
    bench = importlib.import_module(script)
    monkeypatch.setattr(bench, "run_limited", _unexpected)
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "out"
    assert _refused(capsys, bench.main, [*small, "--out", str(out)]) == (
        f"error: --out {out}: {out}: Not a directory")


def _unexpected(*_args, **_kwargs):
    raise AssertionError("a child ran")


@pytest.mark.parametrize("status,code", [("ok", 0), ("hang", 1)])
def test_mosaic_probe_exits_1_when_a_probe_is_not_ok(status, code, tmp_path, monkeypatch):
    """benchmarks/hopper_session.py's probe stage reads the exit status ("exit 1": a probe hung
    or failed) beside DIR/mosaic_probe.json's rows."""
    import mosaic_probe

    monkeypatch.setattr(mosaic_probe, "probe", lambda name, *_: {"probe": name, "status": status})
    assert mosaic_probe.main(["--out", str(tmp_path), "--probes", "fwd-d64,bwd-d128"]) == code
    saved = json.loads((tmp_path / "mosaic_probe.json").read_text())
    assert [r["status"] for r in saved] == [status, status]


def test_a_child_that_refused_its_input_is_one_error_line(capsys, tmp_path, monkeypatch):
    """compile_cache.py: a train.py run that exited 2 ends the command with its error line and
    exit status 2 (a RuntimeError with the child's stderr)."""
    import compile_cache

    def refused(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 2, "", "a warning\nerror: data.paths: 'x' does "
                                                       "not exist\n")

    monkeypatch.setattr(compile_cache.subprocess, "run", refused)
    line = _refused(capsys, compile_cache.main, ["--out", str(tmp_path / "cc")])
    assert line.startswith("error: train.py --config configs/tiny.yaml train.steps=2 ")
    assert line.endswith(" exited 2: data.paths: 'x' does not exist")


def _stop(*_args, **_kwargs):
    raise KeyboardInterrupt


# (script, the function its main's work calls that the Ctrl-C lands in)
CTRL_C = [("train_step", "load_config"), ("generate", "_run"), ("compile_cache", "run"),
          ("prepare_memory", "_write_jsonl"), ("kernel_profile", "profile"),
          ("mosaic_probe", "probe")]


@pytest.mark.parametrize("script,function", CTRL_C, ids=[c[0] for c in CTRL_C])
def test_ctrl_c_is_one_interrupted_line_and_exit_130(script, function, capsys, tmp_path,
                                                     monkeypatch):
    """(a traceback, and whatever half of OUT.json a write had reached)."""
    bench = importlib.import_module(script)
    monkeypatch.setattr(bench, function, _stop)
    out = tmp_path / "out"
    assert bench.main(["--out", str(out)]) == 130
    assert capsys.readouterr().err == (f"interrupted: stopped at once; no half-written output is "
                                       f"left at --out {out}\n")


# (script, the function each row's work calls, what it returns for the first row, argv less
# --out, the file under --out holding the rows, the interrupted line's end; fit.py writes its own
# results, under ROOT, here the test's directory)
ROW_BY_ROW = [
    ("fit", "compile_one", lambda config, topology, impl, timeout: {
        "config": config, "topology": topology, "impl": impl, "error": "RESOURCE_EXHAUSTED"},
     ["--configs", "diff-830m", "--impls", "xla", "--slices", "v5p:2x2x2", "v5p:2x2x4"],
     "benchmarks/results/tpu_fit.json",
     "the 1 row written so far is kept at benchmarks/results/tpu_fit.json"),
    ("kernel_profile", "profile", lambda d, schedule, args, out: {
        "d": d, "schedule": schedule, "T": args.t, "error": "exit 1"},
     ["--head-dims", "64,128", "--schedules", "table"], "out/kernel_profile.json",
     "the 1 row written so far is kept at --out OUT"),
    ("mosaic_probe", "probe", lambda name, *_: {"probe": name, "status": "ok"},
     ["--probes", "fwd-d64,bwd-d128"], "out/mosaic_probe.json",
     "the 1 row written so far is kept at --out OUT"),
    ("hopper_session", "_run", lambda name, *_a, **_k: {  # env finds a GPU: check runs next
        "stage": name, "status": "ok", "tail": 'ENV {"backend": "gpu", "device_kind": "H100", '
                                               '"jax": "0.10.2"}\n'},
     ["--stages", "env,check"], "out/session.json",
     "the 1 stage written so far is kept at --out OUT"),
]


@pytest.mark.parametrize("script,function,first,argv,rows,kept", ROW_BY_ROW,
                         ids=[c[0] for c in ROW_BY_ROW])
def test_ctrl_c_after_a_row_was_written_says_the_rows_are_kept(
        script, function, first, argv, rows, kept, capsys, tmp_path, monkeypatch):
    """fit.py, kernel_profile.py, mosaic_probe.py and hopper_session.py write their rows (their
    stages) as they go, each rewrite whole: a Ctrl-C in the second leaves the first on disk, and
    their line said "stopped at once; no half-written output is left at --out OUT", read as
    nothing written. Now it counts the rows kept (`command.Written`)."""
    bench = importlib.import_module(script)
    calls = []

    def second_stops(*args, **kwargs):
        calls.append(args)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return first(*args, **kwargs)

    monkeypatch.setattr(bench, function, second_stops)
    if script == "fit":
        (tmp_path / "benchmarks" / "results").mkdir(parents=True)
        monkeypatch.setattr(bench, "ROOT", tmp_path)
    out = [] if script == "fit" else ["--out", str(tmp_path / "out")]
    assert bench.main([*argv, *out]) == 130
    assert capsys.readouterr().err == (f"interrupted: stopped at once; "
                                       f"{kept.replace('OUT', str(tmp_path / 'out'))}\n")
    saved = json.loads((tmp_path / rows).read_text())
    assert len(saved["stages"] if script == "hopper_session" else saved) == 1


# a process running run_limited (benchmarks/hopper_session.py, mosaic_probe.py, kernel_profile.py):
# argv[1] is the child's program, argv[2] the grace seconds
PARENT = """
import sys
from limited_run import Stopped, run_limited
try:
    run_limited([sys.executable, "-c", sys.argv[1]], 60, float(sys.argv[2]))
except Stopped as e:
    print(f"{e}: {e.output!r}", flush=True)
    sys.exit(130)
"""


def _alive(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _written_pid(parent: subprocess.Popen, pid_file: Path) -> int:
    """The process id in `pid_file` once a process that `parent` started has written it (a
    FileNotFoundError where `parent` ended first, or after 120 s)."""
    for _ in range(1200):
        if pid_file.exists() or parent.poll() is not None:
            break
        time.sleep(0.1)
    return int(pid_file.read_text())


@pytest.mark.parametrize("signum,stubborn", [(signal.SIGTERM, False), (signal.SIGHUP, False),
                                             (signal.SIGINT, False), (signal.SIGTERM, True)],
                         ids=["SIGTERM", "SIGHUP", "SIGINT", "SIGTERM-ignored"])
def test_run_limited_stops_its_child_when_this_process_is_stopped(signum, stubborn, tmp_path):
    """A SIGTERM, SIGHUP or SIGINT sent to the process running run_limited (here it alone, as
    `kill PID` does) stops the child as at its limit: SIGTERM (it ran its handler and exited;
    one that ignores it is killed after the grace), and `Stopped` carries what it printed. The
    child ran on to its end (60 s here; on the GPU holding the device for the next stage): the
    parent died of the signal at once (SIGINT: a KeyboardInterrupt after 0.25 s)."""
    pid_file = tmp_path / "child.pid"
    child = textwrap.dedent(f"""
        import os, signal, sys, time
        def term(*_):
            print("got SIGTERM", flush=True)
            if not {stubborn}:
                sys.exit(3)
        signal.signal(signal.SIGTERM, term)
        print("started", flush=True)
        with open({str(pid_file)!r} + ".partial", "w") as f:
            f.write(str(os.getpid()))
        os.replace({str(pid_file)!r} + ".partial", {str(pid_file)!r})
        time.sleep(60)
    """)
    env = os.environ | {"PYTHONPATH": f"{ROOT / 'benchmarks'}:{ROOT}"}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, child, "1"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child_pid = None
    try:
        child_pid = _written_pid(parent, pid_file)
        os.kill(parent.pid, signum)
        out, err = parent.communicate(timeout=30)
        assert not _alive(child_pid)
        assert parent.returncode == 130, (parent.returncode, out, err)
        assert out == f"got {signal.Signals(signum).name}: 'started\\ngot SIGTERM\\n'\n"
    finally:
        parent.kill()
        if child_pid is not None and _alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def _waiting(pid_file: Path) -> str:
    """A program that writes its id to `pid_file` and waits 600 s: a stage, a profiled program
    (on the GPU, holding it)."""
    return textwrap.dedent(f"""
        import os, time
        with open({str(pid_file)!r} + ".partial", "w") as f:
            f.write(str(os.getpid()))
        os.replace({str(pid_file)!r} + ".partial", {str(pid_file)!r})
        time.sleep(600)
    """)


def _gone_once_killed(parent: subprocess.Popen, pid_file: Path) -> bool:
    """SIGKILL `parent` once the process it started (itself or through others, `_waiting`) has
    written its id to `pid_file`; whether that process is gone within 30 s (killed here if
    not)."""
    pid = None
    try:
        pid = _written_pid(parent, pid_file)
        parent.kill()
        parent.wait(timeout=30)
        for _ in range(300):
            if not _alive(pid):
                return True
            time.sleep(0.1)
        return False
    finally:
        parent.kill()
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)


# benchmarks/hopper_session.py with argv[1] as its env stage's program, argv[2:] its arguments
SESSION = """
import sys
import hopper_session
from diff_jax.command import leave
hopper_session.ENV_PROBE = sys.argv[1]
leave(hopper_session.main(sys.argv[2:]))
"""
BENCHMARKS_ENV = {"PYTHONPATH": f"{ROOT / 'benchmarks'}:{ROOT}"}
LINUX_ONLY = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="PR_SET_PDEATHSIG and pidfds are Linux's")


@LINUX_ONLY
def test_a_stage_dies_with_a_session_killed_by_sigkill(tmp_path):
    """A SIGKILL to hopper_session.py alone (the device tool at its command's limit, the OOM
    killer), which it cannot pass on: the stage in flight is killed with it, by the kernel
    (`limited_run.DIES_WITH_PARENT`). It ran on to its end (600 s here; on the GPU holding the
    device and its memory for the next call)."""
    pid_file = tmp_path / "stage.pid"
    session = subprocess.Popen([sys.executable, "-c", SESSION, _waiting(pid_file), "--out",
                                str(tmp_path / "out"), "--stages", "env"],
                               env=os.environ | BENCHMARKS_ENV, cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert _gone_once_killed(session, pid_file)


@LINUX_ONLY
def test_dies_with_parent_catches_a_parent_gone_before_it_and_keeps_the_signals(monkeypatch):
    """`limited_run.DIES_WITH_PARENT`: a parent that died before the prctl (here: its id is not
    the one given) is caught, the child killed before it runs; otherwise the child runs with
    SIGPIPE and SIGXFSZ as Popen leaves them (the Python before it ignores both), and with
    SIGKILL as its parent-death signal. Off Linux run_limited starts the child as it is, and
    `dies_with` watches nothing where there are no pidfds."""
    wrap = [sys.executable, "-I", "-S", "-c", limited_run.DIES_WITH_PARENT]
    ran = subprocess.run([*wrap, "1", sys.executable, "-c", "print('ran')"], capture_output=True,
                         text=True, timeout=60)
    assert ran.returncode == -signal.SIGKILL and ran.stdout == "", ran
    ignored = ["grep", "^SigIgn:", "/proc/self/status"]
    assert subprocess.run([*wrap, str(os.getpid()), *ignored], capture_output=True, text=True,
                          timeout=60).stdout == subprocess.run(ignored, capture_output=True,
                                                               text=True).stdout
    death_signal = ("import ctypes; s = ctypes.c_int(); "
                    "ctypes.CDLL(None).prctl(2, ctypes.byref(s)); print(s.value)")  # PR_GET_
    assert limited_run.run_limited([sys.executable, "-c", death_signal], 60, 1) == (
        f"{int(signal.SIGKILL)}\n", 0)
    monkeypatch.setattr(limited_run.sys, "platform", "darwin")
    assert limited_run.run_limited([sys.executable, "-c", death_signal], 60, 1) == ("0\n", 0)
    monkeypatch.delattr(limited_run.os, "pidfd_open")
    threads = threading.active_count()
    limited_run.dies_with(os.getpid())
    assert threading.active_count() == threads


@pytest.mark.parametrize("platform", ["linux", "darwin"])
def test_a_child_that_cannot_start_is_one_line_its_callers_record(platform, tmp_path,
                                                                 monkeypatch):
    """A program run_limited cannot start (ncu gone, a stage's program mistyped, a launcher
    script whose interpreter is missing, a file not executable): one line naming it, exit
    status 127 where there is no such file, else 126 (as a shell's), recorded as a child that
    failed: hopper_session.py's stage, kernel_profile.py's row (and its markdown line), the
    other rows still run. Before, on Linux (through `DIES_WITH_PARENT`): exec's
    FileNotFoundError traceback, which names no path, and exit status 1, a child that ran and
    failed (kernel_profile.md: "not measured: exit 1: Traceback (most recent call last):");
    elsewhere (here Linux with its wrapper left out) Popen's FileNotFoundError escaped
    run_limited: hopper_session.py's `_run`, which never raises, and kernel_profile.py, an
    `error:` line and exit status 2 before its other rows."""
    import io

    import hopper_session
    import kernel_profile

    monkeypatch.setattr(limited_run.sys, "platform", platform)
    missing, no_shell, not_executable = (tmp_path / x for x in ("missing", "ncu", "data"))
    no_shell.write_text("#!/nonexistent/sh\n")
    no_shell.chmod(0o755)
    not_executable.write_text("")
    for path, code, why in ((missing, 127, "No such file or directory"),
                            (no_shell, 127, "No such file or directory"),
                            (not_executable, 126, "Permission denied")):
        assert limited_run.run_limited([str(path), "--x"], 60, 1) == (
            f"could not start: {path}: {why}\n", code)
    stage = hopper_session._run("env", [str(missing)], 60, io.StringIO())
    assert (stage["status"], stage["tail"]) == (
        "exit 127", f"could not start: {missing}: No such file or directory\n")
    monkeypatch.setattr(kernel_profile.shutil, "which", lambda name: str(missing))
    out = tmp_path / "out"
    assert kernel_profile.main(["--out", str(out), "--head-dims", "64,128", "--schedules",
                                "table"]) == 0
    line = f"exit 127: could not start: {missing}: No such file or directory"
    assert [r["error"] for r in json.loads((out / "kernel_profile.json").read_text())] == [
        line + "\n"] * 2
    assert f"- d = 128, table, T = 4096: not measured: {line}\n" in (
        out / "kernel_profile.md").read_text()


@LINUX_ONLY
def test_the_profiled_program_dies_with_kernel_profile_killed_by_sigkill(tmp_path):
    """kernel_profile.py SIGKILLed while ncu profiles its program: ncu dies with it
    (`run_limited`), and where `ncu` is a launcher script that runs the profiler as its child
    (here an `sh` that runs one more `sh`, the profiler, which runs the program) the program
    too, which watches kernel_profile.py (`limited_run.dies_with`); PR_SET_PDEATHSIG names the
    parent only, the profiler, which lives on. The program ran on (600 s here; on the GPU its
    steps, to their end). It is kernel_profile.py's own `--run`, its steps a wait (no GPU)."""
    pid_file = tmp_path / "profiled.pid"
    profiled = tmp_path / "profiled.py"
    profiled.write_text(textwrap.dedent(f"""
        import sys
        import kernel_profile
        kernel_profile._child = lambda *_: exec({_waiting(pid_file)!r})
        sys.exit(kernel_profile.main(sys.argv[2:]))
    """))
    ncu = tmp_path / "bin" / "ncu"
    ncu.parent.mkdir()
    profiler = (f'while [ "$1" != --log-file ]; do shift; done; py=$3; shift 3; '
                f'"$py" {profiled} "$@"')  # ncu's options, its log, then the program
    ncu.write_text(f"#!/bin/sh\nsh -c '{profiler}; :' profiler \"$@\"\necho launched\n")
    ncu.chmod(0o755)
    env = os.environ | BENCHMARKS_ENV | {"PATH": f"{ncu.parent}{os.pathsep}{os.environ['PATH']}"}
    parent = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "kernel_profile.py"),
                               "--out", str(tmp_path / "out"), "--head-dims", "128",
                               "--schedules", "table"], env=env, cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert _gone_once_killed(parent, pid_file)


def test_gpu_session_records_the_stage_whose_line_its_closed_stdout_refused(tmp_path):
    """hopper_session.py writing to a pipe whose reader is gone: the stage's line fails
    (BrokenPipeError) and the session ends in one `interrupted:` line, exit 130, with that stage
    in session.json and .md (its line was printed before it was recorded: session.json was never
    written, the stage's output in session.log alone)."""
    out = tmp_path / "out"
    read, write = os.pipe()
    os.close(read)
    try:
        session = subprocess.run([sys.executable, "-c", SESSION, "print('ENV {}')", "--out",
                                  str(out), "--stages", "env"], env=os.environ | BENCHMARKS_ENV,
                                 cwd=ROOT, stdout=write, stderr=subprocess.PIPE, text=True,
                                 timeout=300)
    finally:
        os.close(write)
    assert session.returncode == 130 and session.stderr == (
        "interrupted: the reader of stdout is gone (SIGPIPE); stopped at once; the 1 stage "
        f"written so far is kept at --out {out}\n"), session.stderr
    (env_stage,) = json.loads((out / "session.json").read_text())["stages"]
    assert env_stage["status"] == "ok" and env_stage["tail"] == "ENV {}\n"
    assert "- env: ok" in (out / "session.md").read_text()


def _stopped_by_sigterm(*_args, **_kwargs):
    raise limited_run.Stopped(signal.SIGTERM, "stacks of the probe in flight\n")


def test_mosaic_probe_and_kernel_profile_keep_the_row_a_signal_stopped(capsys, tmp_path,
                                                                       monkeypatch):
    """A signal that stops mosaic_probe.py or kernel_profile.py while a child runs: that
    child's row, with what it printed (a probe's stacks, dumped at SIGTERM, name where it
    hangs), is written beside the rows before it, then one `interrupted:` line, exit status 130
    (the command ended with the child running, its row lost)."""
    import kernel_profile
    import mosaic_probe

    probed = []

    def first_ok(name, *args):
        if probed:
            _stopped_by_sigterm()
        probed.append(name)
        return {"probe": name, "status": "ok"}

    monkeypatch.setattr(mosaic_probe, "probe", first_ok)
    out = tmp_path / "probe"
    assert mosaic_probe.main(["--out", str(out), "--probes", "fwd-d64,bwd-d128,bwd-d96"]) == 130
    assert capsys.readouterr().err == (f"interrupted: stopped at once; the 2 rows written so far "
                                       f"are kept at --out {out}\n")
    assert json.loads((out / "mosaic_probe.json").read_text()) == [
        {"probe": "fwd-d64", "status": "ok"},
        {"probe": "bwd-d128", "status": "interrupted (got SIGTERM)",
         "tail": "stacks of the probe in flight\n"}]
    # the real probe: run_limited's Stopped reaches probe_all through it
    monkeypatch.undo()
    monkeypatch.setattr(mosaic_probe, "run_limited", _stopped_by_sigterm)
    assert mosaic_probe.main(["--out", str(out), "--probes", "fwd-d64"]) == 130
    (row,) = json.loads((out / "mosaic_probe.json").read_text())
    assert row["status"] == "interrupted (got SIGTERM)"

    monkeypatch.setattr(kernel_profile, "run_limited", _stopped_by_sigterm)
    monkeypatch.setattr(kernel_profile.shutil, "which", lambda name: f"/usr/bin/{name}")
    out = tmp_path / "profile"
    assert kernel_profile.main(["--out", str(out), "--head-dims", "64", "--schedules",
                                "table,fused"]) == 130
    (row,) = json.loads((out / "kernel_profile.json").read_text())
    assert row["error"] == "interrupted (got SIGTERM): stacks of the probe in flight\n"
    assert "not measured: interrupted (got SIGTERM)" in (out / "kernel_profile.md").read_text()


# (script, the function its command line calls it by, the function its work calls that the Ctrl-C
# lands in, argv less --out; fit.py writes its own results, under ROOT, here the test's directory)
ENDED = [("attention", "command", "_modes", ["--smoke"]),
         ("fit", "main", "compile_one", ["--configs", "diff-830m", "--impls", "xla", "--slices",
                                         "v5p:2x2x2"]),
         ("hopper_session", "main", "_record", ["--stages", "env", "--total", "1"])]


@pytest.mark.parametrize("script,command,function,argv", ENDED, ids=[c[0] for c in ENDED])
def test_ctrl_c_and_an_out_that_cannot_be_made_end_these_scripts_in_one_line(
        script, command, function, argv, capfd, tmp_path, monkeypatch):
    """attention.py, fit.py and hopper_session.py ended through no `command.concluded`: a Ctrl-C
    in their work (hopper_session.py: outside a stage, whose signals `limited_run` takes) was
    a KeyboardInterrupt traceback, and so was an --out under a file (attention.py, the
    session). Now one `interrupted:` line, exit 130, and one `error:` line naming --out, exit 2
    (fit.py has no --out). On stderr's file descriptor: attention.py registers it with
    faulthandler."""
    bench = importlib.import_module(script)
    main = getattr(bench, command)
    monkeypatch.setattr(bench, function, _stop)
    if script == "fit":
        (tmp_path / "benchmarks" / "results").mkdir(parents=True)
        monkeypatch.setattr(bench, "ROOT", tmp_path)
    out = [] if script == "fit" else ["--out", str(tmp_path / "out")]
    assert main([*argv, *out]) == 130
    where = "benchmarks/results/tpu_fit.json" if script == "fit" else f"--out {tmp_path / 'out'}"
    assert capfd.readouterr().err == (f"interrupted: stopped at once; no half-written output is "
                                       f"left at {where}\n")
    if script != "fit":
        monkeypatch.undo()  # the work as it is: the first thing it writes is in --out
        (tmp_path / "file").write_text("")
        out = tmp_path / "file" / "out"
        assert _refused(capfd, main, [*argv, "--out", str(out)]).startswith(
            f"error: --out {out}: {out}")


def test_compile_seconds_by_program_are_medians_of_the_uncached_runs(monkeypatch):
    """compile_cache.py splits the compile time of the runs without a cache by program (the
    jitted function's name JAX's compile event carries), as medians over repeats, and names the
    programs of 0.5 s or more; the cached runs' compiles are not counted."""
    import compile_cache

    seconds = iter([{"jit(init_state)": 29.0, "jit(train_step)": 18.0, "jit(stage)": 0.1},
                    {"jit(init_state)": 31.0, "jit(train_step)": 20.0},
                    {"jit(init_state)": 30.0, "jit(train_step)": 16.0, "jit(stage)": 0.3}])

    def measure(argv, scratch):
        none = not any(a.startswith("train.compile_cache_dir=") for a in argv)
        by_program = next(seconds) if none else {"jit(train_step)": 99.0}
        return {"wall_s": 1.0, "compile_s": sum(by_program.values()), "saved_s": 0.0,
                "hits": 0, "misses": 0, "compile_s_by_program": by_program}

    monkeypatch.setattr(compile_cache, "measure", measure)
    monkeypatch.setattr(compile_cache, "versions", lambda: {"device": "d", "host": "h",
                                                            "python": "3", "jax": "0"})
    result = compile_cache.run("configs/tiny.yaml", [], 2, 3)
    assert result["none_compile_s_by_program"] == {"jit(init_state)": 30.0, "jit(train_step)": 18.0,
                                                   "jit(stage)": 0.1}
    assert ("Without a cache, the programs that took 0.5 s or more to compile (medians): "
            "`jit(init_state)` 30.0 s, `jit(train_step)` 18.0 s; the rest (1 program) 0.1 s."
            ) in compile_cache.markdown(result)
