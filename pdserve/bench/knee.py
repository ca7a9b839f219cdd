"""Where an arm's SLO attainment crosses its target, found by bisection over the request
rate, and the binomial interval of an attainment: what `pdserve bench goodput` measures
each arm with, so that a goodput is read off points near its own knee rather than off a
fixed grid that may straddle it.

- **Bracket** of an SLO pair over the points measured so far: `lo`, the last rate
  meeting the target before the first rate that misses it, and `hi`, that rate (the
  goodput definition of slo_attainment.goodput). The knee is resolved once
  hi - lo <= step * lo (step 0.1: the rate known within 10% of the knee), or once the
  lowest rate tried, at or under `floor`, misses (goodput 0 at this floor), or the
  highest, at or over `ceiling`, meets it.
- **Next rate**: for the first unresolved pair in the order given, the midpoint of its
  bracket; twice its highest rate when none missed yet; half its lowest when that one
  missed. Rates are rounded to 3 significant digits, so arms bisecting alike visit the
  same rates (and get the same prompts there, goodput.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's score interval (Wilson, JASA 1927) of a binomial share k/n: (low, high),
    at 95% for z = 1.96. Brown, Cai and DasGupta (Statistical Science, 2001) recommend
    it over the normal approximation, which is too narrow near 0 and 1, where an
    attainment target of 90% sits. (0, 1) when n = 0."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(centre - half, 0.0), min(centre + half, 1.0)


def bracket(points: dict[float, float], target: float) -> tuple[float | None, float | None]:
    """(lo, hi) of attainment `points` {rate: share}: hi the lowest rate whose share is
    under `target` and lo the highest rate under hi (None: no such rate)."""
    rates = sorted(points)
    hi = next((r for r in rates if points[r] < target), None)
    below = [r for r in rates if hi is None or r < hi]
    return (below[-1] if below else None), hi


def _round(rate: float) -> float:
    return float(f"{rate:.3g}")


def next_rate(brackets: list[tuple[float | None, float | None]], measured: set[float],
              step: float, floor: float, ceiling: float) -> float | None:
    """The rate to measure next for the first unresolved bracket (the module
    docstring), or None when every one is resolved."""
    for lo, hi in brackets:
        if hi is None:                          # none missed yet: go higher
            if lo is None or lo >= ceiling:
                continue
            candidate = min(_round(2 * lo), ceiling)
        elif lo is None:                        # the lowest missed: go lower
            if hi <= floor:
                continue
            candidate = max(_round(hi / 2), floor)
        elif hi - lo <= step * lo:
            continue
        else:
            candidate = _round((lo + hi) / 2)
        if candidate not in measured and (lo is None or candidate > lo) and (
                hi is None or candidate < hi):
            return candidate
    return None


def search(measure: Callable[[float], None], shares: Callable[[], list[dict[float, float]]],
           start: float, target: float, step: float = 0.1, floor: float = 0.05,
           ceiling: float = 8.0, max_points: int = 12) -> list[float]:
    """Measure rates until every SLO pair's knee is resolved (next_rate) or
    `max_points` rates were measured; returns the rates in the order measured.

    `measure(rate)` runs one rate point; `shares()` gives, per SLO pair, the
    attainment {rate: share} of every point measured so far (in the pairs' order of
    priority)."""
    done: list[float] = []
    rate: float | None = _round(start)
    while rate is not None and len(done) < max_points:
        measure(rate)
        done.append(rate)
        rate = next_rate([bracket(s, target) for s in shares()], set(done), step, floor,
                         ceiling)
    return done
