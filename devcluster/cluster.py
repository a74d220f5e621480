"""Bringing a local cluster up and down: the I/O around plan.py (files, processes, readiness waits)."""

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from tidal.devcluster import health, processes
from tidal.devcluster.apiclient import AdminHttp
from tidal.devcluster.config import ClusterConfig, resolve_binaries
from tidal.devcluster.kubeconfig import cert_kubeconfig, write_kubeconfig
from tidal.devcluster.layout import StateLayout
from tidal.devcluster.pki import ClusterPki, make_cluster_pki
from tidal.devcluster.plan import KUBELET_CLIENT, Ports, ProcessSpec, client_identities, control_plane, node_agent
from tidal.devcluster.ports import allocate_ports, choose_pod_subnet

# Stopped in this order: the node agent first (it stops the pods' processes), etcd last.
STOP_ORDER = ("node-agent", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd")


class ClusterInfo(BaseModel):
    """What `up` leaves in cluster.json for `status`, `down` and tests."""

    state_dir: Path
    server: str
    kubeconfig: Path
    node_name: str
    gpus: int
    pod_subnet: int
    ports: dict[str, int]
    startup_s: float

    @property
    def pods_dir(self) -> Path:
        return StateLayout(self.state_dir).pods


def marker(layout: StateLayout) -> str:
    # Every component's command line names a path inside the state dir; the trailing slash keeps /tmp/a from
    # matching /tmp/ab.
    return f"{layout.root}/"


def _write_pki(layout: StateLayout, pki: ClusterPki) -> None:
    files = {
        layout.cert("ca"): pki.ca.cert,
        layout.key("ca"): pki.ca.key,
        layout.cert("apiserver"): pki.apiserver.cert,
        layout.key("apiserver"): pki.apiserver.key,
        layout.cert("node-serving"): pki.node_serving.cert,
        layout.key("node-serving"): pki.node_serving.key,
        layout.sa_private_key: pki.service_account_private,
        layout.sa_public_key: pki.service_account_public,
    }
    for name, pem in pki.clients.items():
        files[layout.cert(name)] = pem.cert
        files[layout.key(name)] = pem.key
    for path, data in files.items():
        path.write_bytes(data)
        path.chmod(0o600)


def _write_kubeconfigs(layout: StateLayout, pki: ClusterPki, server: str) -> None:
    for name, pem in pki.clients.items():
        if name == KUBELET_CLIENT.file_name:
            continue  # a certificate the apiserver presents to the node, not a client of the apiserver
        document = cert_kubeconfig(server, pki.ca.cert, pem.cert, pem.key)
        target = layout.admin_kubeconfig if name == "admin" else layout.component_kubeconfig(name)
        write_kubeconfig(target, document)


def running_components(layout: StateLayout) -> dict[str, int]:
    found = {}
    for name in STOP_ORDER:
        pid = processes.alive(layout.pidfile(name), marker(layout))
        if pid is not None:
            found[name] = pid
    return found


def _fresh_state(layout: StateLayout) -> None:
    """Each `up` makes a new cluster: old etcd data, pods, certs and logs would only mislead."""
    for path in (layout.etcd_data, layout.pods, layout.pki, layout.kubeconfigs, layout.run, layout.logs):
        shutil.rmtree(path, ignore_errors=True)
    for path in (layout.admin_kubeconfig, layout.state_file):
        path.unlink(missing_ok=True)
    layout.make_dirs()


def up(cfg: ClusterConfig, say: Callable[[str], None] = print) -> ClusterInfo:
    """Start etcd, the apiserver, controller-manager, scheduler and node agent; return once the node is Ready."""
    started_at = time.monotonic()
    layout = StateLayout(cfg.state_dir.resolve())
    binaries = resolve_binaries(cfg)
    if layout.root.exists() and (running := running_components(layout)):
        raise RuntimeError(
            f"a cluster is already running in {layout.root} ({', '.join(running)}); "
            f"run `tidal-devcluster down --dir {layout.root}` first"
        )
    _fresh_state(layout)
    ports = allocate_ports()
    server = f"https://127.0.0.1:{ports.apiserver}"
    pki = make_cluster_pki(cfg.first_service_ip, client_identities(cfg))
    _write_pki(layout, pki)
    _write_kubeconfigs(layout, pki, server)
    pod_subnet = choose_pod_subnet()
    specs = control_plane(cfg, layout, ports, binaries)
    deadline = started_at + cfg.startup_timeout_s
    try:
        etcd, apiserver, controller_manager, scheduler = specs
        # etcd and the apiserver together (the apiserver retries etcd); the others only once the apiserver is ready,
        # because they exit if RBAC's bootstrap roles are not there yet when they read their authentication config.
        for spec in (etcd, apiserver):
            processes.start(spec, layout.log(spec.name), layout.pidfile(spec.name), layout.root, cfg.die_with_parent)
        _wait(apiserver, layout, deadline)
        agent = node_agent(cfg, layout, pod_subnet)
        for spec in (controller_manager, scheduler, agent):
            processes.start(spec, layout.log(spec.name), layout.pidfile(spec.name), layout.root, cfg.die_with_parent)
        for spec in (etcd, controller_manager, scheduler):
            _wait(spec, layout, deadline)
        api = AdminHttp(server, layout)
        api.wait_node_ready(
            cfg.node_name, deadline, is_running=lambda: _is_running(layout, "node-agent"), log=layout.log("node-agent")
        )
        # Pods cannot be created in a namespace before its `default` ServiceAccount exists.
        api.wait_service_account("default", "default", deadline)
    except BaseException:
        stop_all(layout)
        raise
    info = ClusterInfo(
        state_dir=layout.root,
        server=server,
        kubeconfig=layout.admin_kubeconfig,
        node_name=cfg.node_name,
        gpus=cfg.gpus,
        pod_subnet=pod_subnet,
        ports=_ports_dict(ports),
        startup_s=round(time.monotonic() - started_at, 2),
    )
    layout.state_file.write_text(info.model_dump_json(indent=2) + "\n")
    gpus = f"{cfg.gpus} GPUs"
    say(f"devcluster up in {info.startup_s:.1f} s: {server} (node {cfg.node_name}, {gpus}, state {layout.root})")
    return info


def _ports_dict(ports: Ports) -> dict[str, int]:
    return {name: getattr(ports, name) for name in ports.__dataclass_fields__}


def _is_running(layout: StateLayout, name: str) -> bool:
    return processes.alive(layout.pidfile(name), marker(layout)) is not None


def _wait(spec: ProcessSpec, layout: StateLayout, deadline: float) -> None:
    if spec.health is None:
        return
    health.wait_healthy(
        spec.name, spec.health, layout, deadline, lambda: _is_running(layout, spec.name), layout.log(spec.name)
    )


def stop_all(layout: StateLayout) -> list[str]:
    stopped = []
    for name in STOP_ORDER:
        # The node agent needs time to stop pods gracefully; the rest stop in well under a second.
        grace = 30.0 if name == "node-agent" else 10.0
        if processes.stop(layout.pidfile(name), marker(layout), grace_s=grace):
            stopped.append(name)
    return stopped


def down(state_dir: Path) -> list[str]:
    """Stop every component of the cluster in state_dir (the files stay for post-mortems)."""
    layout = StateLayout(state_dir.resolve())
    return stop_all(layout)


def load_info(state_dir: Path) -> ClusterInfo | None:
    layout = StateLayout(state_dir.resolve())
    try:
        return ClusterInfo.model_validate(json.loads(layout.state_file.read_text()))
    except FileNotFoundError:
        return None


def status(state_dir: Path) -> dict[str, object]:
    layout = StateLayout(state_dir.resolve())
    info = load_info(state_dir)
    running = running_components(layout)
    result: dict[str, object] = {
        "state_dir": str(layout.root),
        "components": {
            name: (f"running (pid {running[name]})" if name in running else "stopped") for name in STOP_ORDER
        },
    }
    if info is not None:
        result.update(server=info.server, kubeconfig=str(info.kubeconfig), startup_s=info.startup_s)
        if "kube-apiserver" in running:
            ok, seen = AdminHttp(info.server, layout).readyz()
            result["apiserver_ready"] = ok if ok else seen
    return result
