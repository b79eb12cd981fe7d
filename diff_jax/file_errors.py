"""One line for a file-system error (`OSError`) at a command line's boundary: the argument it
concerns, the file and the reason. Used by every command line (train.py and the replication
through `train_loop.report`, eval.py, the export and import, `python -m diff_jax.data`), which
report it as bad input (exit status 2)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


def describe(error: OSError, named: Sequence[tuple[str, str]]) -> str:
    """`LABEL: FILE: REASON` for `error`.

    `named`: (label, path) pairs of the paths the user gave, e.g. ("train.run_dir=RUN", "RUN").
    LABEL is the first whose path is the file itself, else the first that was to be made inside
    the file (the file is one of its parent directories), else the first that holds the file;
    none of them: no label. An error that names no file: its own text.
    """
    if error.filename is None or error.strerror is None:
        return str(error)
    file = os.fsdecode(error.filename)
    path = Path(file).resolve()
    ranked = []
    for i, (label, given) in enumerate(named):
        where = Path(given).expanduser().resolve()
        relations = (path == where, path in where.parents, where in path.parents)
        if any(relations):
            ranked.append((relations.index(True), i, label))
    prefix = f"{min(ranked)[2]}: " if ranked else ""
    reason = error.strerror
    if isinstance(error, FileExistsError) and not path.is_dir():  # a directory was to be made
        reason += " and is not a directory"
    return f"{prefix}{file}: {reason}"


def naming(error: OSError, path: str | os.PathLike) -> OSError:
    """`error` (same type, errno and reason) with `path` as its file: for a failed write or
    flush, which names no file of its own, and for a file written under a hidden name that
    stands for `path`; `describe` can then label it with the argument it concerns."""
    return type(error)(error.errno, error.strerror, os.fspath(path))
