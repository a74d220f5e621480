"""`tidal-node-agent run ...` (the kubelet stand-in) and `tidal-node-agent fault ...` (crash/freeze/thaw a pod)."""

import argparse
import logging
import signal
import sys
from pathlib import Path
from types import FrameType

from tidal.devcluster.nodeagent.config import AGENT_OPTIONS

PROG = "tidal-node-agent"


class _Stop(Exception):
    pass


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="register the node and run its pods' commands as local processes")
    AGENT_OPTIONS.add_arguments(run)
    fault = sub.add_parser("fault", help="signal a pod's processes now: crash (SIGKILL), freeze (SIGSTOP), thaw")
    fault.add_argument("action", choices=["crash", "freeze", "thaw"])
    fault.add_argument("pod", help="NAMESPACE/NAME")
    fault.add_argument("--container", default=None, help="only this container (default: all)")
    fault.add_argument("--pods-dir", type=Path, required=True, help="the agent's state dir (<cluster dir>/pods)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "fault":
        from tidal.devcluster.nodeagent.faults import inject_local

        namespace, _, name = args.pod.partition("/")
        if not name:
            print("pod must be given as NAMESPACE/NAME", file=sys.stderr)
            return 2
        try:
            pids = inject_local(args.pods_dir, namespace, name, args.action, args.container)
        except (LookupError, OSError) as exc:
            print(f"fault not injected: {exc}", file=sys.stderr)
            return 1
        print(f"{args.action}: signalled pids {pids}")
        return 0
    flat = {name: value for name, value in vars(args).items() if name != "command"}
    cfg = AGENT_OPTIONS.build_or_exit(flat, f"{PROG} run")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(threadName)s %(message)s")
    # One line per probe request would drown the agent's own log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from tidal.devcluster.nodeagent.agent import NodeAgent  # the kubernetes client import is slow; only here

    agent = NodeAgent(cfg)
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    try:
        agent.run()
    except _Stop:
        logging.info("stopping: terminating pod processes")
    finally:
        # Later signals must not interrupt the shutdown itself.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        agent.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
