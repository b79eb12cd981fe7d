"""Text sources: the embedded default corpus and local files, read into a list of documents.

A missing path, a glob that matches nothing, or a source without a single readable document is a
`DataError`. A single bad document (undecodable file, JSONL line that is not an object with the
text field) is skipped and counted in `Documents.skipped`, never silently dropped.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import sysconfig
import zlib
from pathlib import Path


class DataError(ValueError):
    """A data source is missing, empty, unreadable or malformed; the message names it."""


TEXT_SUFFIXES = (".txt", ".md", ".py", ".jsonl")


@dataclasses.dataclass(frozen=True)
class Documents:
    """Raw document texts and what was skipped on the way."""

    texts: tuple[str, ...]
    skipped: tuple[str, ...]  # "path[:line]: reason" for every skipped document


def stdlib_documents() -> Documents:
    """The standard library's `.py` sources (sorted by path; its own test suite and installed
    packages left out) plus every `pydoc_data` topic."""
    from pydoc_data.topics import topics

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") 
                   if not {"site-packages", "test", "tests"} & set(p.relative_to(root).parts))
    if not files:
        raise DataError(f"data.source=stdlib: no .py files under {root}")
    texts, skipped = read_files(files, text_field="text")
    texts += [topics[k] for k in sorted(topics)]
    return Documents(tuple(t for t in texts if t.strip()), tuple(skipped))


def expand_paths(patterns: tuple[str, ...]) -> list[Path]:
    """Files named by paths, directories (searched recursively) and globs, sorted, each file once
    however many patterns name it and however they spell it (relative, absolute, `..`, a
    symlink): a file read twice would be two documents, one possibly held out beside the other."""
    if not patterns:
        raise DataError("data.paths: empty; name at least one file, directory or glob")
    files: dict[Path, Path] = {}  # the real file -> the first spelling naming it
    for pattern in patterns:
        if not pattern.strip():  # Path("") is the working directory, which would be read whole
            raise DataError(f"data.paths: {pattern!r} is empty; name a file, directory or glob")
        p = Path(pattern).expanduser()
        if any(c in pattern for c in "*?[") and not p.exists():  # "notes [draft].txt" is a file
            matches = [Path(m) for m in glob.glob(str(p), recursive=True)]
            if not matches:
                raise DataError(f"data.paths: {pattern!r} matches no file")
        elif p.is_dir():
            matches = [m for m in p.rglob("*") if _is_text(m)]
            if not matches:
                raise DataError(f"data.paths: directory {pattern!r} holds no {'/'.join(TEXT_SUFFIXES)} file")
        elif p.exists():
            matches = [p]
        else:
            raise DataError(f"data.paths: {pattern!r} does not exist")
        for m in matches:
            if m.is_file():
                if not _is_text(m):
                    raise DataError(f"data.paths: {m} is not one of {TEXT_SUFFIXES} (optionally .gz)")
                files.setdefault(m.resolve(), m)
    return sorted(files.values())


def file_documents(patterns: tuple[str, ...], text_field: str) -> Documents:
    """Every text file is one document; every JSONL line is one document (its `text_field`)."""
    texts, skipped = read_files(expand_paths(patterns), text_field)
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise DataError(f"data.paths {list(patterns)}: no non-empty document"
                        + (f" ({len(skipped)} skipped, first: {skipped[0]})" if skipped else ""))
    return Documents(tuple(texts), tuple(skipped))


def _is_text(path: Path) -> bool:
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    return path.is_file() and name.endswith(TEXT_SUFFIXES)


def read_files(files: list[Path], text_field: str) -> tuple[list[str], list[str]]:
    """(texts, skipped) of `files`: one text per plain file, one per JSONL record's `text_field`
    (gzip allowed); unreadable files and bad records are skipped with a reason."""
    texts: list[str] = []
    skipped: list[str] = []
    for path in files:
        try:
            opener = gzip.open if path.name.endswith(".gz") else open
            # utf-8-sig: a leading byte-order mark (Windows editors write one) is not text, and
            # would make a JSONL file's first record "not JSON"
            with opener(path, "rt", encoding="utf-8-sig") as f:
                raw = f.read()
        except (OSError, UnicodeDecodeError, EOFError, zlib.error) as e:  # zlib: a damaged .gz
            skipped.append(f"{path}: unreadable ({type(e).__name__}: {e})")
            continue
        if path.name.removesuffix(".gz").endswith(".jsonl"):
            texts.extend(_jsonl_texts(raw, path, text_field, skipped))
        else:
            texts.append(raw)
    return texts, skipped


def _jsonl_texts(raw: str, path: Path, field: str, skipped: list[str]) -> list[str]:
    """The `field` text of each record of the JSONL `raw`, bad records appended to `skipped`.
    Records end at newlines only: JSON strings may hold U+2028, U+0085 and the other line
    boundaries of `str.splitlines` unescaped."""
    out = []
    for n, line in enumerate(raw.split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            skipped.append(f"{path}:{n}: not JSON ({e.msg})")
            continue
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            skipped.append(f"{path}:{n}: no string field {field!r} (data.text_field)")
            continue
        out.append(record[field])
    return out
