"""Small statistics for distribution tests, without scipy."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for a chi-square variable with df degrees of freedom (regularised upper gamma)."""
    if x <= 0:
        return 1.0
    a, z = df / 2.0, x / 2.0
    if z < a + 1:  # series for the lower gamma, then complement
        term = total = 1.0 / a
        k = a
        while term > total * 1e-15:
            k += 1
            term *= z / k
            total += term
        return max(0.0, 1.0 - total * math.exp(-z + a * math.log(z) - math.lgamma(a)))
    # Continued fraction for the upper gamma (Lentz).
    b, c, d = z + 1 - a, 1e300, 1.0 / (z + 1 - a)
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return math.exp(-z + a * math.log(z) - math.lgamma(a)) * h


def chi_square_same_distribution(a: Counter[Hashable], b: Counter[Hashable], min_expected: float = 5.0) -> float:
    """p-value of a chi-square test that two samples come from the same distribution.

    Rare outcomes (expected count below min_expected in either sample) are pooled into one cell."""
    na, nb = sum(a.values()), sum(b.values())
    n = na + nb
    cells: list[tuple[int, int]] = []
    rare = [0, 0]
    for key in set(a) | set(b):
        oa, ob = a.get(key, 0), b.get(key, 0)
        tot = oa + ob
        if min(tot * na / n, tot * nb / n) < min_expected:
            rare[0] += oa
            rare[1] += ob
        else:
            cells.append((oa, ob))
    if sum(rare):
        cells.append((rare[0], rare[1]))
    if len(cells) < 2:
        return 1.0
    stat = 0.0
    for oa, ob in cells:
        tot = oa + ob
        ea, eb = tot * na / n, tot * nb / n
        stat += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
    return chi2_sf(stat, len(cells) - 1)
