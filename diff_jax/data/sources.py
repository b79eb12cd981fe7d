"""Text sources: the embedded default corpus and local files, read into a list of documents.

A missing path, a glob that matches nothing, or a source without a single readable document is a
`DataError`. A single bad document (undecodable file, JSONL line that is not an object with the
text field) is skipped and counted in `Documents.skipped`, never silently dropped.
"""

from __future__ import annotations

import codecs
import dataclasses
import glob
import gzip
import io
import json
import os
import sysconfig
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO


class DataError(ValueError):
    """A data source is missing, empty, unreadable or malformed; the message names it."""


TEXT_SUFFIXES = (".txt", ".md", ".py", ".jsonl")  # each also compressed (name.gz, name.zst)
COMPRESSIONS = (".gz", ".zst")  # gzip; Zstandard (`zstandard`, the zstd extra: `zstd_reader`)
# compressed (C4's .json.gz, Dolma's), a .json holds JSON Lines; a plain .json is no data file:
# directories of corpora hold configs (.json) beside them
JSON_LINES_SUFFIX = ".json"
PARQUET_SUFFIX = ".parquet"  # records in columns (`pyarrow`, the parquet extra); compressed inside
PARQUET_BATCH_ROWS = 1024  # rows converted to Python strings at a time
FILE_KINDS = (f"{' '.join(TEXT_SUFFIXES)} (each optionally {' or '.join(COMPRESSIONS)}), "
              f"{' '.join(JSON_LINES_SUFFIX + c for c in COMPRESSIONS)} (JSON Lines; a plain "
              f"{JSON_LINES_SUFFIX} is no data file) or {PARQUET_SUFFIX}")


@dataclasses.dataclass(frozen=True)
class Documents:
    """Raw document texts and what was skipped on the way; with `prompts`, each text continues
    its prompt, whose tokens are context and not training targets (`data.prompt_field`)."""

    texts: tuple[str, ...]
    skipped: tuple[str, ...]  # "path[:line]: reason" for every skipped document
    prompts: tuple[str, ...] | None = None  # one a text ("" for a plain file); None: no prompts


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
    """Files named by paths, directories (searched recursively, into symlinked directories as a
    `**` glob is) and globs, each file once however many patterns name it and however they spell
    it (relative, absolute, `..`, a symlink): a file read twice would be two documents, one
    possibly held out beside the other. Sorted by the real file's path, so that the corpus (its
    order, split and fingerprint) does not depend on the spelling. A directory a glob matches is
    passed over unless it is named `*.parquet` (a data set Spark or pyarrow.dataset wrote in
    parts), which is read as a directory named is."""
    if not patterns:
        raise DataError("data.paths: empty; name at least one file, directory or glob")
    files: dict[Path, Path] = {}  # the real file -> the first spelling naming it
    for pattern in patterns:
        if not pattern.strip():  # Path("") is the working directory, which would be read whole
            raise DataError(f"data.paths: {pattern!r} is empty; name a file, directory or glob")
        p = Path(pattern).expanduser()
        if any(c in pattern for c in "*?[") and not p.exists():  # "notes [draft].txt" is a file
            matches = []
            for m in map(Path, glob.glob(str(p), recursive=True)):
                # a directory x.parquet is one data set written in parts (Spark, pyarrow.dataset)
                parts = m.is_dir() and m.name.endswith(PARQUET_SUFFIX)
                matches += _text_files_under(m) if parts else [m]
            if not any(m.is_file() for m in matches):
                raise DataError(f"data.paths: {pattern!r} matches no file")
        elif p.is_dir():
            matches = _text_files_under(p)
            if not matches:
                raise DataError(f"data.paths: directory {pattern!r} holds no {FILE_KINDS} file")
        elif p.exists():
            matches = [p]
        else:
            raise DataError(f"data.paths: {pattern!r} does not exist")
        for m in matches:
            if m.is_file():
                if not _is_text(m):
                    raise DataError(f"data.paths: {m} is not one of {FILE_KINDS}")
                files.setdefault(m.resolve(), m)
    return [files[real] for real in sorted(files)]


def _text_files_under(root: Path) -> list[Path]:
    """The text files in `root` and its subdirectories, symlinked ones included (Path.rglob
    skips those before Python 3.13), each real directory once: a link cycle ends."""
    found, seen = [], set()
    for directory, subdirectories, names in os.walk(root, followlinks=True):
        real = os.path.realpath(directory)
        if real in seen:
            subdirectories.clear()
            continue
        seen.add(real)
        subdirectories.sort()
        found += [Path(directory, n) for n in sorted(names) if _is_text(Path(directory, n))]
    return found


def file_documents(patterns: tuple[str, ...], text_field: str,
                   prompt_field: str | None = None) -> Documents:
    """Every text file is one document; every JSONL line is one document (its `text_field`,
    after its `prompt_field` where one is named: `iter_records`). Documents whose text is blank
    are left out."""
    skipped: list[str] = []
    files = expand_paths(patterns)
    check_prompt_files(files, prompt_field, patterns)
    records = [(prompt, text) for prompt, text
               in iter_records(files, text_field, prompt_field, skipped) if text.strip()]
    if not records:
        raise DataError(f"data.paths {list(patterns)}: no non-empty document"
                        + (f" ({len(skipped)} skipped, first: {skipped[0]})" if skipped else ""))
    prompts = tuple(p for p, _ in records) if prompt_field is not None else None
    return Documents(tuple(t for _, t in records), tuple(skipped), prompts)


def check_prompt_files(files: list[Path], prompt_field: str | None,
                       patterns: Iterable[str]) -> None:
    """A DataError where `prompt_field` is named but none of `files` (what `patterns` found)
    holds records, JSONL or Parquet, which have prompts: every token of their documents would be
    a training target, as without the setting."""
    if prompt_field is not None and not any(_kind(f) in (".jsonl", PARQUET_SUFFIX) for f in files):
        raise DataError(f"data.prompt_field={prompt_field}: data.paths {list(patterns)} holds no "
                        "JSONL or Parquet file, whose records have prompts, so every token would "
                        "be a training target; name record files, or leave data.prompt_field out")


def _is_text(path: Path) -> bool:
    return path.is_file() and _kind(path) != ""


def _kind(path: Path) -> str:
    """What the data file `path` holds, by its name: one of `TEXT_SUFFIXES` (".jsonl" for a
    compressed `JSON_LINES_SUFFIX` too) or `PARQUET_SUFFIX`, after any of `COMPRESSIONS` but for
    Parquet, which compresses inside; "" for no data file."""
    if path.name.endswith(PARQUET_SUFFIX):
        return PARQUET_SUFFIX
    name = next((path.name.removesuffix(c) for c in COMPRESSIONS if path.name.endswith(c)),
                path.name)
    if name != path.name and name.endswith(JSON_LINES_SUFFIX):
        return ".jsonl"
    return next((suffix for suffix in TEXT_SUFFIXES if name.endswith(suffix)), "")


def _open_bytes(path: Path) -> BinaryIO:
    """The bytes of `path`, decompressed where its name ends in one of `COMPRESSIONS`; a
    DataError for a .zst file where zstandard is not installed."""
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.name.endswith(".zst"):
        try:
            from diff_jax.data import zstd_reader
        except ImportError as e:
            raise DataError(f"data.paths: {path} is Zstandard-compressed, which needs zstandard "
                            f"(pip install 'diff-jax[zstd]'; {e})") from None
        return zstd_reader.open_zstd(path)
    return open(path, "rb")


def read_files(files: list[Path], text_field: str) -> tuple[list[str], list[str]]:
    """(texts, skipped) of `files`, read whole: the texts of `iter_records` without prompts."""
    skipped: list[str] = []
    texts = [text for _, text in iter_records(files, text_field, None, skipped)]
    return texts, skipped


def iter_records(files: Iterable[Path], text_field: str, prompt_field: str | None,
                 skipped: list[str]) -> Iterator[tuple[str, str]]:
    """(prompt, text) of each document of `files`, in order, as they are read: one per plain
    file (its prompt ""), one per JSONL record or Parquet row (`_parquet_records`): its
    `text_field`, and its `prompt_field` (a string, "" allowed) where one is named, else ""
    (gzip or Zstandard allowed, but for Parquet, which compresses inside: `_kind`). A JSONL file
    is read and decoded a record at a time, so it takes the memory of its longest record however
    large it is, and a record that is no UTF-8 is one bad record. Unreadable files and bad
    records are appended to `skipped` with a reason; a JSONL file that cannot be read past some
    point (a damaged or truncated .gz or .zst) keeps the records before it (`path: unreadable
    after line N (...)`), and one whose first non-blank line shows no JSON Lines (a JSON array,
    or pretty-printed JSON: `_opens_no_json_lines`) is one skipped file, not a bad record a line. Records
    end at a newline (or CR LF) only: JSON strings may hold U+2028, U+0085 and the other line
    boundaries of `str.splitlines` unescaped."""
    for path in files:
        kind = _kind(path)
        if kind == PARQUET_SUFFIX:
            yield from _parquet_records(path, text_field, prompt_field, skipped)
            continue
        line = 0
        try:
            if kind == ".jsonl":
                with _open_bytes(path) as f:
                    first = True  # no non-blank line yet
                    for line, raw in enumerate(f, 1):
                        value = _json_line(raw, line)
                        if value is None:
                            continue
                        if first and _opens_no_json_lines(value, raw):
                            skipped.append(f"{path}: not JSON Lines, a JSON object a line (line "
                                           f"{line}: {value[1] or 'no JSON object'})")
                            break
                        first = False
                        record = _jsonl_record(value, f"{path}:{line}", text_field, prompt_field,
                                               skipped)
                        if record is not None:
                            yield record
                continue
            # utf-8-sig: a leading byte-order mark (Windows editors write one) is not text
            with io.TextIOWrapper(_open_bytes(path), encoding="utf-8-sig") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError, EOFError, zlib.error) as e:  # zlib: a damaged .gz
            where = f"unreadable after line {line}" if line else "unreadable"
            skipped.append(f"{path}: {where} ({type(e).__name__}: {e})")
            continue
        yield "", text


def _json_line(line: bytes, n: int) -> tuple[Any, str] | None:
    """(value, "") of line `n` of a JSONL file (a first line's byte-order mark, which Windows
    editors write, is no part of it), or (None, why) where it is no UTF-8 or no JSON; None for
    a blank line."""
    try:
        text = line.decode("utf-8-sig" if n == 1 else "utf-8")
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 ({e.reason} at byte {e.start})"
    if not text.strip():
        return None
    try:
        return json.loads(text), ""
    except json.JSONDecodeError as e:
        return None, f"not JSON ({e.msg})"


def _opens_no_json_lines(value: tuple[Any, str], line: bytes) -> bool:
    """Whether a JSONL file's first non-blank `line` (its `_json_line` `value`) shows a file of
    another form: a JSON value that is no object (a one-line array), or the "[" or "{" alone
    that pretty-printed JSON opens with (after the byte-order mark a Windows editor writes). A
    first line that is damaged JSON is one bad record, as any other line is: the records after
    it are kept."""
    record, why = value
    return (not why and not isinstance(record, dict)
            or line.removeprefix(codecs.BOM_UTF8).strip() in (b"[", b"{"))


def _jsonl_record(value: tuple[Any, str], where: str, field: str, prompt_field: str | None,
                  skipped: list[str]) -> tuple[str, str] | None:
    """(prompt, text) of the JSONL record `value` (`_json_line`'s, of the line `where` names):
    its `field`, after its `prompt_field` where one is named (else ""); or None, appended to
    `skipped`, for a bad record."""
    record, why = value
    if why:
        skipped.append(f"{where}: {why}")
        return None
    for name, key in ((field, "data.text_field"), (prompt_field, "data.prompt_field")):
        if name is not None and not (isinstance(record, dict)
                                     and isinstance(record.get(name), str)):
            skipped.append(f"{where}: no string field {name!r} ({key})")
            return None
    if not record[field].strip():  # a record is there to be read: it is no document, said so
        skipped.append(f"{where}: blank field {field!r} (data.text_field)")
        return None
    return ("" if prompt_field is None else record[prompt_field]), record[field]


def _parquet_records(path: Path, field: str, prompt_field: str | None,
                     skipped: list[str]) -> Iterator[tuple[str, str]]:
    """(prompt, text) of each row of the Parquet file `path`: its string column `field`, after
    `prompt_field`'s where one is named (else ""), as `_jsonl_record` reads a record (a
    dictionary-encoded string column, as pandas writes its category dtype, too). Only those
    columns are read, `PARQUET_BATCH_ROWS` rows at a time, so the file takes the memory of one
    row group's columns (as written: often 100K rows or 128 MiB), not its own. A row whose value
    is null, or a blank text, is skipped and named (`path: row N: ...`, N from 1); a file that
    lacks a column, holds no strings in it, or cannot be read is one skipped entry, and one
    damaged past some row keeps the rows before it. A DataError when pyarrow is missing."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError(f"data.paths: {path} is a Parquet file, which needs pyarrow (pip install "
                        f"'diff-jax[parquet]'; {e})") from None
    row = 0
    try:
        reader = pq.ParquetFile(path)
        schema = reader.schema_arrow
        columns = [(name, key) for name, key in ((prompt_field, "data.prompt_field"),
                                                  (field, "data.text_field")) if name is not None]
        for name, key in columns:
            kind = schema.field(name).type if name in schema.names else None
            # a dictionary-encoded column (pandas' category dtype) holds strings by index
            values = kind.value_type if kind is not None and pa.types.is_dictionary(kind) else kind
            if values is None or not (pa.types.is_string(values) or pa.types.is_large_string(values)
                                      or pa.types.is_string_view(values)):
                what = (f"no column {name!r} ({key})" if kind is None else
                        f"column {name!r} ({key}) holds {kind}, not strings")
                skipped.append(f"{path}: {what}; its columns: {', '.join(schema.names[:8])}"
                               + (", ..." if len(schema.names) > 8 else ""))
                return
        for batch in reader.iter_batches(batch_size=PARQUET_BATCH_ROWS,
                                         columns=[name for name, _ in columns]):
            values = [batch.column(name).to_pylist() for name, _ in columns]
            prompts = values[0] if prompt_field is not None else [""] * batch.num_rows
            for prompt, text in zip(prompts, values[-1]):
                row += 1
                if prompt is None or text is None:
                    null = (prompt_field, "data.prompt_field") if prompt is None else (
                        field, "data.text_field")
                    skipped.append(f"{path}: row {row}: null {null[0]!r} ({null[1]})")
                elif not text.strip():
                    skipped.append(f"{path}: row {row}: blank field {field!r} (data.text_field)")
                else:
                    yield prompt, text
    except (OSError, pa.ArrowException) as e:
        where = f"unreadable after row {row}" if row else "unreadable"
        skipped.append(f"{path}: {where} ({type(e).__name__}: {e})")
