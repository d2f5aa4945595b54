"""Descriptive statistics without dependencies."""

import math
from collections import Counter


def mean(values):
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)


def median(values):
    if not values:
        raise ValueError("median of an empty list")
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return ordered[middle]


def mode(values):
    if not values:
        raise ValueError("mode of an empty list")
    counts = Counter(values)
    best = max(counts.values())
    return min(v for v, c in counts.items() if c == best)


def variance(values, sample=True):
    n = len(values)
    if n < 2:
        raise ValueError("variance needs at least two values")
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / n


def stdev(values, sample=True):
    return math.sqrt(variance(values, sample))


def quantile(values, q):
    if not 0 <= q <= 1:
        raise ValueError("q must be between 0 and 1")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
