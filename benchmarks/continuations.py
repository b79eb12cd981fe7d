"""Scoring continuations of a shared context (the `choice` and `icl` tasks' labels): the KV-cache
route of `choice.continuation_logprobs` (each context read once, every continuation fed after it)
against one full forward per (context, continuation) row, the route it replaced, side by side.

    python benchmarks/continuations.py [--config configs/tiny.yaml] [--context 448] [--labels 20]
        [--label-tokens 2] [--groups 8] [--batch 4] [--repeats 3] [--out benchmarks/results/NAME]

The model is randomly initialised from the config and the contexts and labels are random ids of
its vocabulary (every group: one context, `--labels` continuations of `--label-tokens` tokens, as
icl's prompts and labels). Each route compiles once, then the two are timed alternately
`--repeats` times; their sums must agree (float32 summation order: 1e-3 absolute), or the run
fails. Results: JSON + a markdown table with the device and versions.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def by_rows(model_cfg, params, groups, batch: int):
    """The route `continuation_logprobs` replaced: one row per (context, continuation), padded to
    the longest, the model's next-token NLL over the whole row (`scoring.token_nll`), `batch`
    rows at a time; per group, its continuations' sums."""
    import jax.numpy as jnp
    import numpy as np

    from diff_jax.evaluation.scoring import token_nll
    from diff_jax.transformer import DecoderLM

    rows = [(c, x) for c, tails in groups for x in tails]
    width = max(len(c) + len(x) for c, x in rows)
    model, sums = DecoderLM(model_cfg), []
    for start in range(0, len(rows), batch):
        chunk = rows[start: start + batch]
        chunk += [rows[0]] * (batch - len(chunk))
        tokens = np.zeros((batch, width), np.int32)
        for r, (c, x) in enumerate(chunk):
            tokens[r, : len(c) + len(x)] = [*c, *x]
        nll = np.asarray(token_nll(model, params, jnp.asarray(tokens[:, :-1]),
                                   jnp.asarray(tokens[:, 1:])), np.float64)
        sums += [-nll[r, len(c) - 1: len(c) + len(x) - 1].sum()
                 for r, (c, x) in enumerate(chunk[: len(rows) - start])]
    per = len(groups[0][1])
    return [np.array(sums[g * per: (g + 1) * per]) for g in range(len(groups))]


def measure(args: argparse.Namespace) -> dict:
    """Seconds of each route (the first call, compiling, then `repeats` alternating calls)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import linen as nn

    from diff_jax.config import load_config
    from diff_jax.evaluation.choice import continuation_logprobs
    from diff_jax.transformer import DecoderLM

    cfg = load_config(args.config).model
    params = nn.meta.unbox(jax.jit(DecoderLM(cfg).init)(jax.random.key(0),
                                                        jnp.zeros((1, 8), jnp.int32)))["params"]
    rng = np.random.default_rng(0)
    groups = [(rng.integers(0, cfg.vocab_size, args.context).tolist(),
               [rng.integers(0, cfg.vocab_size, args.label_tokens).tolist()
                for _ in range(args.labels)]) for _ in range(args.groups)]
    routes = {"kv_cache": lambda: [logps.sum(1) for logps in
                                   continuation_logprobs(cfg, params, groups, args.batch)],
              "row_per_continuation": lambda: by_rows(cfg, params, groups, args.batch)}
    first, times, sums = {}, {name: [] for name in routes}, {}
    for name, route in routes.items():
        t0 = time.perf_counter()
        sums[name] = route()
        first[name] = time.perf_counter() - t0
    gap = max(float(np.max(np.abs(a - b))) for a, b in zip(*sums.values()))
    if gap > 1e-3:
        raise AssertionError(f"the routes' sums differ by {gap:.2e} (more than 1e-3)")
    for _ in range(args.repeats):
        for name, route in routes.items():
            t0 = time.perf_counter()
            route()
            times[name].append(time.perf_counter() - t0)
    return {"config": args.config, "context": args.context, "labels": args.labels,
            "label_tokens": args.label_tokens, "groups": args.groups, "batch": args.batch,
            "repeats": args.repeats, "max_abs_difference": gap,
            "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "python": platform.python_version(),
            "results": {name: {"median_s": statistics.median(times[name]), "times_s": times[name],
                               "first_call_s": first[name]} for name in routes}}


def table(result: dict) -> str:
    """The markdown of `result`."""
    r = result["results"]
    lines = [f"# Scoring continuations: {Path(result['config']).name}, {result['groups']} contexts "
             f"of {result['context']} tokens, {result['labels']} continuations of "
             f"{result['label_tokens']} tokens each, batch {result['batch']}", "",
             f"Device: {result['device']}; jax {result['jax']}; Python {result['python']}. "
             f"Median of {result['repeats']} alternating calls; the routes' sums agree within "
             f"{result['max_abs_difference']:.1e}.", "",
             "| route | median s | calls s | first call (compile + run) s |", "|---|---|---|---|"]
    for name, s in r.items():
        lines.append(f"| {name} | {s['median_s']:.2f} | "
                     f"{', '.join(f'{t:.2f}' for t in s['times_s'])} | {s['first_call_s']:.1f} |")
    ratio = r["row_per_continuation"]["median_s"] / r["kv_cache"]["median_s"]
    lines += ["", f"row per continuation / KV cache: {ratio:.1f}× (medians)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """The command line in the module docstring. Exit status 0; 2 on bad input (one `error:`
    line); 1 when the routes disagree; 130 after Ctrl-C."""
    sys.path.insert(0, str(ROOT))
    from diff_jax.command import Written, concluded, positive_int

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs/tiny.yaml"))
    for name, default in (("context", 448), ("labels", 20), ("label-tokens", 2), ("groups", 8),
                          ("batch", 4), ("repeats", 3)):
        p.add_argument(f"--{name}", type=positive_int, default=default)
    p.add_argument("--out", type=Path, help="writes OUT.json and OUT.md, replacing them")
    args = p.parse_args(argv)
    written = Written()

    def work() -> None:
        from diff_jax.config import ConfigError, load_config
        from diff_jax.output_dir import write_whole

        model = load_config(args.config).model  # before any measurement
        if args.context + args.label_tokens - 1 > model.max_seq_len:
            raise ConfigError(f"--context {args.context} + --label-tokens {args.label_tokens}: "
                              f"more than the model.max_seq_len ({model.max_seq_len}) of "
                              f"{args.config}")
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
        result = measure(args)
        text = table(result)
        if args.out:
            write_whole(Path(f"{args.out}.json"), json.dumps(result, indent=1))
            write_whole(Path(f"{args.out}.md"), text)
            written.whole = True
        print(text, end="")

    return concluded(work, None if args.out is None else (f"--out {args.out}",
                                                          str(args.out.parent)), written=written)


if __name__ == "__main__":
    sys.exit(main())
