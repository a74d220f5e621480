"""Names and labels of the objects an InferenceModel owns: one place, so the planner and builders agree."""

import re

from tidal.operator.api import constants as c


def pod_name(model: str, replica: int, rank: int) -> str:
    return f"{model}-r{replica}-{rank}"


def rank_of(model: str, pod: str) -> tuple[int, int] | None:
    """(replica, rank) of one of `model`'s rank pod names (`pod_name` read backwards); None for any other name."""
    found = re.fullmatch(rf"{re.escape(model)}-r(0|[1-9][0-9]*)-(0|[1-9][0-9]*)", pod, flags=re.ASCII)
    return (int(found[1]), int(found[2])) if found is not None else None


def rank_pod_names(model: str, replicas: int, ranks_per_replica: int) -> list[str]:
    """Every rank's pod name the spec asks for, replica by replica."""
    return [pod_name(model, replica, rank) for replica in range(replicas) for rank in range(ranks_per_replica)]


def group_service_name(model: str) -> str:
    """Headless Service that gives each rank a stable DNS name (`<pod>.<model>-group`)."""
    return f"{model}{c.GROUP_SERVICE_SUFFIX}"


def serving_service_name(model: str) -> str:
    """The Service clients call: it selects every pod whose rank serves (see `serving_selector`)."""
    return model


def token_secret_name(model: str) -> str:
    return f"{model}-control-token"


def network_policy_name(model: str) -> str:
    return f"{model}-control"


TOKEN_SECRET_KEY = "token"


def model_labels(model: str) -> dict[str, str]:
    """Labels shared by every child of the model (and the selector for all its pods)."""
    return {
        c.LABEL_NAME: c.APP_NAME,
        c.LABEL_INSTANCE: model,
        c.LABEL_MANAGED_BY: c.MANAGED_BY,
        c.LABEL_PART_OF: c.PART_OF,
        c.LABEL_MODEL: model,
    }


def model_selector(model: str) -> dict[str, str]:
    return {c.LABEL_MODEL: model}


def replica_selector(model: str) -> dict[str, str]:
    """One pod per replica, its rank 0, for the scale subresource. The HorizontalPodAutoscaler takes the number of
    ready pods its selector matches as the current replica count (its pod metrics multiply their average by it), so a
    selector over every rank would scale an expert-parallel model by expertParallel times too much."""
    return {c.LABEL_MODEL: model, c.LABEL_RANK: "0"}


def selector_string(labels: dict[str, str]) -> str:
    """`key=value,...`: the form a label selector takes in a status field (and in `kubectl get -l`)."""
    return ",".join(f"{key}={value}" for key, value in labels.items())


def serving_selector(model: str) -> dict[str, str]:
    """Every rank of an expert-parallel group is a full endpoint, so the Service takes all ranks that serve, not only
    leaders; with expertParallel 1 every pod is its replica's only rank and is built serving."""
    return {c.LABEL_MODEL: model, c.LABEL_SERVING: "true"}


def label_value(flag: bool) -> str:
    return "true" if flag else "false"


def identity_labels(model: str, replica: int, rank: int) -> dict[str, str]:
    """The labels that say which model's rank a pod is (the observer checks them against the pod's name)."""
    return {c.LABEL_MODEL: model, c.LABEL_REPLICA: str(replica), c.LABEL_RANK: str(rank)}


def pod_labels(model: str, replica: int, rank: int, leader: bool, serving: bool) -> dict[str, str]:
    return {
        **model_labels(model),
        c.LABEL_COMPONENT: "worker",
        **identity_labels(model, replica, rank),
        c.LABEL_LEADER: label_value(leader),
        c.LABEL_SERVING: label_value(serving),
    }
