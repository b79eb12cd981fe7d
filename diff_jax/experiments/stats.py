"""Summaries over seeds, and the paired differences every claim of a report rests on.

A paired difference compares two models trained with the same seed (same initialisation key,
same data order): d_s = a_s − b_s per seed s. Its spread is the range [min_s d_s, max_s d_s]. A
difference "lies outside the spread of zero" when every seed's difference has the same sign
(min > 0 or max < 0) and there are at least two seeds; only then does a report call a direction
measured. Nothing else is called agreement or disagreement.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def stat(values: list[float]) -> dict[str, float]:
    """{"mean", "std" (sample, 0 for one value), "n"} of `values` (n ≥ 1)."""
    x = np.asarray(values, float)
    return {"mean": float(x.mean()), "std": float(x.std(ddof=1)) if len(x) > 1 else 0.0,
            "n": len(x)}


def stats(per_seed: list[Any]) -> Any:
    """Element-wise `stat` of equally shaped nested lists/dicts of numbers, one per seed."""
    first = per_seed[0]
    if isinstance(first, dict):
        return {k: stats([s[k] for s in per_seed]) for k in first}
    if isinstance(first, list):
        return [stats([s[i] for s in per_seed]) for i in range(len(first))]
    return stat([float(s) for s in per_seed])


def mean_std(s: dict[str, float], digits: int = 2) -> str:
    """A `stat` as a table cell: "0.52 ± 0.03" (the std only with more than one seed), or "n/a"
    for a mean that is not finite."""
    if not math.isfinite(s["mean"]):
        return "n/a"
    text = f"{s['mean']:.{digits}f}"
    return text + (f" ± {s['std']:.{digits}f}" if s["n"] > 1 else "")


def paired(a: list[float], b: list[float]) -> dict[str, Any]:
    """The per-seed differences a − b (same seed order) and their mean, std, min, max, n and
    `outside_spread`: at least two seeds and all differences of one sign."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired values need equal, non-zero lengths, got {len(a)} and {len(b)}")
    d = [float(x) - float(y) for x, y in zip(a, b)]
    finite = all(math.isfinite(x) for x in d)
    outside = finite and len(d) > 1 and (min(d) > 0 or max(d) < 0)
    return {**stat(d), "min": min(d), "max": max(d), "per_seed": d, "outside_spread": outside}


def describe(p: dict[str, Any], digits: int = 3) -> str:
    """'+0.012 (std 0.004, min +0.008, max +0.016 over 3 seeds): outside the seed spread' and
    the like, for a `paired` result."""
    f = f"{{:+.{digits}f}}"
    if p["n"] == 1:
        return f"{f.format(p['mean'])} (one seed: no spread, no direction claimed)"
    spread = (f"{f.format(p['mean'])} (std {p['std']:.{digits}f}, min {f.format(p['min'])}, "
              f"max {f.format(p['max'])} over {p['n']} seeds)")
    if p["outside_spread"]:
        return spread + ": every seed has the same sign, zero lies outside the seed spread"
    return spread + ": zero lies within the seed spread, no direction claimed"
