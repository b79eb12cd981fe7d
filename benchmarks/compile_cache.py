"""What `train.compile_cache_dir` saves: a run's compiles with no cache, into an empty one, and
read back from the one an earlier run filled (a resume, the next seed or init of a replication).

    python benchmarks/compile_cache.py [--config configs/tiny.yaml] [--set KEY=VALUE ...]
        [--steps 2] [--repeats 3] [--out benchmarks/results/compile_cache_cpu]

Every measurement is `train.py` in a fresh process, on a fresh run directory, for `--steps`
steps without validation. Each repeat runs three, interleaved so that machine noise hits all:
`none` (no cache, even where the environment names one in `JAX_COMPILATION_CACHE_DIR`), `cold`
(an empty cache directory) and `warm` (the directory `cold` just filled). Each process records,
from JAX's own monitoring events, the seconds its programs took to compile or to be read from
the cache (`/jax/core/compile/backend_compile_duration`), the persistent cache's hits and misses
and the compile seconds its hits saved, net of reading them (`.../compile_time_saved_sec`); the
parent records the process's wall time (start-up, data, compiles, the steps and the final
checkpoint). The compile seconds of the runs without a cache are also split by program (the
jitted function's name: the initialization `init_state`, the step `train_step`, ...). Medians
over repeats are printed and saved as JSON + a markdown table with the device and versions. JAX
caches only programs that took at least `jax_persistent_cache_min_compile_time_secs` (1 s) to
compile, as in training. The committed results: benchmarks/results/compile_cache_cpu (the
defaults) and
compile_cache_cpu_12l (`--set model.num_layers=12 --set model.embed_dim=384 --set
model.num_heads=6 --out benchmarks/results/compile_cache_cpu_12l`), and compile_cache_cpu_24l
and compile_cache_cpu_24l_scan (`--set model.num_layers=24 --set model.scan_layers=false` or
`true`, `--repeats 2`: the layers unrolled and scanned).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package, which train.py runs on

from diff_jax.command import Written, concluded, leave, positive_int  # noqa: E402
from diff_jax.config import load_config  # noqa: E402
from diff_jax.output_dir import write_whole  # noqa: E402

MODES = ("none", "cold", "warm")
EVENTS = {"compile_s": "/jax/core/compile/backend_compile_duration",
          "saved_s": "/jax/compilation_cache/compile_time_saved_sec"}
COUNTS = {"hits": "/jax/compilation_cache/cache_hits",
          "misses": "/jax/compilation_cache/cache_misses"}


def child(stats_path: str, argv: list[str]) -> int:
    """train.py's main on `argv` with JAX's compile events summed into `stats_path` (JSON)."""
    from diff_jax.train import main  # diff_jax first: its platform default, before JAX starts

    from jax import monitoring

    totals = {key: 0.0 for key in EVENTS} | {key: 0 for key in COUNTS}
    programs: dict[str, float] = {}

    def duration(event: str, seconds: float, fun_name: str = "?", **_) -> None:
        for key, name in EVENTS.items():
            if event == name:
                totals[key] += seconds
        if event == EVENTS["compile_s"]:
            programs[fun_name] = programs.get(fun_name, 0.0) + seconds

    def count(event: str, **_) -> None:
        for key, name in COUNTS.items():
            if event == name:
                totals[key] += 1

    monitoring.register_event_duration_secs_listener(duration)
    monitoring.register_event_listener(count)
    status = main(argv)
    Path(stats_path).write_text(json.dumps(totals | {"compile_s_by_program": programs}))
    return status


def measure(argv: list[str], scratch: Path) -> dict:
    """One `train.py` process on `argv`: its wall time and compile statistics."""
    stats = scratch / "stats.json"
    t0 = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}  # none is none
    proc = subprocess.run([sys.executable, __file__, "--child", str(stats), *argv], cwd=ROOT,
                          capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, f"train.py {' '.join(argv)}",
                                            proc.stdout, proc.stderr)
    return {"wall_s": wall, **json.loads(stats.read_text())}


def versions() -> dict:
    import jax

    device = jax.devices()[0]
    return {"device": f"{jax.device_count()} × {device.device_kind} ({device.platform})",
            "host": f"{platform.machine()}, {len(os.sched_getaffinity(0))} CPU cores",
            "python": platform.python_version(), "jax": jax.__version__}


def run(config: str, settings: list[str], steps: int, repeats: int) -> dict:
    """`repeats` rounds of none / cold / warm; every row and the medians per mode."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        for r in range(repeats):
            cache = scratch / f"cache{r}"
            for mode in MODES:
                argv = ["--config", config, *settings, f"train.steps={steps}", "train.eval_every=0",
                        f"train.run_dir={scratch / f'run{r}-{mode}'}"]
                if mode != "none":
                    argv.append(f"train.compile_cache_dir={cache}")
                rows.append({"repeat": r, "mode": mode, **measure(argv, scratch)})
                print(json.dumps(rows[-1]), flush=True)
    keys = ("wall_s", *EVENTS, *COUNTS)
    medians = {mode: {k: statistics.median(x[k] for x in rows if x["mode"] == mode) for k in keys}
               for mode in MODES}
    uncached = [x["compile_s_by_program"] for x in rows if x["mode"] == "none"]
    names = sorted({name for x in uncached for name in x})
    by_program = {name: statistics.median(x.get(name, 0.0) for x in uncached) for name in names}
    return {"config": config, "settings": settings, "steps": steps, "repeats": repeats,
            **versions(), "rows": rows, "median": medians,
            "none_compile_s_by_program": dict(sorted(by_program.items(), key=lambda kv: -kv[1])),
            "warm_over_none_wall": medians["warm"]["wall_s"] / medians["none"]["wall_s"],
            "warm_over_none_compile": medians["warm"]["compile_s"] / medians["none"]["compile_s"]}


def markdown(result: dict) -> str:
    m = result["median"]
    lines = [f"# train.compile_cache_dir: {' '.join([result['config'], *result['settings']])}",
             "",
             f"{result['device']}, {result['host']}, Python {result['python']}, jax "
             f"{result['jax']}; `train.py`, {result['steps']} steps, a fresh process and run "
             f"directory each, medians of {result['repeats']} interleaved repeats.",
             "",
             "| cache | wall s | compile or cache read s | hits | misses | net s saved by hits |",
             "|---|---|---|---|---|---|"]
    for mode, label in (("none", "none"), ("cold", "empty (cold)"), ("warm", "filled (warm)")):
        x = m[mode]
        lines.append(f"| {label} | {x['wall_s']:.1f} | {x['compile_s']:.1f} | {x['hits']:.0f} | "
                     f"{x['misses']:.0f} | {x['saved_s']:.1f} |")
    lines += ["", f"Warm over none: wall {result['warm_over_none_wall']:.2f}×, compile (or cache "
              f"read) time {result['warm_over_none_compile']:.2f}×."]
    programs = result["none_compile_s_by_program"]
    big = {name: s for name, s in programs.items() if s >= 0.5}
    rest = len(programs) - len(big)
    lines += ["", "Without a cache, the programs that took 0.5 s or more to compile (medians): "
              + (", ".join(f"`{name}` {s:.1f} s" for name, s in big.items()) or "none")
              + f"; the rest ({rest} program{'' if rest == 1 else 's'}) "
              f"{sum(programs.values()) - sum(big.values()):.1f} s."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """The command line in the module docstring (`argv`: None reads sys.argv). Exit status 0; 2
    on bad input (one `error:` line: the config or a --set override, a file that cannot be
    written, a train.py run that refused its input); 1 when a run failed otherwise; 130 after
    Ctrl-C."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(argv[1], argv[2:])
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--config", default="configs/tiny.yaml",
                        help="relative to the checkout, where train.py runs (default: "
                             "%(default)s)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run (repeatable)")
    parser.add_argument("--steps", type=positive_int, default=2)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--out", default="benchmarks/results/compile_cache_cpu",
                        help="writes OUT.json and OUT.md, replacing them (default: %(default)s, "
                             "the committed CPU results)")
    args = parser.parse_args(argv)
    written = Written()
    return concluded(lambda: compare(args, written),
                     (f"--out {args.out}", str(Path(args.out).parent)), written=written)


def compare(args: argparse.Namespace, written: Written) -> None:
    """`main`'s work for parsed `args`: the runs, then the table printed and written."""
    load_config(ROOT / args.config, args.set)  # before any run: a bad config ends at once
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = run(args.config, args.set, args.steps, args.repeats)
    write_whole(Path(f"{out}.json"), json.dumps(result, indent=1) + "\n")
    write_whole(Path(f"{out}.md"), markdown(result))
    written.whole = True
    print(markdown(result))


if __name__ == "__main__":
    leave(main())  # after Ctrl-C without the interpreter's teardown (diff_jax.command)
