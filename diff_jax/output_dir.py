"""An output directory written whole or not at all, by the command lines that make one
(`python -m diff_jax.export` and its `.hf_import`, `python -m diff_jax.data prepare`), and a file
of a run's record (`config.yaml`, `metrics.jsonl`) or an evaluation's result (its JSON, `.npy`,
PNG) replaced whole or not at all (`write_whole`).

The output is written into a hidden sibling directory and renamed into place when complete, so a
failed or interrupted write leaves no half-written or empty directory and never touches the one
already there; what a killed write left beside it is tidied before the next write of the same
output is judged (`refusal`), and what a killed `write_whole` left beside its file before the
next write of that file. An existing non-empty directory is replaced only with
`--overwrite`, and only when it holds the command's own marker file (a previous output of the
same kind) and nothing that output does not write (another export or corpus nested in it, a
user's file), which replacing would delete.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from diff_jax.file_errors import naming


def refusal(out: Path, overwrite: bool, marker: str, kind: str,
            contents: frozenset[str]) -> str | None:
    """Why `out` may not be written (the caller prefixes the argument that named it), or None.

    `marker`: the file every output of this `kind` (e.g. "a diff_jax export") holds; a non-empty
    `out` without it is refused even with `overwrite`. `contents`: the names of every entry an
    output of this kind may hold (`marker` among them); with `overwrite`, an `out` holding any
    other entry is refused, since replacing `out` would delete it. What a killed earlier write of
    `out` left beside it is tidied first (`_clear_leftovers`), so an output it had renamed aside
    is back in place and judged as `out`."""
    if out.parent.is_dir():
        _clear_leftovers(out)
    if out.exists() and not out.is_dir():
        return "exists and is not a directory"
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            return f"already exists and is not empty; pass --overwrite to replace {kind}"
        if not (out / marker).is_file():
            return f"is not {kind} (no {marker}); refusing to replace it even with --overwrite"
        foreign = sorted(entry.name for entry in out.iterdir() if entry.name not in contents)
        if foreign:
            return (f"holds {out / foreign[0]}, which is not part of {kind} and which replacing "
                    "it would delete; move it out first, or choose another directory")
    return None


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A fresh hidden sibling directory of `out` to write the output into. When the block
    completes it becomes `out`, and what `out` held is removed only afterwards; when the block
    raises, it is removed and `out` is left as it was (renamed back, when the failure fell
    between the two renames), and so are its parents (those it made for `out` are removed
    again)."""
    made = [p for p in out.parents if not p.exists()]  # deepest first
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    written = False
    try:
        tmp.mkdir()
        yield tmp
        if out.is_dir():
            out.rename(old)
        tmp.rename(out)
        written = True
        shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        raise _as_written_to(e, tmp, out) from e
    finally:
        if not written and old.is_dir() and not out.exists():
            old.rename(out)
        shutil.rmtree(tmp, ignore_errors=True)
        if not written:
            _remove_empty(made)


@contextlib.contextmanager
def made(out: Path) -> Iterator[Path]:
    """The directory `out`, made with its missing parents, for the block to write files into;
    when the block raises (an error, Ctrl-C), those it made are removed again while they are
    empty, so a command that wrote nothing leaves nothing behind."""
    new = [p for p in (out, *out.parents) if not p.exists()]  # deepest first
    out.mkdir(parents=True, exist_ok=True)
    try:
        yield out
    except BaseException:
        _remove_empty(new)
        raise


def _remove_empty(made: list[Path]) -> None:
    """Remove the directories a write `made` (deepest first) while they are empty; one that is
    not (something else wrote there meanwhile) is kept, and so are those above it."""
    for directory in made:
        try:
            directory.rmdir()
        except OSError:
            break


def _clear_leftovers(out: Path) -> None:
    """Tidy what an earlier write of `out` killed part-way left beside it (a process that no longer
    exists; a live one's is its work in progress): its staging directory (or, for `write_whole`,
    file) `.<out>.partial-PID` is removed, and its `.<out>.old-PID` (what `out` held, renamed
    aside just before the new output took its place) is removed when `out` exists, or renamed
    back to `out` when the kill fell between the two renames."""
    prefix = f".{out.name}."
    for entry in out.parent.iterdir():
        kind, _, pid = entry.name[len(prefix):].rpartition("-")
        if (not entry.name.startswith(prefix) or kind not in ("partial", "old")
                or not pid.isdigit() or _alive(int(pid))):
            continue
        if kind == "old" and not out.exists():
            entry.rename(out)
        elif entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    """Whether a process `pid` exists on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _as_written_to(error: OSError, tmp: Path, out: Path) -> OSError:
    """`error` naming the file of `out` it was writing, when it names one inside the hidden
    staging directory `tmp` (a name the user never gave, so `file_errors.describe` could not
    label it with the argument); otherwise `error` itself."""
    if error.filename is None or error.strerror is None:
        return error
    file = Path(os.fsdecode(error.filename))
    if file != tmp and tmp not in file.parents:
        return error
    return naming(error, out / file.relative_to(tmp))


def write_whole(path: Path, content: str | bytes) -> None:
    """Replace the file `path` with `content` (text, or bytes) whole or not at all: it is written
    to a hidden sibling that is then renamed over `path`, so a full disk or a kill part-way leaves
    what `path` held (and the sibling a kill left is removed by the next write of `path`,
    `_clear_leftovers`).
    A failure raises `OSError` naming `path` (a failed write names no file of its own)."""
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        _clear_leftovers(path)
        if isinstance(content, bytes):
            tmp.write_bytes(content)
        else:
            tmp.write_text(content)
        tmp.replace(path)
    except OSError as e:
        raise naming(e, path) from e
    finally:
        tmp.unlink(missing_ok=True)
