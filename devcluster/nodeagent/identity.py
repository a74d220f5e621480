"""A pod's ServiceAccount identity: a bound token from the TokenRequest API, in a kubeconfig named by $KUBECONFIG.

The kubelet mounts the token at /var/run/secrets/kubernetes.io/serviceaccount; a local process has no such mount,
and both the kubernetes Python client and kopf fall back to $KUBECONFIG, so the token goes into a kubeconfig.
"""

import time
from pathlib import Path
from typing import Any

from tidal.devcluster.kubeconfig import token_kubeconfig, write_kubeconfig
from tidal.devcluster.nodeagent.kubeapi import NodeApi


def wants_token(pod: dict[str, Any]) -> bool:
    # The pod's own setting wins; the ServiceAccount's automount flag is not consulted (the agent may not read SAs).
    return pod.get("spec", {}).get("automountServiceAccountToken", True) is not False


class PodIdentity:
    def __init__(self, api: NodeApi, ca_pem: bytes, path: Path, token_seconds: int) -> None:
        self._api = api
        self._ca_pem = ca_pem
        self.path = path
        self._token_seconds = token_seconds
        self._refresh_at = 0.0

    @property
    def refresh_at(self) -> float:
        return self._refresh_at

    def ensure(self, pod: dict[str, Any], now: float) -> None:
        """Write (or refresh at 80% of its life) the pod's kubeconfig; raises ApiException when the API refuses."""
        if self.path.exists() and now < self._refresh_at:
            return
        meta = pod["metadata"]
        sa = pod["spec"].get("serviceAccountName") or "default"
        answer = self._api.service_account_token(meta["namespace"], sa, meta["name"], meta["uid"], self._token_seconds)
        document = token_kubeconfig(self._api.server, self._ca_pem, answer["status"]["token"], meta["namespace"])
        write_kubeconfig(self.path, document)
        self._refresh_at = time.monotonic() + 0.8 * self._token_seconds
