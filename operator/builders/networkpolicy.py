"""NetworkPolicy for a model's pods: the serving port is open, the control port only to the operator's pods."""

from typing import Any

from pydantic import BaseModel, Field

from tidal.operator.api.resource import InferenceModel
from tidal.operator.builders import names
from tidal.operator.builders.owner import object_meta, stamp_hash


class OperatorIdentity(BaseModel):
    """Where the operator runs and how its pods are labelled (from the chart, via the operator's config)."""

    namespace: str = Field(min_length=1)
    pod_labels: dict[str, str] = Field(min_length=1)


def build_network_policy(model: InferenceModel, operator: OperatorIdentity) -> dict[str, Any]:
    """Ingress only. Rank-to-rank traffic (expert parallelism) will need its own rule when it exists."""
    name = model.metadata.name
    serving = model.spec.serving
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(model, names.network_policy_name(name), names.model_labels(name)),
        "spec": {
            "podSelector": {"matchLabels": names.model_selector(name)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": [{"protocol": "TCP", "port": serving.port}]},
                {
                    "from": [
                        {
                            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": operator.namespace}},
                            "podSelector": {"matchLabels": dict(operator.pod_labels)},
                        }
                    ],
                    "ports": [{"protocol": "TCP", "port": serving.control_port}],
                },
            ],
        },
    }
    return stamp_hash(policy, policy["spec"])
