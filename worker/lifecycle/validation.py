"""Judging a whole candidate set of weights against what the model serves, before anything is copied (pure)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tidal.worker.loader.errors import some_of


@dataclass(frozen=True)
class Expected:
    shape: tuple[int, ...]
    dtypes: frozenset[str]  # dtype names a candidate may have, e.g. {"bfloat16"}


@dataclass(frozen=True)
class Candidate:
    shape: tuple[int, ...]
    dtype: str


def find_problems(
    expected: dict[str, Expected],
    candidate: dict[str, Candidate],
    allow_extra: bool,
    is_ignored: Callable[[str], bool] = lambda _: False,
) -> list[str]:
    """Every reason `candidate` cannot replace the served weights; empty when it can. Extras are names the model
    does not have (refused unless `allow_extra`); ignored names (e.g. rotary inv_freq) are always fine."""
    missing = sorted(n for n in expected if n not in candidate)
    extra = sorted(n for n in candidate if n not in expected and not is_ignored(n))
    wrong_shape = [
        f"{n} {list(c.shape)} (model {list(expected[n].shape)})"
        for n, c in sorted(candidate.items())
        if n in expected and c.shape != expected[n].shape
    ]
    wrong_dtype = [
        f"{n} {c.dtype} (model accepts {', '.join(sorted(expected[n].dtypes))})"
        for n, c in sorted(candidate.items())
        if n in expected and c.dtype not in expected[n].dtypes
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors: {some_of(missing)}")
    if wrong_shape:
        problems.append(f"wrong shapes: {some_of(wrong_shape)}")
    if wrong_dtype:
        problems.append(f"wrong dtypes: {some_of(wrong_dtype)}")
    if extra and not allow_extra:
        problems.append(f"tensors the model does not have (allow_extra_tensors to skip them): {some_of(extra)}")
    return problems
