"""The worker's termination message: why it ended, where Kubernetes reads it, bounded as the kubelet reads it."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from tidal.worker import cli
from tidal.worker.config import WORKER_OPTIONS
from tidal.worker.termination import MAX_MESSAGE_BYTES, TERMINATION_MESSAGE_ENV, TerminationLog, describe, fit


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for option in WORKER_OPTIONS.options.values():
        for name in option.env_names:
            monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(TERMINATION_MESSAGE_ENV, raising=False)


@pytest.fixture
def last_words(tmp_path, monkeypatch):
    path = tmp_path / "termination-log"
    monkeypatch.setenv(TERMINATION_MESSAGE_ENV, str(path))
    return path


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return tmp_path / "model"


def _fake_worker(monkeypatch, assemble):
    """`tidal.worker.process` without torch: main() imports assemble_worker from it only after the config is valid."""
    monkeypatch.setitem(sys.modules, "tidal.worker.process", SimpleNamespace(assemble_worker=assemble))


def _fake_runtime() -> SimpleNamespace:
    return SimpleNamespace(on_loaded=[])


def test_messages_fit_the_kubelets_limit_without_splitting_a_character():
    assert fit("short") == "short"
    cut = fit("é" * MAX_MESSAGE_BYTES)  # 2 bytes each: twice the limit
    assert len(cut.encode()) <= MAX_MESSAGE_BYTES and cut.endswith("…") and set(cut[:-1]) == {"é"}
    assert describe(FileNotFoundError("no weights in /x")) == "FileNotFoundError: no weights in /x"
    assert describe(KeyError()) == "KeyError"


def test_nothing_is_written_without_the_variable_and_an_unwritable_path_is_only_reported(tmp_path, capsys):
    TerminationLog.from_environ({}).write("boom")  # a worker started by hand: no file anywhere
    assert TerminationLog.from_environ({}).path is None
    TerminationLog(tmp_path / "missing" / "log").write("boom")
    assert "cannot write the termination message" in capsys.readouterr().err


def test_an_invalid_configuration_is_the_termination_message(last_words, capsys):
    assert cli.main(["--model", "/nonexistent/model"]) == 2
    written = last_words.read_text()
    assert written.startswith("invalid configuration:")
    assert "--model / TIDAL_MODEL: model directory '/nonexistent/model' does not exist" in written
    assert written in capsys.readouterr().err  # the log says the same


def test_a_model_that_fails_to_load_leaves_the_servers_reason(last_words, model_dir, monkeypatch):
    async def run() -> int:
        return 1

    failure = "loading the model failed: FileNotFoundError: weights directory /srv/x does not exist"
    servers = SimpleNamespace(bind=lambda: None, listeners=[], run=run, failure=failure, runtime=_fake_runtime())
    _fake_worker(monkeypatch, lambda config: SimpleNamespace(servers=servers))
    assert cli.main(["--model", str(model_dir)]) == 1
    assert last_words.read_text() == failure


def test_a_busy_port_and_an_unexpected_error_are_written_too(last_words, model_dir, monkeypatch):
    def busy() -> None:
        raise OSError("serving API cannot listen on 127.0.0.1:8000: Address already in use")

    servers = SimpleNamespace(bind=busy, listeners=[], runtime=_fake_runtime())
    _fake_worker(monkeypatch, lambda config: SimpleNamespace(servers=servers))
    assert cli.main(["--model", str(model_dir)]) == 1
    assert last_words.read_text() == "serving API cannot listen on 127.0.0.1:8000: Address already in use"

    def broken(config):
        raise RuntimeError("CUDA driver initialization failed")

    _fake_worker(monkeypatch, broken)
    with pytest.raises(RuntimeError):  # the traceback still reaches the log
        cli.main(["--model", str(model_dir)])
    assert last_words.read_text() == "RuntimeError: CUDA driver initialization failed"


def test_a_clean_stop_writes_nothing(last_words, model_dir, monkeypatch):
    async def run() -> int:
        return 0

    servers = SimpleNamespace(bind=lambda: None, listeners=[], run=run, failure=None, runtime=_fake_runtime())
    _fake_worker(monkeypatch, lambda config: SimpleNamespace(servers=servers))
    assert cli.main(["--model", str(model_dir)]) == 0
    assert not last_words.exists()
    assert servers.runtime.on_loaded == [cli.freeze_startup_objects]  # the entry point, and only it, freezes
