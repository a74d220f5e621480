"""Judging a candidate set of tensors against what a model expects, before anything is copied (pure).

`expected` describes every tensor the model knows; `wanted` (default: all of them) names the ones this call needs,
which are the only ones required, checked and read. A name the model does not know is an extra, refused unless
`allow_extra`; ignored names (e.g. rotary inv_freq) are always fine. Expert parallelism reads one rank's experts
this way: the other ranks' experts are known to the model, so they are neither missing nor extra.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from tidal.worker.checkpoint.errors import CheckpointUnfitError, some_of
from tidal.worker.checkpoint.header import StoredTensor


@dataclass(frozen=True)
class Expected:
    shape: tuple[int, ...]
    dtypes: frozenset[str]  # dtype names a candidate may have, e.g. {"bfloat16"}


@dataclass(frozen=True)
class Candidate:
    shape: tuple[int, ...]
    dtype: str


def never_ignored(_name: str) -> bool:
    return False


def find_problems(
    expected: Mapping[str, Expected],
    candidate: Mapping[str, Candidate],
    *,
    allow_extra: bool,
    is_ignored: Callable[[str], bool] = never_ignored,
    wanted: Collection[str] | None = None,
    extras_hint: str = "",
) -> list[str]:
    """Every reason `candidate` cannot give the model its `wanted` tensors; empty when it can. `extras_hint` is
    added to the extras' problem (how a caller may skip them)."""
    required = expected.keys() if wanted is None else set(wanted)
    unknown = sorted(n for n in required if n not in expected)
    if unknown:
        raise ValueError(f"wanted tensors the model does not have: {some_of(unknown)}")
    missing = sorted(n for n in required if n not in candidate)
    judged = sorted(n for n in candidate if n in required)
    wrong_shape = [
        f"{n}: checkpoint {list(candidate[n].shape)} vs model {list(expected[n].shape)}"
        for n in judged
        if candidate[n].shape != expected[n].shape
    ]
    wrong_dtype = [
        f"{n}: checkpoint {candidate[n].dtype} vs model {' or '.join(sorted(expected[n].dtypes))}"
        for n in judged
        if candidate[n].dtype not in expected[n].dtypes
    ]
    extra = sorted(n for n in candidate if n not in expected and not is_ignored(n))
    problems = []
    if missing:
        problems.append(f"missing tensors: {some_of(missing)}")
    if wrong_shape:
        problems.append(f"wrong shapes: {some_of(wrong_shape)}")
    if wrong_dtype:
        problems.append(f"wrong dtypes: {some_of(wrong_dtype)}")
    if extra and not allow_extra:
        hint = f"; {extras_hint}" if extras_hint else ""
        problems.append(f"unexpected tensors (the model does not have them{hint}): {some_of(extra)}")
    return problems


def tensors_to_read(
    stored: Mapping[str, StoredTensor],
    expected: Mapping[str, Expected],
    *,
    allow_extra: bool,
    is_ignored: Callable[[str], bool] = never_ignored,
    wanted: Collection[str] | None = None,
    extras_hint: str = "",
) -> list[StoredTensor]:
    """The stored tensors the model wants, or CheckpointUnfitError with every problem `find_problems` finds."""
    candidate = {name: Candidate(t.shape, t.dtype_name) for name, t in stored.items()}
    problems = find_problems(
        expected, candidate, allow_extra=allow_extra, is_ignored=is_ignored, wanted=wanted, extras_hint=extras_hint
    )
    if problems:
        raise CheckpointUnfitError(problems)
    required = expected.keys() if wanted is None else set(wanted)
    return [t for name, t in stored.items() if name in required]
