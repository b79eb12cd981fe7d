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
virtual method called") or printed "lost sys.stderr" after that line. What must reach the disk
has by then: outputs are written whole or not at all (`output_dir`), and checkpoint managers are
closed on the way out.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any, NoReturn

EXIT_NON_FINITE = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


def failed(text: str, status: int = EXIT_BAD_INPUT) -> int:
    """Print `error: TEXT` on stderr; return `status` (bad input unless given)."""
    print(f"error: {text}", file=sys.stderr)
    return status


def interrupted(what: str) -> int:
    """Print `interrupted: WHAT` (how it stopped, what was kept) on stderr; return
    `EXIT_INTERRUPTED`."""
    print(f"interrupted: {what}", file=sys.stderr)
    return EXIT_INTERRUPTED


def output_kept(argument: str) -> int:
    """`interrupted` for a command writing one output directory (`output_dir.staged`): none is
    left half-written at `argument` (e.g. "--out DIR")."""
    return interrupted(f"stopped at once; no half-written output is left at {argument}")


def run_kept(error: KeyboardInterrupt, out: object) -> int:
    """`interrupted` for a replication command on `out`: `error`'s text (the run whose training
    saved its step after the first Ctrl-C), else "stopped at once"; a re-run resumes."""
    return interrupted(f"{str(error) or 'stopped at once'}; what {out} holds is kept (the same "
                       "command resumes)")


def leave(status: int) -> NoReturn:
    """Exit the process with `status`: after `EXIT_INTERRUPTED` at once (the streams flushed, the
    interpreter's teardown skipped), otherwise as `sys.exit` does."""
    if status == EXIT_INTERRUPTED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


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
