"""A parameter matrix whose default run is its pairwise cover plus a seeded sample; --run-slow runs it all.

Every value of every axis meets every value of every other axis in at least one case of the default run (the
interactions that break kernels are mostly between two parameters: a head size with a dtype, a length mix with
causality). A few more cases, drawn with a fixed seed, run too. The rest of the product is marked slow, so
`make test-all` (pytest --run-slow) still runs every case.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest

# Cases drawn at random from the rest of the product, on top of the pairwise cover.
SAMPLE = 6


def _pairs(case: tuple[int, ...]) -> set[tuple[int, int, int, int]]:
    return {(a, case[a], b, case[b]) for a, b in itertools.combinations(range(len(case)), 2)}


def pairwise_cover(sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """Indices of cases (one index per axis) covering every pair of values of any two axes, chosen greedily:
    each next case is the one that covers the most pairs not yet covered (the first such, so the choice is
    the same on every run)."""
    product = list(itertools.product(*(range(n) for n in sizes)))
    uncovered = set().union(*(_pairs(case) for case in product)) if len(sizes) > 1 else set()
    chosen = [] if uncovered else product[:]
    while uncovered:
        best = max(product, key=lambda case: len(_pairs(case) & uncovered))
        chosen.append(best)
        uncovered -= _pairs(best)
    return chosen


def matrix(
    names: str,
    axes: Sequence[Sequence[Any]],
    ids: Sequence[Callable[[Any], str] | None] = (),
    spread: Sequence[int] = (),
    seed: int = 0,
) -> pytest.MarkDecorator:
    """`pytest.mark.parametrize(names, ...)` over the product of `axes`: the pairwise cover and SAMPLE more
    cases in the default run, every other case marked slow. The values of the axes whose index is in `spread`
    are tuples that fill several names (e.g. "heads,kv_heads")."""
    sizes = [len(axis) for axis in axes]
    product = list(itertools.product(*(range(n) for n in sizes)))
    fast = set(pairwise_cover(sizes))
    rest = [case for case in product if case not in fast]
    fast |= set(random.Random(seed).sample(rest, min(SAMPLE, len(rest))))
    id_of = list(ids) + [None] * (len(axes) - len(ids))

    def case_id(case: tuple[int, ...]) -> str:
        return "-".join(
            (fn(axis[i]) if fn else _plain_id(axis[i], i)) for fn, axis, i in zip(id_of, axes, case, strict=True)
        )

    def values(case: tuple[int, ...]) -> list[Any]:
        out: list[Any] = []
        for index, (axis, i) in enumerate(zip(axes, case, strict=True)):
            out.extend(axis[i]) if index in spread else out.append(axis[i])
        return out

    params = [
        pytest.param(
            *values(case),
            id=case_id(case),
            marks=() if case in fast else pytest.mark.slow,
        )
        for case in product
    ]
    return pytest.mark.parametrize(names, params)


def _plain_id(value: Any, index: int) -> str:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return str(value)
    name = getattr(value, "__name__", None) or str(value).removeprefix("torch.")
    return name if len(name) <= 20 else f"v{index}"
