"""NetworkPolicy for a model's pods: the serving port is open, the control port only to the operator's pods, and
with expert parallelism every TCP port between the model's own pods."""

from typing import Any

from pydantic import BaseModel, Field

from tidal.operator.api.resource import InferenceModel
from tidal.operator.builders import names
from tidal.operator.builders.merge import CONTROL_PORT_NAME, SERVE_PORT_NAME
from tidal.operator.builders.owner import object_meta, stamp_hash


class OperatorIdentity(BaseModel):
    """Where the operator runs and how its pods are labelled (from the chart, via the operator's config)."""

    namespace: str = Field(min_length=1)
    pod_labels: dict[str, str] = Field(min_length=1)


def _between_ranks(model_name: str) -> dict[str, Any]:
    """Ranks of a group meet at each other's group endpoint (port 7100), but gloo's connections (and NCCL's bootstrap
    sockets) then go to ephemeral ports each process picks at run time, so no port list can name them: every TCP port
    is open, to the model's own pods only (same namespace, same model label). That includes the control port between
    peers, which widens nothing in effect: they run the same worker and mount the same control token. (A pair of
    ranges around the control port would need `endPort`, which some network plugins ignore, opening a single port
    and silently breaking the group.)"""
    return {
        "from": [{"podSelector": {"matchLabels": names.model_selector(model_name)}}],
        "ports": [{"protocol": "TCP"}],
    }


def build_network_policy(model: InferenceModel, operator: OperatorIdentity) -> dict[str, Any]:
    """Ingress only (egress is not restricted). A model of expertParallel 1 has no rank-to-rank traffic, so its
    policy stays as tight as before.

    Ports are named, not numbered: each pod is admitted on its own `serve` and `control` ports. A change of
    spec.serving patches the policy at once but replaces the pods replica by replica, and numbers would cut every
    pod still on the old ports off from its clients and from the operator until its turn came."""
    name = model.metadata.name
    policy: dict[str, Any] = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(model, names.network_policy_name(name), names.model_labels(name)),
        "spec": {
            "podSelector": {"matchLabels": names.model_selector(name)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": [{"protocol": "TCP", "port": SERVE_PORT_NAME}]},
                {
                    "from": [
                        {
                            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": operator.namespace}},
                            "podSelector": {"matchLabels": dict(operator.pod_labels)},
                        }
                    ],
                    "ports": [{"protocol": "TCP", "port": CONTROL_PORT_NAME}],
                },
            ],
        },
    }
    if model.spec.is_expert_parallel:
        policy["spec"]["ingress"].append(_between_ranks(name))
    return stamp_hash(policy, policy["spec"])
