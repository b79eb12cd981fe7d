"""python -m diff_jax.export RUN_OR_CHECKPOINT --format FORMAT --out DIR [--dtype D] [--tokenizer T]
[--overwrite]"""

from __future__ import annotations

import argparse

from diff_jax.checkpoint import quiet_abandoned_io
from diff_jax.command import as_ctrl_c, failed, leave, output_kept
from diff_jax.export import DTYPES, FORMATS, ExportError, export
from diff_jax.export.sources import EVAL_DIR, EXPORT_MARKER, read_json
from diff_jax.file_errors import describe


def main(argv: list[str] | None = None) -> int:
    """The command line above (`argv`: None reads sys.argv); returns the exit status, 0 or 2
    (an `ExportError` or a file-system error, printed)."""
    parser = argparse.ArgumentParser(
        prog="python -m diff_jax.export",
        description="Export a diff-jax run, checkpoint or export to safetensors, a params-only "
                    "orbax checkpoint, or a Hugging Face DiffLlama directory.")
    parser.add_argument("source", help="run directory, its checkpoints/ directory, one checkpoint "
                                       "step, or an export directory")
    parser.add_argument("--format", choices=FORMATS, default="safetensors",
                        help="the export format (default: %(default)s)")
    parser.add_argument("--out", required=True, help="the export directory to write")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32",
                        help="storage dtype of every tensor (default: %(default)s)")
    parser.add_argument("--tokenizer",
                        help="hf-diffllama: the tokenizer to write Hugging Face tokenizer "
                             "files for (a tiktoken encoding, or a tokenizer.json to copy), or "
                             "none (default: the run's data.tokenizer; for an import, the "
                             "tokenizer.json it recorded, where that file is unchanged, else "
                             "none, with a note)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing export at --out; refused while it holds "
                             f"{EVAL_DIR}/ (eval.py results), which is never deleted")
    args = parser.parse_args(argv)
    out = None  # the export's directory, once it is written whole
    try:
        with as_ctrl_c(signals=()):  # a closed stdout (`| head`) is a Ctrl-C; SIGTERM as it was
            out = export(args.source, args.out, args.format, dtype=args.dtype,
                         overwrite=args.overwrite, tokenizer=args.tokenizer)
            step = read_json(out / EXPORT_MARKER).get("step")  # the step the source resolved to
            at = "" if step is None else f" (step {step})"
            print(f"wrote {args.format} ({args.dtype}) export of {args.source}{at} to {out}")
    except ExportError as e:
        quiet_abandoned_io()  # a damaged checkpoint's reads: this line stays the last
        return failed(str(e))
    except OSError as e:  # e.g. --out in a directory that cannot be made or written
        quiet_abandoned_io()
        return failed(describe(e, [(f'--out {args.out}', args.out)]))
    except KeyboardInterrupt:
        return output_kept(f"--out {args.out}", complete=out is not None)
    return 0


if __name__ == "__main__":
    leave(main())
