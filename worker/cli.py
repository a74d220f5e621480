"""`tidal-worker` / `python -m tidal.worker`: parse flags over the environment, validate, then serve.

The flags come from `WorkerConfig`'s nested fields (`WORKER_OPTIONS`), so a new config field is a new flag and a
new environment variable with no edit here. A bad value, from a flag or from the environment, ends the process with
exit code 2 and one line per problem naming both ways to set it. Whatever ends the process with an error (a bad
configuration, a busy port, a model that fails to load, an unexpected exception) is also its termination message
(`termination.py`), so Kubernetes shows it in the container's status.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from tidal.worker.config import WORKER_OPTIONS, WorkerConfig
from tidal.worker.config_flags import EXIT_BAD_CONFIG
from tidal.worker.termination import TerminationLog, describe

PROG = "tidal-worker"

log = logging.getLogger("tidal.worker")


class WorkerFailed(Exception):
    """The process must end with `exit_code`; the message says why, to a person (stderr, termination message)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Serve one model with Tidal's engine over an OpenAI-compatible HTTP API. "
        "Every flag can also be set by the environment variable named in its help.",
    )
    WORKER_OPTIONS.add_arguments(parser)
    return parser


def _invalid(problems: list[str]) -> WorkerFailed:
    return WorkerFailed("invalid configuration:\n" + "\n".join(f"  {line}" for line in problems), EXIT_BAD_CONFIG)


def parse_config(argv: Sequence[str] | None = None) -> WorkerConfig:
    """Flags over environment over defaults; WorkerFailed (exit code 2) with one line per problem when invalid."""
    try:
        return WORKER_OPTIONS.build(vars(build_parser().parse_args(argv)))
    except ValidationError as exc:
        raise _invalid(WORKER_OPTIONS.describe(exc)) from None


def load_config(argv: Sequence[str] | None = None) -> WorkerConfig:
    """`parse_config`, exiting with code 2 and the reasons on stderr when invalid."""
    try:
        return parse_config(argv)
    except WorkerFailed as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None


def main(argv: Sequence[str] | None = None) -> int:
    last_words = TerminationLog.from_environ(os.environ)
    try:
        return serve(argv)
    except WorkerFailed as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        last_words.write(str(exc))
        return exc.exit_code
    except Exception as exc:
        # A bug or a broken install: the traceback goes to the log as usual, its gist to the container's status.
        last_words.write(describe(exc))
        raise


def freeze_startup_objects() -> None:
    """Move everything loading made (modules, the tokenizer, the engine's bookkeeping: some 10^5-10^6 objects) out
    of the garbage collector's view. A full collection walks every tracked object, and nothing steps meanwhile: on
    a 2-core machine one took 235 ms beside a tiny model's engine, a stall every stream sees. What loading left for
    collection goes first. Process-wide, so only the worker's entry point calls it (tests run workers in-process,
    where frozen objects of one worker would outlive it)."""
    gc.collect()
    gc.freeze()


def serve(argv: Sequence[str] | None = None) -> int:
    """Configure, bind, load and serve until stopped; WorkerFailed for each way this ends in an error we can name."""
    config = parse_config(argv)
    logging.basicConfig(
        level=config.server.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # Process-wide, so set here at the entry point rather than by a component (tests assemble workers in-process).
    sys.setswitchinterval(config.server.gil_switch_interval_us / 1e6)
    # Imported here so that `--help` and configuration errors answer without loading torch.
    from tidal.worker.model_source import with_model_directory
    from tidal.worker.process import assemble_worker

    given = config.engine.model_path
    config = with_model_directory(config)
    if config.engine.model_path != given:
        log.info("serving %s as its dequantized copy %s", given, config.engine.model_path)
    try:
        servers = assemble_worker(config).servers
    except ValueError as exc:  # a setting only checkable when assembling (e.g. the control token)
        raise _invalid([str(exc)]) from None
    servers.runtime.on_loaded.append(freeze_startup_objects)
    try:
        servers.bind()
    except OSError as exc:
        raise WorkerFailed(str(exc), 1) from None
    for listener in servers.listeners:
        log.info("%s API on http://%s:%d", listener.name, listener.host, listener.bound_port)
    log.info("loading %s", config.engine.model_path)
    exit_code = asyncio.run(servers.run())
    if exit_code != 0 and servers.failure is not None:
        raise WorkerFailed(servers.failure, exit_code)
    return exit_code
