"""Pure planning of the control plane: which processes, with which flags, and how to tell each is healthy.

Nothing here starts a process or touches the network, so the whole command line of every component can be
unit-tested (and read in one place).
"""

import sys
from dataclasses import dataclass, field
from pathlib import Path

from tidal.devcluster.config import ClusterConfig
from tidal.devcluster.layout import StateLayout
from tidal.devcluster.pki import ClientIdentity

SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"

# The controllers Tidal's tests lean on: garbage collection (ownerReferences), namespaces (test cleanup),
# service accounts and their tokens (pod identity), the workload controllers a Helm chart uses (the operator's
# Deployment), node lifecycle (a dead node agent taints its node and its pods are evicted, as on a real cluster),
# pod GC, EndpointSlices, the cluster-role aggregation behind the built-in admin/edit/view roles, and the
# HorizontalPodAutoscaler (an InferenceModel's scale subresource is driven by it; no metrics API is served here, so it
# can scale only on minReplicas/maxReplicas, but it reads and writes the scale as on a real cluster).
CONTROLLERS = (
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller",
    "clusterrole-aggregation-controller",
    "deployment-controller",
    "replicaset-controller",
    "statefulset-controller",
    "daemonset-controller",
    "job-controller",
    "cronjob-controller",
    "ttl-after-finished-controller",
    "disruption-controller",
    "endpointslice-controller",
    "node-lifecycle-controller",
    "taint-eviction-controller",
    "pod-garbage-collector-controller",
    "horizontal-pod-autoscaler-controller",
)

# The HPA controller processes each HPA once per sync period (15 s by default) and also waits that long after an
# HPA changes; tests wait on its passes, so the dev cluster runs them more often.
HPA_SYNC_SECONDS = 2

# Client certificate identities: the user is the certificate's CN, the groups its O fields.
ADMIN = ClientIdentity("admin", "tidal-admin", ("system:masters",))
CONTROLLER_MANAGER = ClientIdentity("controller-manager", "system:kube-controller-manager")
SCHEDULER = ClientIdentity("scheduler", "system:kube-scheduler")
# The apiserver's identity toward the node (for `kubectl logs`); the node agent serves logs only to this user.
KUBELET_CLIENT = ClientIdentity("apiserver-kubelet-client", "kube-apiserver-kubelet-client", ("system:masters",))


def node_identity(node_name: str) -> ClientIdentity:
    # The Node authorizer and NodeRestriction admission recognise exactly this user/group shape.
    return ClientIdentity("node", f"system:node:{node_name}", ("system:nodes",))


def client_identities(cfg: ClusterConfig) -> list[ClientIdentity]:
    return [ADMIN, CONTROLLER_MANAGER, SCHEDULER, KUBELET_CLIENT, node_identity(cfg.node_name)]


@dataclass(frozen=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int


@dataclass(frozen=True)
class HealthCheck:
    """An HTTPS (or HTTP) GET that answers 200 once the component is ready."""

    url: str
    client_cert: str | None = None  # file name stem in pki/ of a client identity to present


@dataclass(frozen=True)
class ProcessSpec:
    name: str
    argv: list[str]
    health: HealthCheck | None
    env: dict[str, str] = field(default_factory=dict)


def etcd(binary: Path, layout: StateLayout, ports: Ports) -> ProcessSpec:
    client = f"http://127.0.0.1:{ports.etcd_client}"
    peer = f"http://127.0.0.1:{ports.etcd_peer}"
    argv = [
        str(binary),
        "--name=devcluster",
        f"--data-dir={layout.etcd_data}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=devcluster={peer}",
        "--initial-cluster-state=new",
        # A throw-away test cluster: durability across power loss buys nothing and fsync costs seconds on CI disks.
        "--unsafe-no-fsync=true",
        "--log-level=warn",
    ]
    return ProcessSpec("etcd", argv, HealthCheck(f"{client}/health"))


def kube_apiserver(binary: Path, cfg: ClusterConfig, layout: StateLayout, ports: Ports) -> ProcessSpec:
    argv = [
        str(binary),
        f"--etcd-servers=http://127.0.0.1:{ports.etcd_client}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        f"--secure-port={ports.apiserver}",
        f"--tls-cert-file={layout.cert('apiserver')}",
        f"--tls-private-key-file={layout.key('apiserver')}",
        f"--client-ca-file={layout.cert('ca')}",
        f"--service-cluster-ip-range={cfg.service_cidr}",
        "--authorization-mode=Node,RBAC",
        "--enable-admission-plugins=NodeRestriction",
        # Bound ServiceAccount tokens (TokenRequest): the issuer names them, the private key signs, the public verifies.
        f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
        f"--service-account-signing-key-file={layout.sa_private_key}",
        f"--service-account-key-file={layout.sa_public_key}",
        f"--api-audiences={SERVICE_ACCOUNT_ISSUER}",
        # `kubectl logs`: the apiserver dials the node agent's log endpoint, verifying it against the cluster CA.
        f"--kubelet-client-certificate={layout.cert(KUBELET_CLIENT.file_name)}",
        f"--kubelet-client-key={layout.key(KUBELET_CLIENT.file_name)}",
        f"--kubelet-certificate-authority={layout.cert('ca')}",
        "--kubelet-preferred-address-types=InternalIP",
        "--allow-privileged=true",
        "--anonymous-auth=false",
        "--profiling=false",
        "--v=0",
    ]
    return ProcessSpec(
        "kube-apiserver", argv, HealthCheck(f"https://127.0.0.1:{ports.apiserver}/readyz", client_cert=ADMIN.file_name)
    )


def kube_controller_manager(binary: Path, cfg: ClusterConfig, layout: StateLayout, ports: Ports) -> ProcessSpec:
    kubeconfig = layout.component_kubeconfig(CONTROLLER_MANAGER.file_name)
    argv = [
        str(binary),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={ports.controller_manager}",
        "--leader-elect=false",
        f"--controllers={','.join(CONTROLLERS)}",
        # Each controller acts as its own ServiceAccount, so RBAC applies to controllers as it does in a real cluster.
        "--use-service-account-credentials=true",
        f"--horizontal-pod-autoscaler-sync-period={HPA_SYNC_SECONDS}s",
        f"--service-account-private-key-file={layout.sa_private_key}",
        f"--root-ca-file={layout.cert('ca')}",
        f"--service-cluster-ip-range={cfg.service_cidr}",
        "--v=0",
    ]
    return ProcessSpec(
        "kube-controller-manager", argv, HealthCheck(f"https://127.0.0.1:{ports.controller_manager}/healthz")
    )


def kube_scheduler(binary: Path, layout: StateLayout, ports: Ports) -> ProcessSpec:
    kubeconfig = layout.component_kubeconfig(SCHEDULER.file_name)
    argv = [
        str(binary),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={ports.scheduler}",
        "--leader-elect=false",
        "--v=0",
    ]
    return ProcessSpec("kube-scheduler", argv, HealthCheck(f"https://127.0.0.1:{ports.scheduler}/healthz"))


def node_agent(cfg: ClusterConfig, layout: StateLayout, pod_subnet: int) -> ProcessSpec:
    argv = [
        sys.executable,
        "-m",
        "tidal.devcluster.nodeagent.cli",
        "run",
        f"--kubeconfig={layout.component_kubeconfig('node')}",
        f"--node-name={cfg.node_name}",
        f"--state-dir={layout.pods}",
        f"--gpus={cfg.gpus}",
        f"--cpu={cfg.cpu}",
        f"--memory={cfg.memory}",
        f"--max-pods={cfg.max_pods}",
        f"--pod-subnet={pod_subnet}",
        f"--serving-cert={layout.cert('node-serving')}",
        f"--serving-key={layout.key('node-serving')}",
        f"--client-ca={layout.cert('ca')}",
    ]
    return ProcessSpec("node-agent", argv, None)


def control_plane(
    cfg: ClusterConfig, layout: StateLayout, ports: Ports, binaries: dict[str, Path]
) -> list[ProcessSpec]:
    """In start order; every process retries its upstream, so they may also start together."""
    return [
        etcd(binaries["etcd"], layout, ports),
        kube_apiserver(binaries["kube-apiserver"], cfg, layout, ports),
        kube_controller_manager(binaries["kube-controller-manager"], cfg, layout, ports),
        kube_scheduler(binaries["kube-scheduler"], layout, ports),
    ]
