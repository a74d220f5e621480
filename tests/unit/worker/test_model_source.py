"""A `.gguf` model file is accepted at the boundary and swapped, before assembly, for its converted directory; the
name clients use and start-up weights that named the same file follow it. (The conversion itself is stood in for
here; tests/worker/test_gguf_model.py runs it.)"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tidal.worker import model_source
from tidal.worker.config import WorkerConfig


@pytest.fixture
def converted(tmp_path, monkeypatch):
    directory = tmp_path / "cache" / "gguf-model-0123-f1"
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    monkeypatch.setattr(model_source, "gguf_model_dir", lambda path: directory)
    return directory


def test_a_gguf_file_is_served_as_its_converted_directory(tmp_path, converted):
    gguf = tmp_path / "SmolThing.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    config = model_source.with_model_directory(WorkerConfig.from_flat(model_path=gguf, weights_path=gguf))
    assert config.engine.model_path == converted
    assert config.engine.model_name == "SmolThing.Q4_1"
    assert config.lifecycle.weights_path == converted


def test_an_explicit_name_and_other_start_up_weights_are_kept(tmp_path, converted):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    other = tmp_path / "v2"
    config = WorkerConfig.from_flat(model_path=gguf, served_model_name="chat", weights_path=other)
    resolved = model_source.with_model_directory(config)
    assert resolved.engine.model_name == "chat" and resolved.lifecycle.weights_path == other


def test_a_directory_is_left_as_given(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    config = WorkerConfig.from_flat(model_path=tmp_path)
    assert model_source.with_model_directory(config) is config


def test_a_missing_gguf_file_is_refused_at_the_boundary(tmp_path):
    with pytest.raises(ValidationError, match="does not exist"):
        WorkerConfig.from_flat(model_path=tmp_path / "absent.gguf")
