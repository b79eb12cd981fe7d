"""Train a diff-jax model: python -m diff_jax.train [--config FILE] [key=value ...]

Where diff-jax is installed and from a clone's root alike; a clone's `python train.py` is the same
command. --config takes a YAML file, or the name of a shipped config (`--config diff-830m.yaml`,
configs/ in a clone, installed with the package). With no arguments it trains configs/tiny.yaml
on the embedded default corpus. Re-running with the
same train.run_dir resumes from its newest checkpoint that verifies (checkpoint.resume_step=N for
another). train.compile_only=true compiles the step instead, for the local devices or, with
train.compile_topology, for a TPU slice (v5p:4x4x4, libtpu installed) or H100s (h100:8, the
cuda-aot extra installed). Exit status: 0 done, 2 bad input (config, data, sharding, a
refused or damaged checkpoint, a file that cannot be read or written, e.g. in train.run_dir, a
model or batch too big for the devices' memory; the same as python -m diff_jax.eval and
python -m diff_jax.export), 1 diverged, 130 stopped at once by Ctrl-C (before
training began, or pressed a second time: the first one finishes the step, saves it and exits 0,
as a SIGTERM or SIGHUP, the terminal closed, does in training). A SIGTERM or SIGHUP before
training began, and an output whose reader is gone (`2>&1 | head`), are a Ctrl-C too: the
latter saves the step in flight in training (diff_jax/command.py).
In a multi-process job, a process that another one's failure stopped says so in one line and exits
with that one's status (diff_jax/peers.py).
"""

from __future__ import annotations

import argparse

from diff_jax.command import as_ctrl_c, failed, interrupted, leave
from diff_jax.config import SHIPPED_CONFIGS, ConfigError, load_config

DEFAULT_CONFIG = SHIPPED_CONFIGS / "tiny.yaml"


def _kept(run_dir: str) -> str:
    """What the `interrupted:` line of a run stopped at once says was kept in `run_dir`."""
    from diff_jax.checkpoint import committed_steps

    if not committed_steps(run_dir):
        return (f"stopped at once; no checkpoint had been committed in {run_dir} (re-run to start "
                "again)")
    return (f"stopped at once; the checkpoints already committed in {run_dir}/checkpoints are kept "
            "(re-run to resume from the newest)")


def main(argv: list[str] | None = None) -> int:
    """The command line above (`argv`: None reads sys.argv); returns the exit status."""
    # prog named: argparse's default, sys.argv[0]'s file name, is `train.py` under `python -m`
    # too, a file an installed diff-jax has in no working directory
    parser = argparse.ArgumentParser(prog="python -m diff_jax.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG),
                        help="YAML config file, or a shipped config's name (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = parser.parse_intermixed_args(argv)  # overrides before and after --config
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        return failed(str(e))
    try:
        with as_ctrl_c():  # a SIGTERM, SIGHUP or closed output too, before training began
            # Imported after parsing so that jax.distributed.initialize is the first JAX call.
            from diff_jax import aot, train_loop

            if config.train.compile_only:
                train_loop.initialize_distributed(config.distributed)
                aot.report(config)
                return 0
            train_loop.run(config)
    except KeyboardInterrupt:  # Ctrl-C before training began (the imports too), or pressed twice
        return interrupted(_kept(config.train.run_dir))
    except train_loop.RUN_ERRORS as e:
        t = config.train
        named = [(f"train.run_dir={t.run_dir}", t.run_dir)]
        if t.compile_cache_dir is not None:
            named.append((f"train.compile_cache_dir={t.compile_cache_dir}", t.compile_cache_dir))
        return train_loop.report(e, named)
    return 0


if __name__ == "__main__":
    leave(main())  # after Ctrl-C without the interpreter's teardown (diff_jax.command)
