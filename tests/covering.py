"""Greedy all-pairs covering designs for kernel tests: every pair of parameter values appears in
at least one row, in far fewer rows than the full cross product."""

from __future__ import annotations

import itertools
import random


def pairwise(params: dict, seed: int = 0, tries: int = 60) -> list[dict]:
    """Greedy all-pairs covering set: each row is the best of ``tries`` random candidates.

    Args:
        params: parameter name → list of values.
    Returns:
        Rows (dicts name → value); deterministic for a given ``seed``.
    """
    names = list(params)
    todo = {((a, x), (b, y)) for a, b in itertools.combinations(names, 2) for x in params[a] for y in params[b]}
    rng, rows = random.Random(seed), []

    def covers(row):
        return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(names, 2)} & todo

    while todo:
        (a, x), (b, y) = min(todo, key=repr)
        cands = [{n: rng.choice(params[n]) for n in names} | {a: x, b: y} for _ in range(tries)]
        best = max(cands, key=lambda r: len(covers(r)))
        todo -= covers(best)
        rows.append(best)
    return rows
