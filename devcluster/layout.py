"""Where each file of a cluster lives inside its state directory (one place for every path)."""

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class StateLayout:
    root: Path

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def etcd_data(self) -> Path:
        return self.root / "etcd"

    @property
    def pods(self) -> Path:
        """The node agent's per-pod directories (container logs, pidfiles, the pod's kubeconfig)."""
        return self.root / "pods"

    @property
    def kubeconfigs(self) -> Path:
        return self.root / "kubeconfigs"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def state_file(self) -> Path:
        """Ports, pids and timings of the running cluster, written by `up`, read by `status` and `down`."""
        return self.root / "cluster.json"

    @property
    def sa_private_key(self) -> Path:
        return self.pki / "sa.key"

    @property
    def sa_public_key(self) -> Path:
        return self.pki / "sa.pub"

    def component_kubeconfig(self, component: str) -> Path:
        return self.kubeconfigs / f"{component}.kubeconfig"

    def log(self, component: str) -> Path:
        return self.logs / f"{component}.log"

    def pidfile(self, component: str) -> Path:
        return self.run / f"{component}.pid"

    def cert(self, name: str) -> Path:
        return self.pki / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.pki / f"{name}.key"

    def make_dirs(self) -> None:
        for path in (self.root, self.pki, self.logs, self.run, self.etcd_data, self.pods, self.kubeconfigs):
            path.mkdir(parents=True, exist_ok=True)
        self.pki.chmod(0o700)
