"""How the command lines end: `train.py`, `eval.py`, `python -m diff_jax.export` and its
`.hf_import`, `python -m diff_jax.data prepare`, `.summary`, `.interop`, and the replication's
`replicate`, `ablate` and `init_scale`.

Bad input (config, arguments, data, a refused checkpoint, a file that cannot be read or
written, a model that does not fit in device memory) ends a command in one `error:` line naming
the field, file or shape and what was expected, exit status `EXIT_BAD_INPUT`; a run or result
gone non-finite in one such line and `EXIT_NON_FINITE` (`failed`).

A Ctrl-C that stops a command at once (`KeyboardInterrupt`) ends it in one `interrupted:` line
saying what was kept, and exit status 130 (128 + SIGINT, as a shell reports a process that
Ctrl-C stopped), not a traceback. `leave` then exits without the interpreter's teardown: after
a Ctrl-C that cut an XLA compilation short, the teardown crashed (SIGSEGV, or SIGABRT with "pure
virtual method called") or printed "lost sys.stderr" after that line. A third Ctrl-C ends the
process at once wherever it is (`FORCE_PRESSES`, `as_ctrl_c`), an XLA compile included, where
no handler runs. What must reach the disk
has by then: outputs are written whole or not at all (`output_dir`), and checkpoint managers are
closed on the way out. What must run as the process ends all the same (`before_leaving`: a
multi-process job's failed process leaves without jax's shutdown barrier, `diff_jax.peers`) runs
first.

A SIGTERM or SIGHUP (the terminal closed) is a Ctrl-C where a command takes them (`as_ctrl_c`:
train.py, `replicate`, `ablate`), and so, in every command, is an output whose reader is gone
(`python eval.py | head`, `2>&1 | head`, `| less` quit): Python ignores SIGPIPE, which by the
Unix default stops the writer, and the next write raised BrokenPipeError, a traceback (or an
`error: [Errno 32] Broken pipe` line, exit 2, taken for bad input; exit 120 and "Exception
ignored" where stdout is block-buffered and the failure came at the interpreter's exit flush).
Now the command stops as a user stopping it would: train.py in training saves the step in
flight as for SIGTERM (`unread`, `train_loop._stop_signals`), elsewhere it stops at once, with
the `interrupted:` line of a Ctrl-C saying that the reader is gone, and the same exit status:
130, or 0 where train.py saved its step. Not 141 (128 + SIGPIPE, what a shell reports for a
writer SIGPIPE killed): these commands stop on their own, keeping what the line says, as for
the other ways of stopping them; and a terminal closed under `2>&1 | tee` ends the reader and
sends SIGHUP together, so the command sees either first, and its status must not depend on
which. The pipe is pointed at /dev/null (`let_go`), so nothing more is written to it and the
interpreter's flush at exit does not fail again; with stderr in the same pipe the line goes
nowhere.

`concluded` ends a command this way once its arguments are parsed (the benchmark scripts, and
hopper_session.py around its stages, whose signals benchmarks/limited_run.py takes); the
argparse types below refuse an argument as argparse does (its usage and an error line naming
the argument, exit status 2).
"""

from __future__ import annotations

import _thread
import argparse
import atexit
import contextlib
import dataclasses
import errno
import math
import os
import select
import signal
import stat
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from diff_jax.config import ConfigError
from diff_jax.file_errors import describe

EXIT_NON_FINITE = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130

# the signals that stop a command (Ctrl-C; `kill`, `timeout`, a job scheduler; the terminal
# closed): a command that takes them stops on each as on a Ctrl-C (`as_ctrl_c`), and passes them
# on to the processes it started: `replicate.side_by_side` to its workers, each as itself (a
# SIGHUP too, which reaches the command's group alone, as each worker writes to that terminal);
# benchmarks/limited_run.py to a stage or a probe, as SIGTERM
STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_last: list[Callable[[], None]] = []  # `before_leaving`'s hooks, for `leave` at once
_gone: list[str] = []  # "stdout", "stderr": let go of as their pipe's reader left (`let_go`)


def _say(line: str) -> None:
    """Print `line` on stderr; where stderr is a pipe whose reader is gone (`2>&1 | head`) the
    line goes nowhere, stderr pointed at /dev/null (`to_devnull`): its BrokenPipeError ended the
    command in a traceback into the pipe, exit 1 (measured: `eval.py` refusing its input)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except BrokenPipeError:
        to_devnull(2)


def failed(text: str, status: int = EXIT_BAD_INPUT) -> int:
    """Print `error: TEXT` on stderr (`_say`); return `status` (bad input unless given)."""
    _say(f"error: {text}")
    return status


def interrupted(what: str) -> int:
    """Print `interrupted: WHAT` (how it stopped, what was kept) on stderr (`_say`), saying
    first whose reader is gone where that stopped it (`let_go`); return `EXIT_INTERRUPTED`."""
    why = f"the reader of {' and '.join(_gone)} is gone (SIGPIPE); " if _gone else ""
    _say(f"interrupted: {why}{what}")
    return EXIT_INTERRUPTED


@dataclasses.dataclass
class Written:
    """What a command has written at its output so far, each file whole
    (`output_dir.write_whole`), which `concluded`'s `interrupted:` line says is kept
    (`output_kept`): one writing as it goes sets `count` `noun`s (rows, stages) once each is on
    disk; one writing once, at its end, sets `whole` once it is all there (the lines it prints
    after it met a reader gone: `| head`)."""

    noun: str = "row"
    count: int = 0
    whole: bool = False


def output_kept(argument: str, complete: bool = False, written: Written | None = None) -> int:
    """`interrupted` for a command writing one output directory (`output_dir.staged`): none is
    left half-written at `argument` (e.g. "--out DIR"). `complete`: the output was already in
    place, whole, when the stop came (a Ctrl-C, or the reader of stdout gone, at the lines
    printed after it), and the line says it is kept: "no half-written output" read as nothing
    written (measured: `python -m diff_jax.export RUN --out DIR | head -0` left the whole export
    at DIR with that line, exit 130, as every export into a reader gone before its end does).
    `written`: what the command has there (`Written`): its rows, which the line counts as kept,
    or the whole output (`complete`); it read "no half-written output" too (measured: fit.py,
    kernel_profile.py and mosaic_probe.py stopped in their second row, hopper_session.py in its
    second stage, the first on disk; `benchmarks/train_step.py ... | head -0`, its JSON and
    markdown whole)."""
    if complete or written is not None and written.whole:
        return interrupted(f"stopped once the output at {argument} was written whole; it is kept")
    if written is not None and written.count:
        n = written.count
        return interrupted(f"stopped at once; the {n} {written.noun}{'' if n == 1 else 's'} "
                           f"written so far {'is' if n == 1 else 'are'} kept at {argument}")
    return interrupted(f"stopped at once; no half-written output is left at {argument}")


def run_kept(error: KeyboardInterrupt, out: object) -> int:
    """`interrupted` for a replication command on `out`: `error`'s text (the run whose training
    saved its step after the first Ctrl-C), else "stopped at once"; a re-run resumes."""
    return interrupted(f"{str(error) or 'stopped at once'}; what {out} holds is kept (the same "
                       "command resumes)")


def concluded(work: Callable[[], object], output: tuple[str, str] | None,
              bad_input: tuple[type[Exception], ...] = (ConfigError,),
              written: Written | None = None) -> int:
    """The exit status of a command whose arguments are parsed, `work` doing the rest: 0 once it
    returns. Bad input found on the way is one `error:` line and `EXIT_BAD_INPUT`: an error of
    `bad_input` (its text, as train.py prints it), an `OSError` (`file_errors.describe`,
    labelled by `output`), a child command that failed (`subprocess.CalledProcessError`, its
    `cmd` the text naming the child: the child's last line on stderr; `EXIT_NON_FINITE` unless
    the child exited `EXIT_BAD_INPUT`). A Ctrl-C is one `interrupted:` line (`output_kept`).
    `output`: (the argument naming what the command writes, e.g. "--out OUT", the directory it
    writes in); None where it writes no file. `written`: what `work` has written there so far,
    where it writes as it goes (a row at a time), which that line says is kept. An output
    whose reader is gone is a Ctrl-C too (`as_ctrl_c`); SIGTERM keeps its default action."""
    try:
        with as_ctrl_c(signals=()):
            work()
    except bad_input as e:
        return failed(str(e))
    except OSError as e:
        return failed(describe(e, [output] if output else []))
    except subprocess.CalledProcessError as e:
        lines = (e.stderr or "").strip().splitlines() or ["nothing on stderr"]
        return failed(f"{e.cmd} exited {e.returncode}: {lines[-1].removeprefix('error: ')}",
                      EXIT_BAD_INPUT if e.returncode == EXIT_BAD_INPUT else EXIT_NON_FINITE)
    except KeyboardInterrupt:
        return (output_kept(output[0], written=written) if output
                else interrupted("stopped at once (it writes no file)"))
    return 0


def positive_int(text: str) -> int:
    """An argparse `type`: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def positive_ints(text: str) -> list[int]:
    """An argparse `type`: a comma list of integers >= 1 ("64,128")."""
    try:
        return [positive_int(x) for x in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers >= 1, got "
                                         f"{text!r}") from None


def positive_float(text: str) -> float:
    """An argparse `type`: a finite number > 0 (of seconds, say)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def before_leaving(hook: Callable[[], None]) -> None:
    """Run `hook` as the process ends: in `leave` before it exits at once, else at the
    interpreter's exit (`atexit`: before the hooks registered earlier, such as jax's)."""
    _last.append(hook)
    atexit.register(hook)


def leave(status: int) -> NoReturn:
    """Exit the process with `status`: after `EXIT_INTERRUPTED` at once (the streams flushed,
    `before_leaving`'s hooks run, the interpreter's teardown skipped), otherwise as `sys.exit`
    does."""
    if status == EXIT_INTERRUPTED:
        sys.stdout.flush()
        sys.stderr.flush()
        for hook in reversed(_last):
            hook()
        os._exit(status)
    sys.exit(status)


def not_ignored(signals: tuple[int, ...]) -> tuple[int, ...]:
    """`signals` less those this process ignores. `nohup` starts a command with SIGHUP ignored
    so that closing the terminal does not stop it, and a handler installed for it (a SIGHUP
    saves and exits, `train_loop._stop_signals`, `as_ctrl_c`) undid that: under nohup a closed
    terminal stopped the run at the step in flight. A shell script's `python train.py &` starts
    it with SIGINT ignored (no job control: the job shares the script's process group), so that
    a Ctrl-C meant for the script does not stop it; a handler undid that too. Each place that
    takes a stop signal asks here first, so an ignored one stays ignored, in the processes a
    command starts too (an ignored signal stays ignored across exec). Only the `STOPS` are
    passed over: Python itself starts with SIGPIPE ignored, which `train_loop` takes."""
    return tuple(s for s in signals
                 if not (s in STOPS and signal.getsignal(s) == signal.SIG_IGN))


def _ctrl_c(signum: int, _frame: Any) -> None:
    """`as_ctrl_c`'s handler: KeyboardInterrupt, after a SIGHUP once stdout and stderr are off
    the closed terminal (`off_the_terminal`), as the `interrupted:` line is written next."""
    off_the_terminal(signum)
    raise KeyboardInterrupt


@contextlib.contextmanager
def as_ctrl_c(signals: tuple[int, ...] = STOPS) -> Iterator[None]:
    """For the duration (main thread only) `signals` (the `STOPS`: SIGINT, SIGTERM, SIGHUP)
    raise KeyboardInterrupt, as a Ctrl-C does, wherever the command is: where it handles them
    itself they reach its handler instead (`train_loop`'s while a model trains: the first
    saves the step; `replicate._signals_woken`'s while workers run), and elsewhere (preparing
    data, compiling, evaluating, writing a report) it stops at once with one `interrupted:`
    line, what it had written whole (`output_dir`). Under Python's default SIGTERM and SIGHUP
    actions train.py before training (measured: SIGTERM or SIGHUP 1 s after "run directory:",
    while it built the model: exit -15 or -1, no line, where a Ctrl-C gave the line and 130),
    `replicate --jobs 1` and `ablate` ended there on the spot. A SIGINT under Python's own
    handler, which raises KeyboardInterrupt too, is taken in any case (a block given no
    signals: `concluded`, eval.py), so that one Python drops is raised again (`_raised_again`);
    one dropped as the block ends is raised as it ends. The previous handlers are restored on
    the way out.

    A write to stdout or stderr whose pipe's reader is gone (BrokenPipeError) is a Ctrl-C too
    (`let_go`); stdout and stderr are flushed before the block ends, so that a block-buffered
    stdout's last write fails here, not at the interpreter's exit. A BrokenPipeError of another
    pipe (a child's stdin) propagates as it is."""
    taken = not_ignored(signals)
    if (signal.SIGINT not in taken and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
        taken += (signal.SIGINT,)
    previous = {s: signal.signal(s, _ctrl_c) for s in taken}
    unraisable = sys.unraisablehook
    dropped = _Dropped()
    sys.unraisablehook = _raised_again(unraisable, dropped)
    try:
        try:
            with _presses_counted():
                yield
                sys.stdout.flush()
                sys.stderr.flush()
        finally:
            dropped.over = True
            with dropped.sending:  # one being sent again now reaches `_ctrl_c` in the block
                pass
        if dropped.signals:  # too late to be sent again
            raise KeyboardInterrupt
    except BrokenPipeError:
        if not let_go() and not _gone:
            raise
        raise KeyboardInterrupt from None
    finally:
        sys.unraisablehook = unraisable
        for s, handler in previous.items():
            signal.signal(s, handler)


FORCE_PRESSES = 3  # Ctrl-C presses that end a command at once, whatever it is doing
_FORCED = (f"interrupted: Ctrl-C pressed {FORCE_PRESSES} times: stopped at once, as kill -9 stops "
           f"it (what was committed is kept; a save in flight is not)\n")
_resent = [0]  # SIGINTs `_signal_main_soon` sent again: no press of the user's


@contextlib.contextmanager
def _presses_counted() -> Iterator[None]:
    """For the duration, the `FORCE_PRESSES`th Ctrl-C ends the process at once (`_count_presses`,
    in a thread of its own), wherever the main thread is. Python runs a signal's handler only
    where the main thread runs Python, and XLA compiling a step runs none for minutes on a large
    model: there a Ctrl-C pressed once or twice took effect only once the compilation was over.
    The signals are counted from `signal.set_wakeup_fd`, which the C-level handler writes to as
    each arrives. Main thread only, and only where no wakeup fd is set already (an enclosing
    block's, or an event loop's); otherwise the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    if previous != -1:  # not ours to replace: put back
        signal.set_wakeup_fd(previous)
        os.close(read_end)
        os.close(write_end)
        yield
        return
    threading.Thread(target=_count_presses, args=(read_end, _resent[0]), daemon=True,
                     name="ctrl-c-presses").start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(-1)
        os.close(write_end)  # the counting thread reads the end of the pipe, and closes it


def _count_presses(read_end: int, resent_before: int) -> None:
    """Count the SIGINTs written to `read_end` (less those `_signal_main_soon` sent again); at
    the `FORCE_PRESSES`th write one `interrupted:` line and exit at once, as a kill -9 would
    stop the process: the checkpoints and outputs already committed are kept, a save in flight
    is left uncommitted (nothing reads it). Ends with the pipe (`_presses_counted`)."""
    presses = 0
    try:
        while chunk := os.read(read_end, 64):
            presses += chunk.count(signal.SIGINT)
            if presses - (_resent[0] - resent_before) >= FORCE_PRESSES:
                with contextlib.suppress(OSError):  # straight to the fd: the main thread may
                    os.write(2, _FORCED.encode())   # hold sys.stderr's lock mid-write
                os._exit(EXIT_INTERRUPTED)
    finally:
        os.close(read_end)


@dataclasses.dataclass
class _Dropped:
    """The signals whose `_ctrl_c` KeyboardInterrupt Python dropped in an `as_ctrl_c` block
    (`_raised_again`), each until it is sent again (`_signal_main_soon`, holding `sending`);
    none is sent once the block is `over`: sent after it, the signal met the handler the block
    had restored, and was lost (SIGTERM's default action) or raised KeyboardInterrupt in the
    code after the block (Python's SIGINT handler). The block raises it as it ends instead."""

    signals: list[int] = dataclasses.field(default_factory=list)
    over: bool = False
    sending: threading.Lock = dataclasses.field(default_factory=threading.Lock)


def _raised_again(hook: Callable[[Any], None], dropped: _Dropped) -> Callable[[Any], None]:
    """A `sys.unraisablehook` that signals the main thread again with the signal whose
    `_ctrl_c` KeyboardInterrupt Python dropped (noted in `dropped`), and passes every other
    unraisable exception to `hook`. A handler runs wherever the interpreter checks for signals,
    a `gc.callbacks` entry included (jax's `_xla_gc_callback`), and an exception raised there
    is only printed ("Exception ignored in"): train.py signalled while it built its model
    trained to the end and exited 0. Signalled again from another thread (`_signal_main_soon`),
    the handler runs at the main thread's next check after this hook, in the command's code
    once the collection is over (in a callback again: again)."""
    def raised_again(unraisable: Any) -> None:
        tb = unraisable.exc_traceback
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is not None and tb.tb_frame.f_code is _ctrl_c.__code__:
            signum = tb.tb_frame.f_locals["signum"]
            dropped.signals.append(signum)
            _thread.start_new_thread(_signal_main_soon, (signum, dropped))
        else:
            hook(unraisable)
    return raised_again


def _signal_main_soon(signum: int, dropped: _Dropped) -> None:
    """In a thread of its own: `signum` for the main thread's handler, 10 ms on, once the
    `sys.unraisablehook` that started this thread has returned (`_thread.interrupt_main` there,
    or a thread whose start it waited for, ran the handler inside the hook, where its
    KeyboardInterrupt was dropped for good); nothing where the block that `dropped` it is over
    by then (it raised KeyboardInterrupt as it ended)."""
    time.sleep(0.01)
    with dropped.sending:
        if dropped.over:
            return
        dropped.signals.remove(signum)
        if signum == signal.SIGINT:
            _resent[0] += 1  # `_count_presses` sees this one too
        _thread.interrupt_main(signum)


def _readerless(fd: int) -> bool:
    """Whether `fd` is a pipe whose reader is gone: poll's POLLERR on its write end (Linux)."""
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False
    except OSError:  # closed (EBADF)
        return False
    polled = select.poll()
    polled.register(fd, select.POLLOUT)
    return bool(dict(polled.poll(0)).get(fd, 0) & select.POLLERR)


def let_go() -> list[str]:
    """Point stdout and stderr at /dev/null where each is a pipe whose reader is gone, and
    remember them (`interrupted` names them); the names of those pointed away now ("stdout",
    "stderr"), [] where none. Writing to such a pipe raised BrokenPipeError at every write,
    and once more at the interpreter's exit flush ("Exception ignored", exit 120), as Python
    ignores SIGPIPE; /dev/null takes the writes that follow without an error."""
    gone = [(fd, name) for fd, name in ((1, "stdout"), (2, "stderr")) if _readerless(fd)]
    if gone:
        to_devnull(*(fd for fd, _ in gone))
        _gone.extend(name for _, name in gone)
    return [name for _, name in gone]


def unread(error: BrokenPipeError) -> None:
    """A write to stdout or stderr failed with `error`, its pipe's reader gone: where a handler
    takes SIGPIPE (`train_loop._stop_signals`, which lets go of the pipe and saves the step in
    flight, as on SIGTERM) SIGPIPE is raised for it and the write is dropped; elsewhere `error`
    is raised again, and `as_ctrl_c` stops the command at once. The kernel sends SIGPIPE on
    such a write too, which that handler may have taken already (it acts once)."""
    if not callable(signal.getsignal(signal.SIGPIPE)):
        raise error
    signal.raise_signal(signal.SIGPIPE)


def off_the_terminal(signum: int) -> None:
    """After a SIGHUP (`signum`; any other signal: nothing), point stdout and stderr at
    /dev/null where they are a terminal, or a pipe whose reader is gone. A SIGHUP says the
    terminal closed (its window, a dropped ssh session), and every later write to it fails with
    EIO: the line saying the step in flight was saved, the progress line, the last
    `interrupted:` line each raised an OSError in the middle of the save or the exit. Measured
    on Linux with a pty whose master closed: os.write EIO, and isatty False (its TCGETS fails
    with EIO too), so a hung-up terminal is told from a file by tcgetattr's EIO, not by isatty.
    A pipe into the terminal (`2>&1 | tee train.log`, `| less`) loses its reader the same way:
    the hangup ends it too, and every later write failed with EPIPE (BrokenPipeError, as Python
    ignores SIGPIPE); measured with the pipe's read end closed before the SIGHUP: exit 1,
    nothing committed, the handler's line raising into the loop. Such a pipe is told by poll's
    POLLERR on its write end (Linux: no reader left). A pipe still read is kept: a `kill -HUP`
    under a harness or supervisor that reads the output gets every line (the `interrupted:`
    line of `replicate`, tested). nohup points a terminal's descriptors elsewhere the same way
    (at nohup.out, before the command starts), daemon(3) at /dev/null. A regular file
    (`> train.log`) is left as it is and receives every line; the run directory's files are
    written as before. Called first by each handler that takes SIGHUP
    (`train_loop._stop_signals`, `as_ctrl_c`, `replicate._signals_woken`)."""
    if signum != signal.SIGHUP:
        return
    for fd in (1, 2):
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                if not _readerless(fd):  # still read
                    continue
            else:
                termios.tcgetattr(fd)
        except OSError:  # closed (EBADF)
            continue
        except termios.error as e:
            if e.args[0] != errno.EIO:  # not a terminal (ENOTTY)
                continue
        to_devnull(fd)


def to_devnull(*fds: int) -> None:
    """Point the file descriptors `fds` at /dev/null: what is written to them from now on goes
    nowhere, without an error (`off_the_terminal`; `peers`, whose stopped process's line stays
    its last)."""
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in fds:
        os.dup2(null, fd)
    os.close(null)


@contextlib.contextmanager
def finish_first(what: str) -> Iterator[None]:
    """Let the block finish before a Ctrl-C stops the command: a write whose threads go on
    after Python is interrupted (orbax's and tensorstore's) would otherwise still be writing
    into a directory that is being removed, and leave part of it behind. The first SIGINT
    says `WHAT` is finished first and raises KeyboardInterrupt once the block is done; a second
    one raises at once. In the main thread only (elsewhere the block runs as it is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def handler(signum: int, _frame: Any) -> None:
        caught.append(signum)
        if len(caught) > 1:
            raise KeyboardInterrupt
        print(f"Ctrl-C: finishing {what} first (Ctrl-C again stops at once)", file=sys.stderr)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt
