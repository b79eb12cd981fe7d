"""Evaluate a checkpoint from a clone: python eval.py task=NAME train.run_dir=RUN [key=value ...]

The command is diff_jax/eval.py (`python -m diff_jax.eval` where diff-jax is installed): its
docstring and `python eval.py --help` say what it takes and its exit statuses.
"""

from diff_jax.command import leave
from diff_jax.eval import main

if __name__ == "__main__":
    leave(main())
