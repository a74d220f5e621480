"""Errors of model loading, each naming what is wrong and where."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """The model directory cannot be loaded as it is."""


class MissingModelFileError(ModelLoadError, FileNotFoundError):
    pass


class CheckpointMismatchError(ModelLoadError):
    """The checkpoint's tensors don't fit the model built from config.json (names, shapes or dtypes)."""
