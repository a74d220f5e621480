"""A rank's failure in an expert-parallel group run by the operator, on the local control plane, under load.

    source hack/env.sh && python benchmarks/ep_operator_recovery.py --fault crash [--ranks 3] [--out FILE.json]

Brings up the devcluster (real kube-apiserver, etcd, controller-manager, scheduler; the node agent runs pod commands
as processes), `helm install`s the chart, applies a tiny Qwen3-MoE InferenceModel with `expertParallel: --ranks`
and a redundant expert slot per rank, and keeps `--streams` streamed greedy completions going through the model's
Service (the official openai client over the Service's ready endpoints, retries on). Then it fails rank
`--fault-rank`: `delete` (kubectl delete pod), `crash` (SIGKILL of its process; the container restarts in its pod)
or `freeze` (SIGSTOP; only its peers' deadline finds it).

Prints, from the fault, each milestone and where it was read:
- operator observed: the moment the operator's pass that found the failure was asked for (a pod's event, or the
  group watch timer), and survivors' epoch sent: when that pass sent the survivors their epoch; both from the
  operator's log line for the survivors' epoch (unix times; same machine, same clock);
- survivors serving: every survivor reports serving in the survivors' epoch (their /state, polled every 20 ms);
- replacement running: the failed rank's pod runs again (a new pod, or its restarted container);
- group whole: every rank reports serving in one epoch with all ranks;
and what the clients saw: the survivors' longest gap between two tokens of one stream (target <= 2 s), requests
lost on survivors (target 0), streams cut on the failed rank, and requests the client's retries carried over.
"""

from __future__ import annotations

import argparse
import base64
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from tidal.devcluster.service_endpoints import BalancingTransport, ServiceEndpoints
from tidal.devcluster.service_load import ServiceLoad
from tidal.devcluster.testing import DevCluster, cluster_with_chart
from tidal.operator.api import constants as c
from tidal.operator.builders.names import serving_service_name

REPO = Path(__file__).resolve().parents[1]
NS = "default"
NAME = "moe"
PROMPT = "The tide comes in and"
OPERATOR_NS = "tidal-system"
SENT_LINE = re.compile(
    r"reconfigure replica 0: epoch (?P<epoch>\d+).*sent to the survivors (?P<latency>[\d.]+)s after the failure "
    r"was observed \(observed at (?P<observed>[\d.]+), sent at (?P<sent>[\d.]+) unix time\)"
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fault", choices=("delete", "crash", "freeze"), default="crash")
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--redundant", type=int, default=1)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--collective-timeout-s", type=int, default=2)
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    return parser.parse_args()


@dataclass
class Milestones:
    """Unix times seen by the poller after the fault (None: not yet)."""

    survivors_serving: float | None = None
    survivors_epoch: int | None = None
    replacement_running: float | None = None
    whole: float | None = None
    whole_epoch: int | None = None
    notes: list[str] = field(default_factory=list)


class GroupPoller(threading.Thread):
    """Reads every rank's /state and the failed rank's pod every 20 ms, recording the milestones after the fault."""

    def __init__(self, dc: DevCluster, token: str, ranks: int, victim: int, before_epoch: int, old_pod: Any) -> None:
        super().__init__(daemon=True)
        self.dc, self.ranks, self.victim, self.before_epoch = dc, ranks, victim, before_epoch
        self.old_uid, self.old_restarts = old_pod.metadata.uid, _restarts(old_pod)
        self.headers = {"Authorization": f"Bearer {token}"}
        self.done = threading.Event()
        self.m = Milestones()

    def _states(self, http: httpx.Client) -> dict[int, dict[str, Any]]:
        pods = {
            p.metadata.name: p
            for p in self.dc.core.list_namespaced_pod(NS, label_selector=f"{c.LABEL_MODEL}={NAME}").items
        }
        victim_pod = pods.get(f"{NAME}-r0-{self.victim}")
        if self.m.replacement_running is None and victim_pod is not None and victim_pod.status.phase == "Running":
            replaced = victim_pod.metadata.uid != self.old_uid and victim_pod.metadata.deletion_timestamp is None
            running = any(s.state.running for s in victim_pod.status.container_statuses or [])
            if running and (replaced or _restarts(victim_pod) > self.old_restarts):
                self.m.replacement_running = time.time()
        states = {}
        for rank in range(self.ranks):
            pod = pods.get(f"{NAME}-r0-{rank}")
            if pod is None or not pod.status.pod_ip or pod.metadata.deletion_timestamp is not None:
                continue
            try:
                resp = http.get(f"http://{pod.status.pod_ip}:8001/state", headers=self.headers, timeout=0.5)
                states[rank] = resp.json()
            except (httpx.HTTPError, ValueError):
                continue
        return states

    def run(self) -> None:
        survivors = [r for r in range(self.ranks) if r != self.victim]
        with httpx.Client() as http:
            while not self.done.is_set():
                states = self._states(http)
                serving = {
                    r: s["group_epoch"] for r, s in states.items()
                    if s["group"]["health"] == "serving" and s["group_epoch"] > self.before_epoch
                }  # fmt: skip
                now = time.time()
                if self.m.survivors_serving is None and all(r in serving for r in survivors):
                    epochs = {serving[r] for r in survivors}
                    members = {tuple(states[r]["group"]["members"]) for r in survivors}
                    if len(epochs) == 1 and members == {tuple(survivors)}:
                        self.m.survivors_serving, self.m.survivors_epoch = now, epochs.pop()
                full = list(range(self.ranks))
                one_epoch = len(serving) == self.ranks and len(set(serving.values())) == 1
                if self.m.whole is None and one_epoch and all(states[r]["group"]["members"] == full for r in serving):
                    self.m.whole, self.m.whole_epoch = now, next(iter(serving.values()))
                    if self.m.survivors_serving is None:
                        self.m.notes.append("the survivors' epoch was not seen serving by the 20 ms poller")
                    self.done.set()
                time.sleep(0.02)


def _restarts(pod: Any) -> int:
    return sum(s.restart_count for s in pod.status.container_statuses or [])


def _token(dc: DevCluster) -> str:
    secret = dc.core.read_namespaced_secret(f"{NAME}-control-token", NS)
    return base64.b64decode(secret.data["token"]).decode()


def _group(dc: DevCluster) -> dict[str, Any]:
    obj = dc.custom.get_namespaced_custom_object(c.GROUP, c.VERSION, NS, c.PLURAL, NAME)
    return ((obj.get("status") or {}).get("groups") or [{}])[0]


def _wait(check: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"{what}: not within {timeout_s} s")


def _complete(dc: DevCluster, rank: int, max_tokens: int) -> str:
    ip = dc.core.read_namespaced_pod(f"{NAME}-r0-{rank}", NS).status.pod_ip
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(f"http://{ip}:8000/v1/completions", json=body, timeout=60)
    resp.raise_for_status()
    return str(resp.json()["choices"][0]["text"])


def _operator_sent(dc: DevCluster, after: float) -> dict[str, float] | None:
    pods = dc.core.list_namespaced_pod(OPERATOR_NS, label_selector="app.kubernetes.io/name=tidal-operator").items
    for pod in pods:
        logs = dc.kubectl("logs", "-n", OPERATOR_NS, pod.metadata.name, check=False).stdout
        for match in SENT_LINE.finditer(logs):
            if float(match["observed"]) >= after - 1.0:  # the pass may have been asked for just before the fault
                return {k: float(match[k]) for k in ("epoch", "latency", "observed", "sent")}
    return None


def _fault(dc: DevCluster, kind: str, pod: str) -> None:
    if kind == "delete":
        dc.kubectl("delete", "pod", pod, "-n", NS, "--wait=false")
    else:
        dc.inject_fault(NS, pod, kind)


def run(dc: DevCluster, models: Path, args: argparse.Namespace) -> dict[str, Any]:
    manifest = yaml.safe_load((REPO / "examples" / "tiny-model.yaml").read_text())
    manifest["metadata"] = {"name": NAME, "namespace": NS}
    spec = manifest["spec"]
    spec["model"]["volume"]["hostPath"]["path"] = str(models)
    spec["model"]["path"] = "tiny-qwen3-moe"
    spec["worker"]["resources"] = {"cpu": "500m", "memory": "1Gi"}
    spec["expertParallel"] = args.ranks
    spec["experts"] = {
        "redundantExpertsPerRank": args.redundant, "collectiveTimeoutSeconds": args.collective_timeout_s,
    }  # fmt: skip
    dc.custom.create_namespaced_custom_object(c.GROUP, c.VERSION, NS, c.PLURAL, manifest)
    whole = lambda: (g := _group(dc)).get("state") == "Whole" and g.get("members") == list(range(args.ranks))  # noqa: E731
    _wait(whole, 600, "the group whole")
    reference = _complete(dc, 0, args.max_tokens)
    endpoints = ServiceEndpoints(dc.api_client, NS, serving_service_name(NAME))
    pods = {f"{NAME}-r0-{r}" for r in range(args.ranks)}
    endpoints.wait_for(pods, 60)
    victim = f"{NAME}-r0-{args.fault_rank}"
    load = ServiceLoad(
        BalancingTransport(endpoints), NAME, PROMPT, args.max_tokens, reference, streams=args.streams, stream=True
    ).start()
    load.wait_for_requests(2 * args.streams, 300)
    before = _group(dc)
    poller = GroupPoller(
        dc, _token(dc), args.ranks, args.fault_rank, before["epoch"], dc.core.read_namespaced_pod(victim, NS)
    )
    poller.start()
    time.sleep(0.5)
    fault_at = time.time()
    _fault(dc, args.fault, victim)
    print(f"{args.fault} {victim} at {time.strftime('%H:%M:%S')}; waiting for the group to be whole again")
    poller.done.wait(600)
    endpoints.wait_for(pods, 60)
    load.wait_for_requests(2 * args.streams, 300)
    report = load.stop(victims={victim})
    endpoints.stop()
    sent = _operator_sent(dc, fault_at)
    m = poller.m

    def since(t: float | None) -> float | None:
        return None if t is None else round(t - fault_at, 3)

    out = {
        "fault": args.fault,
        "ranks": args.ranks,
        "fault_rank": args.fault_rank,
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "collective_timeout_s": args.collective_timeout_s,
        "from_fault_s": {
            "operator_observed": since(sent["observed"]) if sent else None,
            "survivors_epoch_sent": since(sent["sent"]) if sent else None,
            "survivors_serving": since(m.survivors_serving),
            "replacement_running": since(m.replacement_running),
            "group_whole": since(m.whole),
        },
        "observed_to_sent_s": round(sent["latency"], 4) if sent else None,
        "survivors_epoch": m.survivors_epoch,
        "whole_epoch": m.whole_epoch,
        "clients": report.summary(),
        "last_recovery": _group(dc).get("lastRecovery"),
        "notes": m.notes,
    }
    return out


def main() -> int:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="tidal-ep-bench-") as tmp:
        root = Path(tmp)
        models = root / "models"
        subprocess.run(
            [sys.executable, "-m", "tidal.worker.testing.tiny_models", "--arch", "qwen3_moe", "--out",
             str(models / "tiny-qwen3-moe")], check=True, capture_output=True,
        )  # fmt: skip
        with cluster_with_chart(root / "cluster", REPO / "charts" / "tidal", cpu="64", memory="256Gi") as dc:
            out = run(dc, models, args)
    steps = out["from_fault_s"]
    print(f"\n{out['fault']} of rank {out['fault_rank']} of {out['ranks']}, {out['streams']} streams:")
    for name, value in steps.items():
        print(f"  fault -> {name.replace('_', ' '):<22} {value if value is not None else 'not seen'} s")
    print(f"  operator observed -> survivors' epoch sent: {out['observed_to_sent_s']} s (target <= 0.2)")
    clients = out["clients"]
    print(f"  survivors' longest token gap: {clients['longest_survivor_gap_s']} s (target <= 2)")
    lost, cut, retried = clients["survivor_losses"], clients["cut_on_victims"], clients["retried_ok"]
    print(f"  requests: {clients['requests']}, lost on survivors: {lost} (target 0), ", end="")
    print(f"cut on the failed rank: {cut}, retried onto survivors: {retried}")
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
