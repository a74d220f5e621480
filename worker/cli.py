"""`tidal-worker` / `python -m tidal.worker`: parse flags over the environment, validate, then serve.

The flags are generated from `WorkerConfig`'s fields, so a new config field is a new flag and a new environment
variable with no edit here. A bad value, from a flag or from the environment, ends the process with exit code 2 and
one line per problem naming both ways to set it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import types
import typing
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from tidal.worker.config import WorkerConfig, env_name
from tidal.worker.metrics import WorkerMetrics

if TYPE_CHECKING:
    from tidal.worker.server.app import WorkerServers

EXIT_BAD_CONFIG = 2

# Flags that are spelt differently from their field.
_FLAG_NAMES = {"model_path": ["--model", "--model-path"]}

log = logging.getLogger("tidal.worker")


def _flags(field_name: str) -> list[str]:
    return _FLAG_NAMES.get(field_name, [f"--{field_name.replace('_', '-')}"])


def _is_bool(annotation: object) -> bool:
    if annotation is bool:
        return True
    is_union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return is_union and bool in typing.get_args(annotation)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tidal-worker",
        description="Serve one model with Tidal's engine over an OpenAI-compatible HTTP API. "
        "Every flag can also be set by the environment variable named in its help.",
    )
    for name, field in WorkerConfig.model_fields.items():
        default = "required" if field.is_required() else f"default: {field.default}"
        help_text = f"{field.description or ''} [env {env_name(name)}; {default}]"
        # SUPPRESS: a flag not given stays out of the namespace, so the environment (or the default) applies.
        if _is_bool(field.annotation):
            parser.add_argument(
                *_flags(name), dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                help=help_text,
            )  # fmt: skip
        else:
            parser.add_argument(*_flags(name), dest=name, default=argparse.SUPPRESS, metavar="VALUE", help=help_text)
    return parser


def describe_config_errors(exc: ValidationError) -> list[str]:
    lines = []
    for err in exc.errors():
        loc = err.get("loc", ())
        field_name = "model_path" if loc and loc[0] == "TIDAL_MODEL" else (str(loc[0]) if loc else "")
        message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if field_name in WorkerConfig.model_fields:
            where = f"{_flags(field_name)[0]} / {env_name(field_name)}"
            given = err.get("input")
            shown = f" (got {given!r})" if err.get("type") != "missing" and not isinstance(given, dict) else ""
            lines.append(f"{where}: {message}{shown}")
        else:
            lines.append(message)
    return lines


def load_config(argv: Sequence[str] | None = None) -> WorkerConfig:
    """Flags over environment over defaults; exits with code 2 and readable reasons when invalid."""
    args: dict[str, Any] = vars(build_parser().parse_args(argv))
    try:
        return WorkerConfig(**args)
    except ValidationError as exc:
        print("tidal-worker: invalid configuration:", file=sys.stderr)
        for line in describe_config_errors(exc):
            print(f"  {line}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_CONFIG) from None


def build_servers(config: WorkerConfig) -> WorkerServers:
    """Everything the process serves, around one engine. Another API (e.g. the control API) is one more
    `Listener`, on its own port, built from the same runtime."""
    # Imported here so that `--help` and configuration errors answer without loading torch.
    from tidal.worker.control.wiring import build_control
    from tidal.worker.server.app import Listener, WorkerServers, build_api_app
    from tidal.worker.server.runtime import WorkerRuntime

    engine_config = config.engine_config()
    registry = CollectorRegistry()
    lifecycle, control_listener = build_control(config, registry)
    runtime = WorkerRuntime(lambda: lifecycle.load_engine(engine_config))
    metrics = WorkerMetrics(registry, runtime.stats)
    api = Listener("serving", build_api_app(runtime, metrics, config.stream_write_timeout_s), config.host, config.port)
    listeners = [api] if control_listener is None else [api, control_listener]
    return WorkerServers(runtime, listeners, log_level=config.log_level)


def main(argv: Sequence[str] | None = None) -> int:
    config = load_config(argv)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        servers = build_servers(config)
    except ValueError as exc:  # a setting only checkable when assembling (e.g. the control token)
        print(f"tidal-worker: invalid configuration:\n  {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    try:
        servers.bind()
    except OSError as exc:
        log.error("%s", exc)
        return 1
    for listener in servers.listeners:
        log.info("%s API on http://%s:%d", listener.name, listener.host, listener.bound_port)
    log.info("loading %s", config.model_path)
    return asyncio.run(servers.run())
