"""The command line: flags over environment over defaults, and exit code 2 with reasons for bad values."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tidal.worker.cli import build_parser, load_config
from tidal.worker.config import WORKER_OPTIONS


@pytest.fixture
def model_dir(tmp_path):
    # Configuration checks only look for the folder and its config.json; nothing is loaded here.
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for option in WORKER_OPTIONS.options.values():
        for name in option.env_names:
            monkeypatch.delenv(name, raising=False)


def test_flags_set_every_field(model_dir):
    config = load_config(
        ["--model", str(model_dir), "--port", "9001", "--host", "127.0.0.1", "--max-num-seqs", "8",
         "--no-enable-prefix-caching", "--log-level", "DEBUG", "--served-model-name", "tiny"]
    )  # fmt: skip
    assert config.engine.model_path == model_dir
    assert (config.server.port, config.server.host, config.engine.max_num_seqs) == (9001, "127.0.0.1", 8)
    assert config.engine.enable_prefix_caching is False
    assert config.server.log_level == "debug"
    assert config.engine.model_name == "tiny"


def test_lifecycle_and_control_flags_reach_their_components(model_dir, tmp_path):
    config = load_config(
        ["--model", str(model_dir), "--asleep-retry-after-s", "7", "--rank", "2", "--world-size", "4",
         "--no-stable-device-memory", "--control-port", "9301", "--control-token-file", str(tmp_path / "token")]
    )  # fmt: skip
    assert (config.lifecycle.asleep_retry_after_s, config.engine.rank, config.engine.world_size) == (7, 2, 4)
    assert config.lifecycle.stable_device_memory is False
    assert (config.control.control_port, config.control.control_token_file) == (9301, tmp_path / "token")


def test_environment_sets_options_and_flags_win(model_dir, monkeypatch):
    monkeypatch.setenv("TIDAL_MODEL", str(model_dir))
    monkeypatch.setenv("TIDAL_PORT", "9100")
    monkeypatch.setenv("TIDAL_MAX_MODEL_LEN", "128")
    monkeypatch.setenv("TIDAL_STREAM_WRITE_TIMEOUT_S", "2.5")
    monkeypatch.setenv("TIDAL_ASLEEP_REQUESTS", "wake")
    monkeypatch.setenv("TIDAL_ENABLE_PREFIX_CACHING", "false")
    config = load_config(["--port", "9200"])
    assert config.engine.model_path == model_dir
    assert config.server.port == 9200  # the flag beats TIDAL_PORT
    assert config.engine.max_model_len == 128
    assert config.server.stream_write_timeout_s == 2.5
    assert config.lifecycle.asleep_requests == "wake"
    assert config.engine.enable_prefix_caching is False


def test_the_serving_limits_are_flags_and_variables_with_defaults(model_dir, monkeypatch):
    defaults = load_config(["--model", str(model_dir)]).server
    assert (defaults.max_request_body_bytes, defaults.max_prompt_tokens) == (8 * 1024 * 1024, None)
    assert (defaults.header_read_timeout_s, defaults.body_read_timeout_s) == (10.0, 30.0)
    assert (defaults.max_connections, defaults.max_concurrent_requests, defaults.overload_retry_after_s) == (
        2048,
        1024,
        1,
    )
    assert (defaults.tokenizer_threads, defaults.allow_request_chat_template) == (4, False)
    assert defaults.gil_switch_interval_us == 5000  # CPython's own
    monkeypatch.setenv("TIDAL_HEADER_READ_TIMEOUT_S", "2.5")
    monkeypatch.setenv("TIDAL_ALLOW_REQUEST_CHAT_TEMPLATE", "true")
    config = load_config(
        ["--model", str(model_dir), "--max-request-body-bytes", "65536", "--max-prompt-tokens", "100",
         "--body-read-timeout-s", "4", "--max-connections", "10", "--max-concurrent-requests", "5",
         "--overload-retry-after-s", "3", "--tokenizer-threads", "2", "--gil-switch-interval-us", "500"]
    )  # fmt: skip
    server = config.server
    assert (server.max_request_body_bytes, server.max_prompt_tokens) == (65536, 100)
    assert (server.header_read_timeout_s, server.body_read_timeout_s) == (2.5, 4.0)
    assert (server.max_connections, server.max_concurrent_requests, server.overload_retry_after_s) == (10, 5, 3)
    assert (server.tokenizer_threads, server.allow_request_chat_template) == (2, True)
    assert server.gil_switch_interval_us == 500


def test_long_env_name_of_the_model_works_too(model_dir, monkeypatch):
    monkeypatch.setenv("TIDAL_MODEL_PATH", str(model_dir))
    assert load_config([]).engine.model_path == model_dir


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], {}, "--model / TIDAL_MODEL: Field required"),
        (["--model", "/nonexistent/model"], {}, "model directory '/nonexistent/model' does not exist"),
        (["--port", "70000"], {}, "--port / TIDAL_PORT: Input should be less than or equal to 65535 (got '70000')"),
        ([], {"TIDAL_PORT": "eighty"}, "--port / TIDAL_PORT: Input should be a valid integer"),
        (["--block-size", "24"], {}, "block_size must be a power of two"),
        (["--log-level", "loud"], {}, "--log-level / TIDAL_LOG_LEVEL: Input should be"),
        ([], {"TIDAL_DEVICE": "tpu"}, "device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),
        ([], {"TIDAL_WORLD_SIZE": "0"}, "--world-size / TIDAL_WORLD_SIZE: Input should be greater than or equal to 1"),
        (["--asleep-requests", "sleep"], {}, "--asleep-requests / TIDAL_ASLEEP_REQUESTS: Input should be"),
        (["--tokenizer-threads", "0"], {}, "--tokenizer-threads / TIDAL_TOKENIZER_THREADS: Input should be greater"),
        ([], {"TIDAL_MAX_REQUEST_BODY_BYTES": "10"}, "--max-request-body-bytes / TIDAL_MAX_REQUEST_BODY_BYTES: Input"),
        (["--header-read-timeout-s", "0"], {}, "--header-read-timeout-s / TIDAL_HEADER_READ_TIMEOUT_S: Input should"),
    ],
)
def test_bad_values_exit_2_with_a_clear_message(model_dir, monkeypatch, capsys, argv, env, expected):
    if "--model" not in argv and expected != "--model / TIDAL_MODEL: Field required":
        argv = ["--model", str(model_dir), *argv]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exited:
        load_config(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "invalid configuration" in err
    assert expected in err


def test_help_names_the_environment_variables():
    text = build_parser().format_help()
    for flag, env in [("--model", "TIDAL_MODEL"), ("--port", "TIDAL_PORT"), ("--max-num-seqs", "TIDAL_MAX_NUM_SEQS")]:
        assert flag in text
        assert env in text


def test_module_entry_point_rejects_bad_config_with_exit_2(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "tidal.worker", "--model", str(tmp_path), "--port", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 2, result.stderr
    assert "has no config.json" in result.stderr
    assert "--port / TIDAL_PORT" in result.stderr
    assert "Traceback" not in result.stderr


def test_startup_objects_leave_the_collectors_view():
    """What loading left for collection goes first; what is alive is then frozen (the worker's entry point runs
    this once the model has loaded): a full collection walks only what serving makes."""
    import gc
    import weakref

    from tidal.worker.cli import freeze_startup_objects

    class Node:
        pass

    garbage = Node()
    garbage.itself = garbage  # a cycle: only the collector frees it
    garbage_ref = weakref.ref(garbage)
    del garbage
    alive = [[] for _ in range(1000)]  # lists are tracked; their count must move to the frozen generation
    assert all(gc.is_tracked(x) for x in alive)
    try:
        frozen_before = gc.get_freeze_count()
        freeze_startup_objects()
        assert garbage_ref() is None  # collected before the freeze, not frozen for good
        assert gc.get_freeze_count() >= frozen_before + len(alive)
    finally:
        gc.unfreeze()  # this test process runs more workers after this one
