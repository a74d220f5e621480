"""A container's environment as the kubelet builds it (pure): env, envFrom, valueFrom and $(VAR) expansion."""

import base64
import math
import re
from collections.abc import Callable
from decimal import Decimal
from typing import Any

# (namespace, name) -> data (secret values already base64-decoded), or None when the object does not exist.
Lookup = Callable[[str, str], dict[str, str] | None]


class EnvError(Exception):
    """The container cannot start yet (a referenced Secret/ConfigMap or key is missing); the kubelet retries."""

    reason = "CreateContainerConfigError"


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) syntax: known names are replaced, unknown ones stay as written, $$ is a literal $."""

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))

    return _VAR.sub(sub, text)


def decode_secret(data: dict[str, str] | None) -> dict[str, str]:
    return {k: base64.b64decode(v).decode(errors="replace") for k, v in (data or {}).items()}


_LABEL_PATH = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


def field_ref(pod: dict[str, Any], path: str, pod_ip: str, host_ip: str) -> str:
    meta, spec = pod.get("metadata", {}), pod.get("spec", {})
    simple: dict[str, str] = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if path in simple:
        return simple[path]
    match = _LABEL_PATH.match(path)
    if match:
        value: str = meta.get(match.group(1), {}).get(match.group(2), "")
        return value
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".")[1], {})
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
    raise EnvError(f"unsupported fieldRef fieldPath {path!r}")


_SUFFIX: dict[str, int | Decimal] = {
    "": 1,
    "m": Decimal("0.001"),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}
_QUANTITY = re.compile(r"^([0-9.]+)([a-zA-Z]*)$")


def parse_quantity(text: str) -> Decimal:
    match = _QUANTITY.match(str(text).strip())
    if not match or match.group(2) not in _SUFFIX:
        raise ValueError(f"not a Kubernetes quantity: {text!r}")
    return Decimal(match.group(1)) * Decimal(_SUFFIX[match.group(2)])


def resource_field_ref(container: dict[str, Any], ref: dict[str, Any], node_allocatable: dict[str, str]) -> str:
    """limits.cpu / requests.memory / ... divided by the divisor and rounded up, as the kubelet reports them."""
    resource = ref.get("resource", "")
    kind, _, name = resource.partition(".")
    if kind not in ("limits", "requests") or not name:
        raise EnvError(f"unsupported resourceFieldRef resource {resource!r}")
    resources = container.get("resources", {})
    value = resources.get(kind, {}).get(name)
    if value is None and kind == "requests":
        value = resources.get("limits", {}).get(name)
    if value is None:
        # An unset limit reads as the node's allocatable amount; an unset request as zero.
        value = node_allocatable.get(name, "0") if kind == "limits" else "0"
    divisor = parse_quantity(ref.get("divisor") or "1")
    return str(math.ceil(parse_quantity(value) / divisor))


def _value_from(
    source: dict[str, Any], pod: dict[str, Any], container: dict[str, Any], ctx: "EnvContext"
) -> str | None:
    namespace = pod["metadata"]["namespace"]
    for kind, lookup in (("secretKeyRef", ctx.secret), ("configMapKeyRef", ctx.config_map)):
        ref = source.get(kind)
        if ref is None:
            continue
        label = "secret" if kind == "secretKeyRef" else "configmap"
        data = lookup(namespace, ref["name"])
        if data is None:
            if ref.get("optional"):
                return None
            raise EnvError(f'{label} "{ref["name"]}" not found')
        if ref["key"] not in data:
            if ref.get("optional"):
                return None
            raise EnvError(f"couldn't find key {ref['key']} in {label.capitalize()} {namespace}/{ref['name']}")
        return data[ref["key"]]
    if "fieldRef" in source:
        return field_ref(pod, source["fieldRef"]["fieldPath"], ctx.pod_ip, ctx.host_ip)
    if "resourceFieldRef" in source:
        return resource_field_ref(container, source["resourceFieldRef"], ctx.node_allocatable)
    raise EnvError(f"unsupported valueFrom source {sorted(source)}")


class EnvContext:
    """What resolution needs beyond the pod: lookups of Secrets/ConfigMaps and the addresses the node gave."""

    def __init__(
        self, secret: Lookup, config_map: Lookup, pod_ip: str, host_ip: str, node_allocatable: dict[str, str]
    ) -> None:
        self.secret = secret
        self.config_map = config_map
        self.pod_ip = pod_ip
        self.host_ip = host_ip
        self.node_allocatable = node_allocatable


def container_env(pod: dict[str, Any], container: dict[str, Any], ctx: EnvContext) -> dict[str, str]:
    """envFrom first, then env in order (later entries see earlier ones through $(VAR)), like the kubelet."""
    namespace = pod["metadata"]["namespace"]
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        prefix = source.get("prefix", "")
        for kind, lookup in (("configMapRef", ctx.config_map), ("secretRef", ctx.secret)):
            ref = source.get(kind)
            if ref is None:
                continue
            data = lookup(namespace, ref["name"])
            if data is None:
                if ref.get("optional"):
                    continue
                raise EnvError(f'{"configmap" if kind == "configMapRef" else "secret"} "{ref["name"]}" not found')
            for key, value in data.items():
                env[prefix + key] = value
    for item in container.get("env", []):
        if "valueFrom" in item:
            resolved = _value_from(item["valueFrom"], pod, container, ctx)
            if resolved is None:
                continue
            env[item["name"]] = resolved
        else:
            env[item["name"]] = expand(item.get("value", ""), env)
    return env


def container_argv(container: dict[str, Any], env: dict[str, str]) -> list[str]:
    """command + args with $(VAR) expanded; empty when the container relies on its image's entrypoint, which the
    node agent cannot run (there is no image)."""
    if not container.get("command"):
        return []
    return [expand(part, env) for part in [*container["command"], *container.get("args", [])]]
