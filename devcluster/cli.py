"""`tidal-devcluster up|down|status`: a local Kubernetes control plane with a node agent, in the background."""

import argparse
import json
import sys
from pathlib import Path

from tidal.devcluster import cluster
from tidal.devcluster.config import CLUSTER_OPTIONS, default_state_dir

PROG = "tidal-devcluster"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a fresh cluster and return once its node is Ready")
    CLUSTER_OPTIONS.add_arguments(up)
    down = sub.add_parser("down", help="stop the cluster's processes (files stay for post-mortems)")
    status = sub.add_parser("status", help="show which components run and where")
    for p in (down, status):
        p.add_argument("--dir", type=Path, default=None, help=f"state directory (default {default_state_dir()})")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = vars(_parser().parse_args(argv))
    command = args.pop("command")
    if command == "up":
        cfg = CLUSTER_OPTIONS.build_or_exit(args, f"{PROG} up")
        try:
            info = cluster.up(cfg)
        except (RuntimeError, TimeoutError) as exc:
            print(f"tidal-devcluster up failed: {exc}", file=sys.stderr)
            return 1
        print(f"export KUBECONFIG={info.kubeconfig}")
        return 0
    state_dir = args["dir"] or default_state_dir()
    if command == "down":
        stopped = cluster.down(state_dir)
        print(f"stopped: {', '.join(stopped)}" if stopped else f"nothing was running in {state_dir}")
        return 0
    print(json.dumps(cluster.status(state_dir), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
