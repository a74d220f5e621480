"""`tidal-worker` / `python -m tidal.worker`: parse flags over the environment, validate, then serve.

The flags come from `WorkerConfig`'s nested fields (`WORKER_OPTIONS`), so a new config field is a new flag and a
new environment variable with no edit here. A bad value, from a flag or from the environment, ends the process with
exit code 2 and one line per problem naming both ways to set it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from tidal.worker.config import WORKER_OPTIONS, WorkerConfig
from tidal.worker.config_flags import EXIT_BAD_CONFIG

PROG = "tidal-worker"

log = logging.getLogger("tidal.worker")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Serve one model with Tidal's engine over an OpenAI-compatible HTTP API. "
        "Every flag can also be set by the environment variable named in its help.",
    )
    WORKER_OPTIONS.add_arguments(parser)
    return parser


def load_config(argv: Sequence[str] | None = None) -> WorkerConfig:
    """Flags over environment over defaults; exits with code 2 and readable reasons when invalid."""
    return WORKER_OPTIONS.build_or_exit(vars(build_parser().parse_args(argv)), PROG)


def main(argv: Sequence[str] | None = None) -> int:
    config = load_config(argv)
    logging.basicConfig(
        level=config.server.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # Imported here so that `--help` and configuration errors answer without loading torch.
    from tidal.worker.process import assemble_worker

    try:
        servers = assemble_worker(config).servers
    except ValueError as exc:  # a setting only checkable when assembling (e.g. the control token)
        print(f"{PROG}: invalid configuration:\n  {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    try:
        servers.bind()
    except OSError as exc:
        log.error("%s", exc)
        return 1
    for listener in servers.listeners:
        log.info("%s API on http://%s:%d", listener.name, listener.host, listener.bound_port)
    log.info("loading %s", config.engine.model_path)
    return asyncio.run(servers.run())
