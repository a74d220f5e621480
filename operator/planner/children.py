"""Services, token Secret and NetworkPolicy: create what is missing, patch what drifted from its spec hash."""

from pydantic import SecretStr

from tidal.operator.api import constants as c
from tidal.operator.api.resource import InferenceModel
from tidal.operator.builders.networkpolicy import OperatorIdentity, build_network_policy
from tidal.operator.builders.secret import build_token_secret
from tidal.operator.builders.services import build_group_service, build_serving_service
from tidal.operator.planner.actions import (
    Action,
    CreateNetworkPolicy,
    CreateSecret,
    CreateService,
    PatchNetworkPolicy,
    PatchSecret,
    PatchService,
)
from tidal.operator.planner.observed import ObservedChildren, child_key

NAMED_FOREIGN = 5


def plan_children(
    model: InferenceModel, children: ObservedChildren, operator: OperatorIdentity, fresh_token: SecretStr
) -> list[Action]:
    """Objects under a child's name that this model does not control (`children.foreign`) are left alone."""
    actions: list[Action] = []
    secret = build_token_secret(model, fresh_token)
    # The Secret first: pods read the token from it. It is patched only when it holds no token: a good one stays,
    # as the workers hold it. A new token locks the running workers out, and their pods are replaced (`pods.py`);
    # without it no worker could be called again, nor a new pod start (its token variable has no key to read).
    key = child_key(secret)
    if key not in children.existing and key not in children.foreign:
        actions.append(CreateSecret(manifest=secret))
    elif key in children.existing and key in children.damaged:
        actions.append(PatchSecret(manifest=secret))
    for manifest in (build_group_service(model), build_serving_service(model)):
        key = child_key(manifest)
        if key in children.foreign:
            continue
        if key not in children.existing:
            actions.append(CreateService(manifest=manifest))
        elif children.existing[key] != manifest["metadata"]["annotations"][c.ANNOTATION_SPEC_HASH]:
            actions.append(PatchService(manifest=manifest))
    policy = build_network_policy(model, operator)
    key = child_key(policy)
    if key in children.foreign:
        return actions
    if key not in children.existing:
        actions.append(CreateNetworkPolicy(manifest=policy))
    elif children.existing[key] != policy["metadata"]["annotations"][c.ANNOTATION_SPEC_HASH]:
        actions.append(PatchNetworkPolicy(manifest=policy))
    return actions


def foreign_children_message(children: ObservedChildren) -> str | None:
    """The Degraded message while objects under our children's names belong to someone else (None: none do)."""
    if not children.foreign:
        return None
    # A few names: a pod may be in the way of every rank, and a condition's message must stay short.
    named = sorted(children.foreign.items())[:NAMED_FOREIGN]
    found = "; ".join(f"{key} exists and is not this model's ({owner})" for key, owner in named)
    if len(children.foreign) > NAMED_FOREIGN:
        found += f"; and {len(children.foreign) - NAMED_FOREIGN} more"
    return f"{found}: Tidal neither changes nor adopts it; delete or rename it, or give the model another name"
