"""The node agent's one typed configuration (validated from its CLI flags)."""

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


class AgentConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kubeconfig: Path = Field(description="the node's credentials (user system:node:<name>, group system:nodes)")
    node_name: str = Field(default="devnode", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    state_dir: Path = Field(description="per-pod directories: container logs, pidfiles, the pod's kubeconfig")
    gpus: int = Field(default=0, ge=0, le=64)
    cpu: str = "8"
    memory: str = "32Gi"
    max_pods: int = Field(default=110, ge=1, le=250)
    pod_subnet: int = Field(default=1, ge=1, le=254, description="pods get addresses 127.0.<pod_subnet>.<n>")
    serving_cert: Path | None = Field(default=None, description="TLS cert of the log endpoint (`kubectl logs`)")
    serving_key: Path | None = None
    client_ca: Path | None = Field(default=None, description="CA that signed the apiserver's kubelet-client cert")
    lease_period_s: float = Field(default=10.0, gt=0)
    status_period_s: float = Field(default=60.0, gt=0)
    # Shorter than the kubelet's 10 s .. 5 min so crash-loop tests finish in seconds; the doubling is the same.
    backoff_initial_s: float = Field(default=1.0, ge=0)
    backoff_max_s: float = Field(default=30.0, gt=0)
    backoff_reset_s: float = Field(default=60.0, gt=0, description="a run this long ends a crash streak")
    # 3607 s is the kubelet's own request: the apiserver treats it as "kubelet-managed" and may extend it.
    token_seconds: int = Field(default=3607, ge=600)
    watch_timeout_s: int = Field(default=300, ge=10)
