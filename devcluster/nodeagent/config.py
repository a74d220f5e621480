"""The node agent's one typed configuration, and the `run` command's flags generated from it."""

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from tidal.worker.config_flags import FlatOptions


class AgentConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kubeconfig: Path = Field(description="The node's credentials (user system:node:<name>, group system:nodes).")
    node_name: str = Field(
        default="devnode", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63, description="The node's name."
    )
    state_dir: Path = Field(description="Per-pod directories: container logs, pidfiles, the pod's kubeconfig.")
    gpus: int = Field(default=0, ge=0, le=64, description="The node's nvidia.com/gpu capacity.")
    cpu: str = Field(default="8", description="The node's cpu capacity (a Kubernetes quantity).")
    memory: str = Field(default="32Gi", description="The node's memory capacity (a Kubernetes quantity).")
    max_pods: int = Field(default=110, ge=1, le=250, description="Most pods on the node.")
    pod_subnet: int = Field(default=1, ge=1, le=254, description="Pods get addresses 127.0.<pod_subnet>.<n>.")
    serving_cert: Path | None = Field(
        default=None, description="TLS cert of the log endpoint (`kubectl logs`); with --serving-key and --client-ca."
    )
    serving_key: Path | None = Field(default=None, description="Key of --serving-cert.")
    client_ca: Path | None = Field(default=None, description="CA that signed the apiserver's kubelet-client cert.")
    lease_period_s: float = Field(default=10.0, gt=0, description="Seconds between renewals of the node's Lease.")
    status_period_s: float = Field(default=60.0, gt=0, description="Seconds between full node status updates.")
    # Shorter than the kubelet's 10 s .. 5 min so crash-loop tests finish in seconds; the doubling is the same.
    backoff_initial_s: float = Field(
        default=1.0, ge=0, description="Restart delay after a second crash in a row (the first restarts at once)."
    )
    backoff_max_s: float = Field(default=30.0, gt=0, description="Longest restart delay (it doubles up to this).")
    backoff_reset_s: float = Field(default=60.0, gt=0, description="A run this long ends a crash streak.")
    # 3607 s is the kubelet's own request: the apiserver treats it as "kubelet-managed" and may extend it.
    token_seconds: int = Field(default=3607, ge=600, description="Lifetime asked for ServiceAccount tokens.")
    watch_timeout_s: int = Field(default=300, ge=10, description="Seconds before a pod watch is restarted.")


# `tidal-node-agent run`'s flags (devcluster's plan passes them).
AGENT_OPTIONS: FlatOptions[AgentConfig] = FlatOptions(AgentConfig)
