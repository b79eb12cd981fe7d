"""A child process under a time limit, for the GPU session's stages and the kernel probes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_limited(cmd: list[str], limit: float, grace: float,
                env: dict[str, str] | None = None) -> tuple[str, int | None]:
    """Run `cmd` in the repository root, stdout and stderr together; at `limit` seconds it is
    sent SIGTERM and, `grace` seconds later, killed. Returns (its output, its exit status, or
    None when it ran past `limit`)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env or dict(os.environ), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=max(limit, 1))
        return out, proc.returncode
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        return out, None
