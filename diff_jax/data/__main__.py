"""python -m diff_jax.data prepare SRC... OUT_DIR [--text-field F] [--prompt-field P]
[--tokenizer NAME] [--overwrite]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from diff_jax.command import as_ctrl_c, failed, leave, output_kept
from diff_jax.data.corpus import prepare
from diff_jax.data.sources import DataError
from diff_jax.data.tokenizer import BASE
from diff_jax.file_errors import describe

SKIPS_SHOWN = 20  # skip lines printed; meta.json lists every one

# The data.* keys that the data package's messages name, as this command's user types them.
_TYPED = {"data.paths": "SRC", "data.text_field": "--text-field",
          "data.prompt_field": "--prompt-field", "data.tokenizer": "--tokenizer"}


def _as_typed(text: str) -> str:
    """`text` with each data.* key of `_TYPED` named as the argument that sets it here."""
    for key, typed in _TYPED.items():
        text = text.replace(key, typed)
    return text


def main(argv: list[str] | None = None) -> int:
    """`python -m diff_jax.data prepare SRC... OUT_DIR`; returns the exit status: 0, or 2 on bad
    input (a `DataError` or a file-system error, one `error:` line)."""
    parser = argparse.ArgumentParser(prog="python -m diff_jax.data")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize text files/globs (or 'stdlib') into a token corpus")
    p.add_argument("sources", nargs="+", help="files, directories, globs, or 'stdlib'")
    p.add_argument("out_dir")
    p.add_argument("--text-field", default="text",
                   help="JSONL field (Parquet column) holding the text")
    p.add_argument("--prompt-field", default=None,
                   help="JSONL field (Parquet column) holding the prompt the text continues: "
                        "its tokens are context, not training targets (written as loss_mask.bin)")
    p.add_argument("--tokenizer", default=BASE,
                   help=f"{BASE}, cl100k_first_N or a Hugging Face tokenizer.json "
                        "(data.tokenizer)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a prepared corpus at OUT_DIR once the new one is written")
    args = parser.parse_args(argv)
    meta = None  # the corpus's meta.json, once the corpus is written whole
    try:
        with as_ctrl_c(signals=()):  # a closed stdout (`| head`) is a Ctrl-C; SIGTERM as it was
            meta = prepare(args.sources, args.out_dir, args.text_field, args.tokenizer,
                           overwrite=args.overwrite, prompt_field=args.prompt_field)
            skipped = meta.pop("skipped")
            print(json.dumps(dict(meta, skipped=len(skipped)), indent=1))
            for line in skipped[:SKIPS_SHOWN]:
                print(f"skipped: {_as_typed(line)}", file=sys.stderr)
            if len(skipped) > SKIPS_SHOWN:
                print(f"skipped: {len(skipped) - SKIPS_SHOWN:,} more, listed with these in "
                      f"{Path(args.out_dir) / 'meta.json'} (\"skipped\")", file=sys.stderr)
    except DataError as e:
        return failed(_as_typed(str(e)))
    except OSError as e:  # OUT_DIR cannot be made or written, or a source cannot be read
        named = [(f"OUT_DIR {args.out_dir}", args.out_dir), *((f"SRC {x}", x) for x in args.sources)]
        return failed(describe(e, named))
    except KeyboardInterrupt:
        return output_kept(f"OUT_DIR {args.out_dir}", complete=meta is not None)
    return 0


if __name__ == "__main__":
    leave(main())
