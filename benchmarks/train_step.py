"""Train-step speed: DIFF vs its Transformer twin, side by side, and the data pipeline alone.

    python benchmarks/train_step.py [--diff configs/tiny.yaml] [--baseline configs/tiny-transformer.yaml]
        [--set KEY=VALUE ...] [--diff-set KEY=VALUE ...] [--baseline-set KEY=VALUE ...]
        [--steps 10] [--no-data] [--no-segment-ids] [--out benchmarks/results/train_step_cpu]

e.g. the committed benchmarks/results/train_step_h100 (one H100, 12 of the 830M twins' layers):
  --diff configs/diff-830m.yaml --baseline configs/transformer-830m.yaml
  --set train.batch_size=8 model.num_layers=12 mesh.data=1 mesh.fsdp=-1
  --diff-set model.attention_impl=pallas model.num_heads=12
  --baseline-set model.attention_impl=auto model.num_heads=24 --no-data
  --out benchmarks/results/train_step_h100

Both models run the training loop's jitted, sharded step (`diff_jax.step.build_steps`) on the same
synthetic batches, interleaved (A, B, A, B, …) so machine noise hits both; the median step time is
reported. Both train steps compile side by side on two threads before the first step; a model's
`first_call_s` is its first step with what was left of its compile by then (the second model's
includes less of its compile than it took). The batches carry segment ids (one document a row) as
train.py's packed batches always do: the fused kernel masks by them in its tiles, while cuDNN,
which `jax.nn.dot_product_attention` gives no segment ids, receives them as a dense (B, 1, T, T)
mask (`kernels._cudnn_attend`). `--no-segment-ids` leaves them out: causal masking only, every
attention's fastest path. The data pipeline (stdlib corpus -> packed grain batches) is timed alone
and compared with what the DIFF model consumes. Results are printed and saved as JSON + a markdown
table with device and versions.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import platform
import statistics
import time
from pathlib import Path

from diff_jax.platforms import default_to_cpu_without_accelerators

default_to_cpu_without_accelerators()  # before jax is imported (diff_jax/platforms.py)

import flax  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from diff_jax.command import Written, concluded, leave, positive_int  # noqa: E402
from diff_jax.config import Config, ConfigError, load_config  # noqa: E402
from diff_jax.metrics import mfu  # noqa: E402
from diff_jax.output_dir import write_whole  # noqa: E402
from diff_jax.sharding import make_mesh  # noqa: E402
from diff_jax.step import build_steps  # noqa: E402
from diff_jax.summary import flops_per_token  # noqa: E402
from diff_jax.train_loop import BAD_INPUT  # noqa: E402 - what train.py refuses as bad input


def _batch(config: Config, segment_ids: bool) -> dict[str, np.ndarray]:
    """One host batch of (train.batch_size, train.seq_len) int32 arrays: random ids in
    [0, model.vocab_size), with segment ids (one document a row) unless `segment_ids` is False."""
    t = config.train
    toks = np.random.default_rng(0).integers(0, config.model.vocab_size,
                                             (t.batch_size, t.seq_len + 1), dtype=np.int32)
    host = {"tokens": toks[:, :-1], "targets": toks[:, 1:],
            "positions": np.tile(np.arange(t.seq_len, dtype=np.int32), (t.batch_size, 1))}
    if segment_ids:
        host["segment_ids"] = np.ones((t.batch_size, t.seq_len), np.int32)
    return host


def _stepper(config: Config, segment_ids: bool, pool: concurrent.futures.Executor):
    """(run one step -> its seconds, tokens per step) for `config` on all local devices, on
    `_batch(config, segment_ids)`. The train step is lowered here and compiled on `pool`: the
    first step waits for what is left of its compile, so the twins' compiles overlap (XLA
    compiles without holding the GIL) and a GPU session's train stage pays for about one."""
    steps = build_steps(config, make_mesh(config.mesh))
    with steps.context():
        state = steps.init(jax.random.PRNGKey(0))
        batch = jax.device_put(_batch(config, segment_ids), steps.batch_sharding)
        compiled = pool.submit(steps.train.lower(state, batch).compile)
    holder = {"state": state}

    def step() -> float:
        t0 = time.perf_counter()
        with steps.context():
            holder["state"], m = compiled.result()(holder["state"], batch)
        jax.block_until_ready(m)
        return time.perf_counter() - t0

    return step, config.train.batch_size * config.train.seq_len


def data_throughput(config: Config, batches: int = 300) -> float:
    """Tokens/s of the input pipeline alone (after corpus loading)."""
    from diff_jax import data  # grain + tiktoken: only needed here

    t = config.train
    inputs = data.build(config.data, t.seq_len, t.batch_size, 0, t.seed, 0, 1)
    next(inputs.train)
    t0 = time.perf_counter()
    n = sum(next(inputs.train)["tokens"].size for _ in range(batches))
    return n / (time.perf_counter() - t0)


def _config(flag: str, path: str, overrides: list[str]) -> Config:
    """`load_config(path, overrides)`; its error names `flag`, the model it was given for."""
    try:
        return load_config(path, overrides)
    except ConfigError as e:
        raise ConfigError(f"{flag} {path}: {e}") from None


def _percent(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def main(argv: list[str] | None = None) -> int:
    """The command line in the module docstring (`argv`: None reads sys.argv): time both models,
    print and save the table. Exit status 0; 2 on bad input (a config, an override, a mesh the
    devices do not have, a file that cannot be written: one `error:` line); 130 after Ctrl-C."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--diff", default="configs/tiny.yaml")
    p.add_argument("--baseline", default="configs/tiny-transformer.yaml")
    p.add_argument("--set", nargs="*", default=[], help="overrides for both models")
    p.add_argument("--diff-set", nargs="*", default=[])
    p.add_argument("--baseline-set", nargs="*", default=[])
    p.add_argument("--no-data", action="store_true", help="skip the data pipeline measurement")
    p.add_argument("--no-segment-ids", action="store_true",
                   help="batches without segment ids (causal masking only)")
    p.add_argument("--steps", type=positive_int, default=10)
    p.add_argument("--out", default="benchmarks/results/train_step_cpu",
                   help="writes OUT.json and OUT.md, replacing them (default: %(default)s, the "
                        "committed CPU results)")
    args = p.parse_args(argv)
    written = Written()
    return concluded(lambda: measure(args, written),
                     (f"--out {args.out}", str(Path(args.out).parent)), BAD_INPUT, written)


def measure(args: argparse.Namespace, written: Written) -> None:
    """`main`'s work for parsed `args`: time both models, print and save the table."""
    out = Path(args.out)  # OUT.json and OUT.md; OUT may hold a dot (train_step_1.4b)
    out.parent.mkdir(parents=True, exist_ok=True)  # before the compiles: a bad --out ends at once
    configs = {"diff": _config("--diff", args.diff, args.set + args.diff_set),
               "transformer": _config("--baseline", args.baseline, args.set + args.baseline_set)}
    with concurrent.futures.ThreadPoolExecutor(len(configs)) as pool:
        steppers = {k: _stepper(c, not args.no_segment_ids, pool) for k, c in configs.items()}
        # the first call waits for its compile (the twins compile side by side)
        compile_s = {k: s() for k, (s, _) in steppers.items()}
    times: dict[str, list[float]] = {k: [] for k in steppers}
    for _ in range(args.steps + 1):
        for k, (s, _) in steppers.items():
            times[k].append(s())
    rows = {}
    dev = jax.devices()[0]
    for k, (_, tokens) in steppers.items():
        med = statistics.median(times[k][1:])
        c = configs[k]
        rows[k] = {"config": getattr(args, "diff" if k == "diff" else "baseline"),
                   "attention_impl": c.model.attention_impl, "step_time_s": med,
                   "tokens_per_sec": tokens / med, "first_call_s": compile_s[k],
                   "mfu": mfu(flops_per_token(c.model, c.train.seq_len), tokens / med,
                              dev.device_kind, jax.device_count())}
    ratio = rows["diff"]["step_time_s"] / rows["transformer"]["step_time_s"]
    consumed = rows["diff"]["tokens_per_sec"]
    pipeline = None if args.no_data else data_throughput(configs["diff"])
    result = {
        "device": f"{dev.platform}:{dev.device_kind} x{jax.device_count()}",
        "cpu": platform.processor() or platform.machine(),
        "versions": {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
                     "python": platform.python_version(),
                     "platform_version": getattr(dev.client, "platform_version", None)},
        "overrides": {"both": args.set, "diff": args.diff_set, "baseline": args.baseline_set},
        "segment_ids": not args.no_segment_ids,
        "steps_timed": args.steps, "models": rows, "diff_over_transformer_step_time": ratio,
        "data_pipeline_tokens_per_sec": pipeline,
        "pipeline_over_consumption": None if pipeline is None else pipeline / consumed,
    }
    write_whole(Path(f"{out}.json"), json.dumps(result, indent=1))
    md = [f"# Train step: DIFF vs Transformer ({result['device']}, jax {jax.__version__})", "",
          f"Overrides: {result['overrides']}", "",
          "Batches " + ("with segment ids (one document a row; cuDNN gets them as a dense T×T "
                        "mask)" if result["segment_ids"] else "without segment ids (causal only)")
          + ".", "",
          "| model | config | attention | step time (s, median) | tokens/s | MFU |", "|---|---|---|---|---|---|"]
    md += [f"| {k} | {r['config']} | {r['attention_impl']} | {r['step_time_s']:.4f} | "
           f"{r['tokens_per_sec']:,.0f} | {_percent(r['mfu'])} |"
           for k, r in rows.items()]
    md += ["", f"DIFF / Transformer step time: **{ratio:.3f}**", ""]
    if pipeline is not None:
        md += [f"Data pipeline alone: {pipeline:,.0f} tokens/s = **{pipeline / consumed:.0f}×** what the "
               f"DIFF model consumes ({consumed:,.0f} tokens/s; target ≥ 10×)", ""]
    write_whole(Path(f"{out}.md"), "\n".join(md))
    written.whole = True
    print("\n".join(md))


if __name__ == "__main__":
    leave(main())  # after Ctrl-C without the interpreter's teardown (diff_jax.command)
