"""The pod-template merge rule (documented in docs/API.md, "Pod template merge").

1. Maps merge key by key, recursively; a `null` in the template removes the key.
2. Lists whose items all carry a `name` (containers, volumes, env, ports, volumeMounts, ...) merge by name: a
   template item with a known name merges into that item, a new name is appended. Other lists are replaced.
3. Scalars from the template replace Tidal's.
4. Afterwards Tidal re-asserts what it must own: the pod's name, namespace, ownerReferences and Tidal's labels, its
   `hostname` and `subdomain` (each rank's DNS name under the group Service), and in the `worker` container its
   command, args, terminationMessagePath (the worker is told it in a reserved variable), reserved TIDAL_* variables
   and the `serve` / `control` / `group` ports.
"""

import copy
from typing import Any

from tidal.operator.api.worker_env import EXCLUSIVE_ENV_NAMES, GUARDED_ENV_NAMES, RESERVED_ENV_NAMES

WORKER_CONTAINER = "worker"
SERVE_PORT_NAME = "serve"  # the OpenAI-compatible API (the Services' targetPort)
CONTROL_PORT_NAME = "control"  # the control API
GROUP_PORT_NAME = "group"  # expert parallelism: the rank's group endpoint
OWNED_PORT_NAMES = (SERVE_PORT_NAME, CONTROL_PORT_NAME, GROUP_PORT_NAME)
# `<pod>.<model>-group` resolves only while each pod keeps its own hostname under the group Service's subdomain.
OWNED_POD_FIELDS = ("hostname", "subdomain")


def _is_named_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(i, dict) and isinstance(i.get("name"), str) for i in value)


def merge_values(base: Any, overlay: Any) -> Any:
    """Rules 1-3 above. Neither argument is modified."""
    if isinstance(base, dict) and isinstance(overlay, dict):
        out = copy.deepcopy(base)
        for key, value in overlay.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = merge_values(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if _is_named_list(base) and _is_named_list(overlay):
        items: list[Any] = copy.deepcopy(base)
        position = {item["name"]: i for i, item in enumerate(items)}
        for item in overlay:
            if item["name"] in position:
                items[position[item["name"]]] = merge_values(items[position[item["name"]]], item)
            else:
                position[item["name"]] = len(items)
                items.append(copy.deepcopy(item))
        return items
    return copy.deepcopy(overlay)


class PodTemplateError(ValueError):
    """The template leaves no pod Tidal can run: the CRD keeps `podTemplate.spec` free-form, so this is found here."""


def _find_worker(spec: dict[str, Any]) -> dict[str, Any] | None:
    return next((c for c in spec.get("containers", []) if c.get("name") == WORKER_CONTAINER), None)


def _check_containers(merged: dict[str, Any]) -> None:
    containers = merged.get("containers")
    if not isinstance(containers, list) or not _is_named_list(containers):
        raise PodTemplateError(
            "spec.worker.podTemplate.spec.containers must be a list of containers that each have a name (items "
            f"merge into Tidal's by name); after the merge it is {_describe(containers)}"
        )
    if _find_worker(merged) is None:
        raise PodTemplateError(f"spec.worker.podTemplate.spec.containers dropped the {WORKER_CONTAINER!r} container")
    # Tidal's merge and spec hash read these by name (env) and by key (ports): a malformed one must be reported,
    # not crash every pass.
    for container in containers:
        where = f"spec.worker.podTemplate.spec.containers[{container['name']}]"
        env = container.get("env") or []  # a new container's null stays in the merge; it means none
        if not isinstance(env, list) or not _is_named_list(env):
            raise PodTemplateError(
                f"{where}.env must be a list of variables that each have a name; after the merge it is {_describe(env)}"
            )
        ports = container.get("ports") or []
        if not isinstance(ports, list) or not all(isinstance(p, dict) for p in ports):
            raise PodTemplateError(
                f"{where}.ports must be a list of ports (maps); after the merge it is {_describe(ports)}"
            )


def _describe(value: Any) -> str:
    if value is None:
        return "gone (a null removes the key)"
    if isinstance(value, list):
        if not all(isinstance(item, dict) for item in value):
            return "a list with an item that is not a map"
        return "a list with an item that has no name"
    return f"a {type(value).__name__}, not a list"


def _reassert_worker(merged: dict[str, Any], built: dict[str, Any]) -> None:
    _check_containers(merged)
    mine, theirs = _find_worker(built), _find_worker(merged)
    if mine is None or theirs is None:
        raise ValueError("the built pod and the merged pod must both have the worker container")
    for key in ("command", "args", "terminationMessagePath"):
        if key in mine:
            theirs[key] = copy.deepcopy(mine[key])
        else:
            theirs.pop(key, None)
    reserved = [e for e in mine.get("env", []) if e["name"] in RESERVED_ENV_NAMES]
    # Guarded variables Tidal leaves unset, and a template may not set either (spec.worker.env is refused them).
    others = [e for e in theirs.get("env", []) if e["name"] not in RESERVED_ENV_NAMES + GUARDED_ENV_NAMES]
    theirs["env"] = copy.deepcopy(reserved) + others
    _check_exclusive_env(theirs["env"])
    owned = [p for p in mine.get("ports", []) if p.get("name") in OWNED_PORT_NAMES]
    extra = [p for p in theirs.get("ports", []) if p.get("name") not in OWNED_PORT_NAMES]
    theirs["ports"] = copy.deepcopy(owned) + extra


def _check_exclusive_env(env: list[dict[str, Any]]) -> None:
    """The CRD refuses `spec.worker.env` with both of a pair the worker will not start with; the template's worker
    env (free-form) can add the other one, so the merged env is checked here, before a pod would crash-loop."""
    names = {e["name"] for e in env}
    for first, second in EXCLUSIVE_ENV_NAMES:
        if first in names and second in names:
            raise PodTemplateError(
                f"the worker container's env sets both {first} and {second} (spec.worker.env and "
                f"spec.worker.podTemplate.spec.containers[{WORKER_CONTAINER}].env together): set only one (the "
                "worker refuses to start with both)"
            )


def apply_pod_template(
    pod: dict[str, Any], template_spec: dict[str, Any], labels: dict[str, str], annotations: dict[str, str]
) -> dict[str, Any]:
    """Merge a user's pod template into a pod Tidal built; returns a new pod. Raises PodTemplateError when the
    template leaves no named containers, no worker container, a container whose env or ports Tidal cannot read, or a
    worker env with both of a pair the worker refuses (worker_env.EXCLUSIVE_ENV_NAMES)."""
    merged = copy.deepcopy(pod)
    merged["spec"] = merge_values(pod["spec"], template_spec)
    for key in OWNED_POD_FIELDS:
        if key in pod["spec"]:
            merged["spec"][key] = pod["spec"][key]
        else:
            merged["spec"].pop(key, None)
    _reassert_worker(merged["spec"], pod["spec"])
    meta = merged["metadata"]
    meta["labels"] = {**labels, **pod["metadata"].get("labels", {})}
    meta["annotations"] = {**annotations, **pod["metadata"].get("annotations", {})}
    if not meta["annotations"]:
        del meta["annotations"]
    return merged
