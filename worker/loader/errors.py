"""Errors of model loading, each naming what is wrong and where."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """The model directory cannot be loaded as it is."""


class MissingModelFileError(ModelLoadError, FileNotFoundError):
    pass


class CheckpointMismatchError(ModelLoadError):
    """The checkpoint's tensors don't fit the model built from config.json (names or shapes)."""


def some_of(items: list[str], limit: int = 8) -> str:
    """The first `limit` items for an error message, and how many more there are."""
    shown = ", ".join(items[:limit])
    return shown + (f" (and {len(items) - limit} more)" if len(items) > limit else "")
