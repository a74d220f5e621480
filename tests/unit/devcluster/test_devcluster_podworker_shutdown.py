"""The node agent's shutdown against a pod worker that is starting a container at that very moment: the process must
not outlive the agent (`tidal-devcluster down` would leave it running, holding its port and CPU)."""

import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from tidal.devcluster.nodeagent import podworker
from tidal.devcluster.nodeagent.allocators import AddressPool, GpuPool
from tidal.devcluster.nodeagent.config import AgentConfig
from tidal.devcluster.nodeagent.podworker import NodeContext, PodWorker

POD = {
    "metadata": {"name": "sleeper", "namespace": "ns", "uid": "uid-1"},
    "spec": {
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "main", "command": ["sleep", "300"]}],
    },
    "status": {},
}


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def test_a_container_starting_during_shutdown_does_not_outlive_it(tmp_path, monkeypatch):
    cfg = AgentConfig(kubeconfig=tmp_path / "kubeconfig", state_dir=tmp_path / "state")
    # The pod references no Secret or ConfigMap, and its events go nowhere.
    api = SimpleNamespace(secret_data=None, config_map_data=None, record_event=lambda *args: None)
    ctx = NodeContext(api=api, cfg=cfg, addresses=AddressPool(7), gpus=GpuPool(0), ca_pem=b"", allocatable={})
    worker = PodWorker(ctx, POD)
    worker._setup()
    worker._pod_ip = "127.0.7.1"
    planning, release = threading.Event(), threading.Event()
    real_plan = podworker.plan_launch

    def slow_plan(*args, **kwargs):
        # Resolving the environment reads Secrets from the API: the shutdown arrives meanwhile.
        planning.set()
        release.wait(5)
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(podworker, "plan_launch", slow_plan)
    slot = worker._slots[0]
    starter = threading.Thread(target=worker._start, args=(slot, POD, time.monotonic()))
    starter.start()
    assert planning.wait(5)
    stopper = threading.Thread(target=worker.stop_for_shutdown, args=(1.0,))
    stopper.start()
    time.sleep(0.2)
    release.set()
    starter.join(5)
    stopper.join(5)
    pid = slot.process.pid if slot.process is not None else None
    try:
        if pid is not None:
            deadline = time.monotonic() + 3
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not _alive(pid), "the container started during shutdown is still running"
    finally:
        if pid is not None and _alive(pid):
            os.killpg(pid, 9)
