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


def paired_censored(a: list[float | None], b: list[float | None], bound: float) -> dict[str, Any]:
    """`paired` for a quantity observed only up to `bound`, such as the step at which accuracy
    first reaches 90% when it is checked until step `bound`: None means "not reached by then",
    a value above `bound`. Per seed the difference a − b is then known exactly when both values
    are, bounded on one side when one is (a None a gives a − b > bound − b, a None b gives
    a − b < a − bound: either way its sign is known) and unknown when neither is. With every
    value known this is `paired(a, b)`; otherwise {"n", "censored_at": bound, "low", "high"
    (per seed: both equal to a − b where it is known, else its exclusive bounds, None where
    unbounded), "sign" (per seed +1, −1, 0 or None: unknown), "outside_spread": at least two
    seeds and every sign known and the same, non-zero}."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired values need equal, non-zero lengths, got {len(a)} and {len(b)}")
    if None not in a and None not in b:
        return paired(a, b)

    def bounds(x: float | None, y: float | None) -> tuple[float | None, float | None, int | None]:
        if x is not None and y is not None:
            d = float(x) - float(y)
            return d, d, int(np.sign(d))
        if y is not None:  # x not reached: x − y > bound − y ≥ 0
            return float(bound) - float(y), None, 1
        if x is not None:  # y not reached: x − y < x − bound ≤ 0
            return None, float(x) - float(bound), -1
        return None, None, None

    low, high, sign = (list(t) for t in zip(*(bounds(x, y) for x, y in zip(a, b))))
    outside = len(sign) > 1 and sign[0] in (1, -1) and all(s == sign[0] for s in sign)
    return {"n": len(sign), "censored_at": float(bound), "low": low, "high": high, "sign": sign,
            "outside_spread": outside}


def describe(p: dict[str, Any], digits: int = 3) -> str:
    """'+0.012 (std 0.004, min +0.008, max +0.016 over 3 seeds): outside the seed spread' and
    the like, for a `paired` or `paired_censored` result."""
    f = f"{{:+.{digits}f}}"
    if "censored_at" in p:
        return _describe_censored(p)
    lost = sum(not math.isfinite(x) for x in p["per_seed"])
    if lost:  # not "+nan (std nan …): zero lies within the seed spread"
        return (f"n/a (not finite in {lost} of {p['n']} seeds: a run diverged; no direction "
                "claimed)")
    if p["n"] == 1:
        return f"{f.format(p['mean'])} (one seed: no spread, no direction claimed)"
    spread = (f"{f.format(p['mean'])} (std {p['std']:.{digits}f}, min {f.format(p['min'])}, "
              f"max {f.format(p['max'])} over {p['n']} seeds)")
    if p["outside_spread"]:
        return spread + ": every seed has the same sign, zero lies outside the seed spread"
    return spread + ": zero lies within the seed spread, no direction claimed"


def _describe_censored(p: dict[str, Any]) -> str:
    """'per seed > +600, −1200, unknown (…)': a `paired_censored` result with a censored value."""

    def seed(lo: float | None, hi: float | None) -> str:
        if lo is not None and lo == hi:
            return f"{lo:+g}"
        if lo is not None:
            return f"> {lo:+g}" if lo else "> 0"
        if hi is not None:
            return f"< {hi:+g}" if hi else "< 0"
        return "unknown"

    text = (f"per seed {', '.join(seed(lo, hi) for lo, hi in zip(p['low'], p['high']))} "
            f"(a value not reached by {p['censored_at']:g} bounds the difference on one side; "
            "where neither was reached it is unknown)")
    if p["n"] == 1:
        return text + " (one seed: no spread, no direction claimed)"
    if p["outside_spread"]:
        return text + ": every seed has the same sign, zero lies outside the seed spread"
    return text + ": the seeds' signs differ or are unknown, no direction claimed"
