"""Train a diff-jax model from a clone: python train.py [--config FILE] [key=value ...]

The command is diff_jax/train.py (`python -m diff_jax.train` where diff-jax is installed): its
docstring and `python train.py --help` say what it takes and its exit statuses.
"""

from diff_jax.command import leave
from diff_jax.train import main

if __name__ == "__main__":
    leave(main())
