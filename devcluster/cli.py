"""`tidal-devcluster up|down|status`: a local Kubernetes control plane with a node agent, in the background."""

import argparse
import json
import sys
from pathlib import Path

from pydantic import ValidationError

from tidal.devcluster import cluster
from tidal.devcluster.config import ClusterConfig, default_state_dir


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidal-devcluster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a fresh cluster and return once its node is Ready")
    down = sub.add_parser("down", help="stop the cluster's processes (files stay for post-mortems)")
    status = sub.add_parser("status", help="show which components run and where")
    for p in (up, down, status):
        p.add_argument("--dir", type=Path, default=None, help=f"state directory (default {default_state_dir()})")
    up.add_argument("--gpus", type=int, default=0, help="nvidia.com/gpu capacity of the node (default 0)")
    up.add_argument("--node-name", default="devnode")
    up.add_argument("--cpu", default="8", help="the node's cpu capacity (default 8)")
    up.add_argument("--memory", default="32Gi", help="the node's memory capacity (default 32Gi)")
    up.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for readiness (default 90)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    state_dir = args.dir or default_state_dir()
    if args.command == "up":
        try:
            cfg = ClusterConfig(
                state_dir=state_dir,
                gpus=args.gpus,
                node_name=args.node_name,
                cpu=args.cpu,
                memory=args.memory,
                startup_timeout_s=args.timeout,
            )
        except ValidationError as exc:
            print(f"invalid settings: {exc}", file=sys.stderr)
            return 2
        try:
            info = cluster.up(cfg)
        except (RuntimeError, TimeoutError) as exc:
            print(f"tidal-devcluster up failed: {exc}", file=sys.stderr)
            return 1
        print(f"export KUBECONFIG={info.kubeconfig}")
        return 0
    if args.command == "down":
        stopped = cluster.down(state_dir)
        print(f"stopped: {', '.join(stopped)}" if stopped else f"nothing was running in {state_dir}")
        return 0
    print(json.dumps(cluster.status(state_dir), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
