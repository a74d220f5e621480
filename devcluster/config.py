"""The one typed configuration of a local control plane, validated where it enters (CLI flags, fixtures)."""

import ipaddress
import os
import shutil
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tidal.worker.config_flags import FlatOptions

# Each name is a symlink to hack/kube's multi-call binary, except helm (which the control plane does not need).
CONTROL_PLANE_BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
BUILD_HINT = "build them with `bash hack/build-binaries.sh` (then `source hack/env.sh` so $TIDAL_BIN points at them)"


def default_state_dir() -> Path:
    override = os.environ.get("TIDAL_DEVCLUSTER_DIR")
    if override:
        return Path(override)
    cache = Path(os.environ.get("TIDAL_CACHE", Path.home() / ".cache" / "tidal"))
    return cache / "devcluster"


class ClusterConfig(BaseModel):
    """Everything `up` needs; the defaults make a one-node cluster for tests and demos."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    state_dir: Path = Field(
        default_factory=default_state_dir, description="State directory: certs, kubeconfigs, logs, pidfiles, etcd data."
    )
    bin_dir: Path | None = Field(
        default=None, description="Where the control-plane binaries are; None: $TIDAL_BIN, then PATH."
    )
    node_name: str = Field(
        default="devnode", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63, description="The node's name."
    )
    gpus: int = Field(default=0, ge=0, le=64, description="The node's nvidia.com/gpu capacity.")
    cpu: str = Field(default="8", description="The node's cpu capacity (a Kubernetes quantity).")
    memory: str = Field(default="32Gi", description="The node's memory capacity (a Kubernetes quantity).")
    max_pods: int = Field(default=110, ge=1, le=250, description="Most pods on the node.")
    service_cidr: str = Field(default="10.96.0.0/16", description="IPv4 range of Service cluster IPs.")
    startup_timeout_s: float = Field(default=90.0, gt=0, description="Seconds to wait for the cluster to be ready.")
    die_with_parent: bool = Field(default=False, description="Stop the cluster when the process that started it dies.")

    @field_validator("service_cidr")
    @classmethod
    def _service_cidr_is_ipv4_net(cls, value: str) -> str:
        net = ipaddress.ip_network(value, strict=True)
        if net.version != 4 or net.num_addresses < 16:
            raise ValueError(f"service_cidr must be an IPv4 network with at least 16 addresses, got {value!r}")
        return value

    @property
    def first_service_ip(self) -> str:
        """The address of the `kubernetes` Service, which the apiserver's serving certificate must name."""
        return str(ipaddress.ip_network(self.service_cidr)[1])

    def resolve_bin_dir(self) -> Path | None:
        if self.bin_dir is not None:
            return self.bin_dir
        env_dir = os.environ.get("TIDAL_BIN")
        return Path(env_dir) if env_dir else None


# `tidal-devcluster up`'s flags; --dir and --timeout are the short spellings the docs and scripts use. No
# --die-with-parent: the parent would be `up` itself, which returns once the cluster is ready.
CLUSTER_OPTIONS: FlatOptions[ClusterConfig] = FlatOptions(
    ClusterConfig, aliases={"state_dir": ("dir",), "startup_timeout_s": ("timeout",)}, exclude={"die_with_parent"}
)


def find_binary(name: str, bin_dir: Path | None) -> Path | None:
    if bin_dir is not None:
        candidate = bin_dir / name
        return candidate if candidate.exists() and os.access(candidate, os.X_OK) else None
    found = shutil.which(name)
    return Path(found) if found else None


def resolve_binaries(cfg: ClusterConfig, names: tuple[str, ...] = CONTROL_PLANE_BINARIES) -> dict[str, Path]:
    """Absolute paths of the binaries, or a RuntimeError naming the missing ones and how to build them."""
    bin_dir = cfg.resolve_bin_dir()
    found = {name: find_binary(name, bin_dir) for name in names}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        where = f"in {bin_dir}" if bin_dir else "on PATH ($TIDAL_BIN is not set)"
        raise RuntimeError(f"control-plane binaries missing {where}: {', '.join(missing)}; {BUILD_HINT}")
    return {name: path for name, path in found.items() if path is not None}
