"""Generation speed (new tokens per second) of `diff_jax.generate.generate`, optionally against
another checkout of the project, side by side.

    python benchmarks/generate.py [--config configs/tiny.yaml] [--batch 4] [--prompt 64] [--new 128]
        [--repeats 5] [--lengths K] [--baseline-tree DIR --baseline-name NAME]
        [--out benchmarks/results/generate_cpu]

The model is randomly initialised from the config (no checkpoint needed) and prompted with random
ids of its vocabulary; no end-of-text stops a row, so every call produces batch × new tokens. Each
measurement runs in its own subprocess (the current tree, and with `--baseline-tree` a checkout
such as `git worktree add /tmp/before REV`), alternating between the two so that machine noise
hits both; a subprocess compiles once, then times `repeats` calls and reports their median. With
`--lengths K` > 1 it then times one loop of calls over K prompt lengths (--prompt, --prompt − 1,
..., each a batch of that length), its compiles included: what a caller looping over prompts of
other lengths waits.
Results: JSON + a markdown table with the device and versions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diff_jax.command import Written

ROOT = Path(__file__).resolve().parents[1]


def measure(config: str, batch: int, prompt: int, new: int, repeats: int, lengths: int) -> dict:
    """Median seconds of `repeats` generate calls after one compiling call, then the seconds of
    one loop over `lengths` prompt lengths, compiles included (this process)."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import linen as nn

    import diff_jax
    from diff_jax.config import load_config
    from diff_jax.generate import generate
    from diff_jax.transformer import DecoderLM

    cfg = load_config(config).model
    params = nn.meta.unbox(jax.jit(DecoderLM(cfg).init)(jax.random.key(0),
                                                        jnp.zeros((1, 8), jnp.int32)))["params"]
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, prompt)).tolist()
    t0 = time.perf_counter()
    out = generate(cfg, params, prompts, max_new_tokens=new)
    first = time.perf_counter() - t0
    assert all(len(o) == new for o in out)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        generate(cfg, params, prompts, max_new_tokens=new)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    t0 = time.perf_counter()
    for n in range(prompt - 1, prompt - lengths, -1):  # --prompt itself is compiled above
        generate(cfg, params, [row[:n] for row in prompts], max_new_tokens=new)
    loop = time.perf_counter() - t0 + first
    return {"first_call_s": first, "median_s": med, "tokens_per_s": batch * new / med,
            "loop_s": loop,
            "times_s": times, "jax": jax.__version__, "device": jax.devices()[0].device_kind,
            "package": str(Path(diff_jax.__file__).parents[1])}


def _run(tree: Path, args: argparse.Namespace) -> dict:
    """`measure` in a subprocess on `tree`'s package; a failure is its `CalledProcessError`."""
    cmd = [sys.executable, __file__, "--measure", args.config, str(args.batch), str(args.prompt),
           str(args.new), str(args.repeats), str(args.lengths)]
    env = dict(os.environ, PYTHONPATH=str(tree))
    p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise subprocess.CalledProcessError(p.returncode, f"the measurement in {tree}",
                                            p.stdout, p.stderr)
    return json.loads(p.stdout.strip().splitlines()[-1])


def _checkout(text: str) -> Path:
    """An argparse `type`: a checkout of the project (a directory holding diff_jax/), resolved."""
    tree = Path(text).resolve()
    if not (tree / "diff_jax" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"expected a checkout of diff-jax (a directory holding "
                                         f"diff_jax/__init__.py), got {text!r}")
    return tree


def main(argv: list[str] | None = None) -> int:
    """The command line in the module docstring (`argv`: None reads sys.argv). Exit status 0; 2
    on bad input (one `error:` line: a config, a --prompt and --new past its model.max_seq_len,
    a file that cannot be written, a measurement that refused its input); 1 when a measurement
    failed otherwise; 130 after Ctrl-C."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--measure"]:  # a child, on the package of the tree it measures, which may
        config, *sizes = argv[1:]  # predate what the parent imports below
        print(json.dumps(measure(config, *map(int, sizes))))
        return 0
    sys.path.insert(0, str(ROOT))  # this tree's package (a child's is on its PYTHONPATH)
    from diff_jax.command import Written, concluded, positive_int

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs/tiny.yaml"))
    p.add_argument("--batch", type=positive_int, default=4)
    p.add_argument("--prompt", type=positive_int, default=64)
    p.add_argument("--new", type=positive_int, default=128)
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--rounds", type=positive_int, default=2, help="alternating subprocess rounds")
    p.add_argument("--lengths", type=positive_int, default=1,
                   help="also time one loop over this many prompt lengths, compiles included")
    p.add_argument("--baseline-tree", type=_checkout, metavar="DIR",
                   help="another checkout measured beside this one (git worktree add DIR REV)")
    p.add_argument("--baseline-name", default="baseline")
    p.add_argument("--out", type=Path,
                   help="writes OUT.json and OUT.md, replacing them (default: none written; the "
                        "committed CPU results are benchmarks/results/generate_cpu)")
    args = p.parse_args(argv)
    written = Written()
    return concluded(lambda: compare(args, written),
                     None if args.out is None else (f"--out {args.out}", str(args.out.parent)),
                     written=written)


def compare(args: argparse.Namespace, written: Written) -> None:
    """`main`'s work for parsed `args`: the measurements of each tree, alternating; write the
    table and the JSON to --out (`written`), then print the table (before, it was printed
    first: a `| head` gone there lost what was measured)."""
    from diff_jax.config import ConfigError, load_config
    from diff_jax.output_dir import write_whole

    model = load_config(args.config).model  # before any measurement: a bad config ends at once
    if args.lengths >= args.prompt:
        raise ConfigError(f"--lengths {args.lengths}: must be below --prompt ({args.prompt}), "
                          "every prompt of the loop holding a token")
    if args.prompt + args.new > model.max_seq_len:
        raise ConfigError(f"--prompt {args.prompt} + --new {args.new}: more than the "
                          f"model.max_seq_len ({model.max_seq_len}) of {args.config}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    trees = {"current": ROOT}
    if args.baseline_tree:
        trees[args.baseline_name] = args.baseline_tree
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            runs[name].append(_run(tree, args))
    summary = {name: {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                      "first_call_s": statistics.median(r["first_call_s"] for r in rs),
                      "loop_s": statistics.median(r["loop_s"] for r in rs),
                      "rounds": rs} for name, rs in runs.items()}
    result = {"config": args.config, "batch": args.batch, "prompt": args.prompt, "new": args.new,
              "repeats": args.repeats, "lengths": args.lengths, "python": platform.python_version(),
              "results": summary}
    loop = args.lengths > 1  # the loop's column, where it ran over other lengths
    lines = [f"# Generation speed: {Path(args.config).name}, batch {args.batch}, prompt "
             f"{args.prompt}, {args.new} new tokens", "",
             f"Device: {runs['current'][0]['device']}; jax {runs['current'][0]['jax']}. Median of "
             f"{args.repeats} calls per subprocess, median over {args.rounds} alternating rounds.", "",
             "| tree | new tokens/s (median) | per round | first call (compile + run) s |"
             + (f" loop over {args.lengths} prompt lengths s (compiles included; per round) |"
                if loop else ""),
             "|---|---|---|---|" + ("---|" if loop else "")]
    for name, s in summary.items():
        per_round = ", ".join(f"{r['tokens_per_s']:.0f}" for r in s["rounds"])
        loops = ", ".join(f"{r['loop_s']:.1f}" for r in s["rounds"])
        lines.append(f"| {name} | {s['tokens_per_s']:.1f} | {per_round} | {s['first_call_s']:.1f} |"
                     + (f" {s['loop_s']:.1f} ({loops}) |" if loop else ""))
    if args.out:
        write_whole(Path(f"{args.out}.json"), json.dumps(result, indent=1))
        write_whole(Path(f"{args.out}.md"), "\n".join(lines) + "\n")
        written.whole = True
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())  # the parent compiles nothing: no teardown to skip after Ctrl-C
