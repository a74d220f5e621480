"""Kubeconfig documents (pure): client-certificate ones for components, token ones for pods."""

import base64
from pathlib import Path
from typing import Any

import yaml


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _document(
    server: str, ca_pem: bytes, user: dict[str, str], name: str, namespace: str | None = None
) -> dict[str, Any]:
    context: dict[str, str] = {"cluster": name, "user": name}
    if namespace:
        context["namespace"] = namespace
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": {"server": server, "certificate-authority-data": _b64(ca_pem)}}],
        "users": [{"name": name, "user": user}],
        "contexts": [{"name": name, "context": context}],
        "current-context": name,
        "preferences": {},
    }


def cert_kubeconfig(
    server: str, ca_pem: bytes, cert_pem: bytes, key_pem: bytes, name: str = "tidal-devcluster"
) -> dict[str, Any]:
    user = {"client-certificate-data": _b64(cert_pem), "client-key-data": _b64(key_pem)}
    return _document(server, ca_pem, user, name)


def token_kubeconfig(
    server: str, ca_pem: bytes, token: str, namespace: str, name: str = "tidal-devcluster"
) -> dict[str, Any]:
    """What a pod's process reads through $KUBECONFIG: its ServiceAccount token, its namespace as the default."""
    return _document(server, ca_pem, {"token": token}, name, namespace)


def write_kubeconfig(path: Path, document: dict[str, Any]) -> None:
    """Atomically (rename) and private (0600): readers never see half a file, other users never see credentials."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(document, sort_keys=False))
    tmp.chmod(0o600)
    tmp.replace(path)
