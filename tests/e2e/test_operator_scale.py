"""The scale subresource (issue 20) on the real control plane: `kubectl scale` adds a replica's pods, the scale shows
the counts and the selector, a count past the CRD's bound is refused, and the controller-manager's real
HorizontalPodAutoscaler controller accepts the documented HPA (examples/autoscaling/hpa-waiting-requests.yaml) and
sets spec.replicas through the scale itself."""

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from operator_e2e import create_model, get_model, model_manifest, model_pods, wait_model, wait_until

from tidal.operator.api import constants as c

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HPA_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "autoscaling" / "hpa-waiting-requests.yaml"
SELECTOR = f"{c.LABEL_MODEL}=tiny,{c.LABEL_RANK}=0"


def _serving(replicas: int):
    def check(obj: dict) -> bool:
        status = obj.get("status") or {}
        current = status.get("observedGeneration") == obj["metadata"]["generation"]
        counts = (status.get("replicas"), status.get("readyRanks"), status.get("totalRanks"))
        return current and status.get("phase") == "Ready" and counts == (replicas, replicas, replicas)

    return check


def _hpa_condition(hpa: Any, type_: str) -> Any:
    """The HPA's condition of that type, or None."""
    found = [cond for cond in (hpa.status.conditions or []) if cond.type == type_]
    return found[0] if found else None


def test_kubectl_scale_and_a_horizontal_pod_autoscaler_set_the_replicas(devcluster, namespace, models):
    # The example HPA targets the model `tiny` of examples/tiny-model.yaml; this one has its name.
    create_model(devcluster, namespace, model_manifest("tiny", models))
    wait_model(devcluster, namespace, "tiny", _serving(1), timeout_s=120, what="one replica serving")

    devcluster.kubectl("scale", "tim", "tiny", "-n", namespace, "--replicas=2")
    wait_model(devcluster, namespace, "tiny", _serving(2), timeout_s=120, what="two replicas serving")
    assert set(model_pods(devcluster, namespace, "tiny")) == {"tiny-r0-0", "tiny-r1-0"}
    got = devcluster.kubectl("get", "tim", "tiny", "-n", namespace, "--subresource=scale", "-o", "json")
    scale = json.loads(got.stdout)
    assert (scale["apiVersion"], scale["kind"]) == ("autoscaling/v1", "Scale")
    assert scale["spec"] == {"replicas": 2}
    assert scale["status"] == {"replicas": 2, "selector": SELECTOR}

    # A scale goes through the object's validation: past spec.replicas' bound it is refused, saying why.
    refused = devcluster.kubectl("scale", "tim", "tiny", "-n", namespace, "--replicas=65", check=False)
    assert refused.returncode != 0
    assert "spec.replicas" in refused.stderr and "less than or equal to 64" in refused.stderr, refused.stderr
    assert get_model(devcluster, namespace, "tiny")["spec"]["replicas"] == 2

    # The documented HPA, as a user applies it. No metrics API is served here, so the controller can read the scale
    # (AbleToScale) and its selector (it gets as far as asking for the pods' metric) but has no metric to act on.
    devcluster.kubectl("apply", "-n", namespace, "-f", str(HPA_EXAMPLE))
    autoscaling = client.AutoscalingV2Api(devcluster.api_client)

    def accepted() -> Any:
        hpa = autoscaling.read_namespaced_horizontal_pod_autoscaler_status("tiny", namespace)
        able, active = _hpa_condition(hpa, "AbleToScale"), _hpa_condition(hpa, "ScalingActive")
        return hpa if able is not None and able.status == "True" and active is not None else None

    hpa = wait_until(accepted, 60, "the HPA's AbleToScale condition True")
    active = _hpa_condition(hpa, "ScalingActive")
    assert (active.status, active.reason) == ("False", "FailedGetPodsMetric"), active
    assert hpa.status.current_replicas == 2
    assert yaml.safe_load(HPA_EXAMPLE.read_text())["spec"]["maxReplicas"] > 2  # so far it had no reason to act

    # Bounds need no metric: maxReplicas below the current count makes the controller write the scale itself.
    autoscaling.patch_namespaced_horizontal_pod_autoscaler("tiny", namespace, {"spec": {"maxReplicas": 1}})
    obj = wait_model(
        devcluster, namespace, "tiny", lambda o: o["spec"]["replicas"] == 1 and _serving(1)(o), timeout_s=90,
        what="the HPA's scale-down carried out",
    )  # fmt: skip
    assert obj["status"]["selector"] == SELECTOR
    wait_until(lambda: set(model_pods(devcluster, namespace, "tiny")) == {"tiny-r0-0"}, 60, "replica 1's pod gone")
