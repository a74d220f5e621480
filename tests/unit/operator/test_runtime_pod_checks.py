"""Pods the API server refuses, through whole passes against an in-memory API (issue 16): the pod a pass may create
is dry-run first and a refusal keeps the serving pod; a create refused for real surfaces too; verdicts are
remembered so a steady model asks nothing; and the client's dry run itself (generated name, the message)."""

import asyncio
import copy
import json

import httpx
import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from memory_kube import MemoryKube, start_pod, worker_state
from prometheus_client import CollectorRegistry

from tidal.operator.config import OperatorConfig
from tidal.operator.kube.client import KubeApi
from tidal.operator.kube.refusal import Refusal, RefusedError
from tidal.operator.metrics import OperatorMetrics
from tidal.operator.runtime import pod_checks
from tidal.operator.runtime.reconcile import Reconciler
from tidal.operator.runtime.workers import WorkerFleet

CONFIG = OperatorConfig(namespace="tidal-system", pod_labels={"app.kubernetes.io/name": "tidal-operator"})
KEY = ("ml", "tiny")
LOTS = {"spec": {"containers": [{"name": "worker", "resources": {"limits": {"cpu": "lots"}}}]}}
DECODE = 'Pod in version "v1" cannot be handled as a Pod: quantities must match the regular expression'


def _lots(manifest: dict) -> Refusal | None:
    limits = manifest["spec"]["containers"][0].get("resources", {}).get("limits", {})
    return Refusal(400, DECODE) if limits.get("cpu") == "lots" else None


def _worker(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/state":
        return httpx.Response(200, json=worker_state("base"))
    return httpx.Response(200, json={"version": "base", "overall": "sum-base", "tensors": {}})


def _degraded(kube: MemoryKube) -> dict:
    return next(c for c in kube.model["status"]["conditions"] if c["type"] == "Degraded")


def _set_template(kube: MemoryKube, template: dict | None, generation: int) -> None:
    kube.model["metadata"]["generation"] = generation
    worker = kube.model["spec"].setdefault("worker", {})
    if template is None:
        worker.pop("podTemplate", None)
    else:
        worker["podTemplate"] = copy.deepcopy(template)


def _passes(kube: MemoryKube, script) -> None:
    metrics = OperatorMetrics(CollectorRegistry())

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(_worker)) as http:
            await script(Reconciler(kube, WorkerFleet(http, metrics), metrics, CONFIG))

    asyncio.run(main())


def test_a_refused_template_keeps_the_serving_pod_and_the_old_spec_back_clears_it(monkeypatch):
    kube = MemoryKube()
    kube.refuse_dry_run = _lots

    async def script(reconcile):
        await reconcile(KEY)  # creates the children and the pod (dry-run first)
        assert kube.dry_runs == ["tiny-r0-0"]
        start_pod(kube)
        await reconcile(KEY)
        kube.writes.clear()
        _set_template(kube, LOTS, generation=2)
        await reconcile(KEY)
        assert kube.dry_runs == ["tiny-r0-0", "tiny-r0-0"]
        assert not any(w.startswith(("delete", "create")) for w in kube.writes)
        assert kube.writes == ["event PodTemplateRefused", "status"]  # Events first (execute.write_status)
        degraded = _degraded(kube)
        assert degraded["status"] == "True" and degraded["reason"] == "PodTemplateRefused"
        assert DECODE in degraded["message"] and kube.model["status"]["observedGeneration"] == 2
        # Asked once: the next pass goes by the verdict it remembers, and writes nothing.
        kube.writes.clear()
        await reconcile(KEY)
        assert len(kube.dry_runs) == 2 and kube.writes == []
        # Asked again once the refusal is old enough; the same answer is no news.
        monkeypatch.setattr(pod_checks, "REFUSAL_RECHECK_S", 0.0)
        await reconcile(KEY)
        assert len(kube.dry_runs) == 3 and kube.writes == []
        _set_template(kube, None, generation=3)
        await reconcile(KEY)
        assert len(kube.dry_runs) == 3  # the pod is what the spec asks for: nothing to ask
        assert kube.writes == ["event AsExpected", "status"] and _degraded(kube)["status"] == "False"

    _passes(kube, script)


def test_a_new_model_with_a_refused_template_is_degraded_on_its_first_pass():
    kube = MemoryKube()
    kube.refuse_dry_run = _lots
    _set_template(kube, LOTS, generation=1)

    async def script(reconcile):
        assert await reconcile(KEY) == 1.0
        assert kube.writes == [
            "create Secret/tiny-control-token", "create Service/tiny-group", "create Service/tiny",
            "create NetworkPolicy/tiny-control", "event PodTemplateRefused", "status",
        ]  # fmt: skip
        assert _degraded(kube)["reason"] == "PodTemplateRefused"

    _passes(kube, script)


def test_a_create_refused_for_real_is_surfaced_by_the_next_pass(monkeypatch):
    # The dry run admits the pod (a webhook that answers dry runs differently, a quota that filled meanwhile), the
    # create is refused: the pass still writes its status, and the next one reports the refusal and stops trying.
    kube = MemoryKube()
    kube.refuse_create = _lots
    _set_template(kube, LOTS, generation=1)

    async def script(reconcile):
        assert await reconcile(KEY) == 1.0  # not an error: the pass went on
        assert "refused Pod/tiny-r0-0" in kube.writes and "status" in kube.writes
        kube.writes.clear()
        await reconcile(KEY)
        assert kube.writes == ["event PodTemplateRefused", "status"]  # Events first (execute.write_status)
        assert DECODE in _degraded(kube)["message"]
        monkeypatch.setattr(pod_checks, "REFUSAL_RECHECK_S", 0.0)
        kube.refuse_create = lambda manifest: None
        kube.writes.clear()
        await reconcile(KEY)  # asked again, admitted, created
        assert "create Pod/tiny-r0-0" in kube.writes

    _passes(kube, script)


def test_answers_that_are_not_about_the_pod_let_it_through(monkeypatch):
    kube = MemoryKube()
    quota = Refusal(403, 'pods "tiny-r0-0" is forbidden: exceeded quota: q, requested: cpu=1, used: cpu=1')
    no_dry_run = Refusal(400, 'admission webhook "audit.example.com" does not support dry run')

    async def script(reconcile):
        kube.refuse_dry_run = lambda manifest: no_dry_run
        await reconcile(KEY)
        assert "create Pod/tiny-r0-0" in kube.writes
        start_pod(kube)
        await reconcile(KEY)
        # A replacement over quota: the pod it replaces holds the quota, deleting it makes the room.
        kube.refuse_dry_run = lambda manifest: quota
        kube.model["spec"]["worker"] = {"resources": {"cpu": "1"}}
        kube.model["metadata"]["generation"] = 2
        kube.writes.clear()
        await reconcile(KEY)
        assert "delete tiny-r0-0" in kube.writes
        # Its create is refused for real (the quota had no room after all): surfaced, and not tried again while a
        # dry run says the same, as nothing makes room for a missing pod.
        kube.refuse_create = lambda manifest: quota
        await reconcile(KEY)
        assert "refused Pod/tiny-r0-0" in kube.writes
        await reconcile(KEY)
        assert "exceeded quota" in _degraded(kube)["message"]
        monkeypatch.setattr(pod_checks, "REFUSAL_RECHECK_S", 0.0)
        kube.writes.clear()
        await reconcile(KEY)
        assert kube.dry_runs[-1] == "tiny-r0-0" and kube.writes == []

    _passes(kube, script)


# -- the client ------------------------------------------------------------------------------------------------
class FakeCore(client.CoreV1Api):
    """Pod creation answered here; every other call is the real client's (and is not made)."""

    def __init__(self, error: ApiException | None) -> None:
        super().__init__(client.ApiClient())
        self.error = error
        self.calls: list[tuple[str, dict, dict]] = []

    def create_namespaced_pod(self, namespace, body, **kwargs):
        self.calls.append((namespace, body, kwargs))
        if self.error is not None:
            raise self.error


def _api_error(status: int, body: dict) -> ApiException:
    exc = ApiException(status=status, reason="refused")
    exc.body = json.dumps(body)
    return exc


def _kube(error: ApiException | None) -> tuple[KubeApi, FakeCore]:
    kube = KubeApi(client.ApiClient(), "test")
    core = FakeCore(error)
    kube.core = core
    return kube, core


POD = {"kind": "Pod", "metadata": {"name": "tiny-r0-0", "namespace": "ml"}, "spec": {"containers": []}}


def test_a_dry_run_asks_under_a_generated_name_and_answers_with_the_pods():
    invalid = {
        "kind": "Status", "code": 422, "reason": "Invalid", "details": {"name": "tiny-r0-0-x7k2p", "kind": "Pod"},
        "message": 'Pod "tiny-r0-0-x7k2p" is invalid: spec.containers[0].image: Required value',
    }  # fmt: skip
    kube, core = _kube(_api_error(422, invalid))
    refusal = asyncio.run(kube.dry_run_pod(POD))
    namespace, body, kwargs = core.calls[0]
    assert namespace == "ml" and kwargs["dry_run"] == "All"
    assert "name" not in body["metadata"] and body["metadata"]["generateName"] == "tiny-r0-0-"
    assert POD["metadata"]["name"] == "tiny-r0-0"  # the caller's manifest is left as it was
    assert refusal == Refusal(422, 'Pod "tiny-r0-0" is invalid: spec.containers[0].image: Required value', "tiny-r0-0")
    kube.close()


def test_a_dry_run_that_is_admitted_or_fails_to_ask():
    kube, _ = _kube(None)
    assert asyncio.run(kube.dry_run_pod(POD)) is None
    kube.close()
    for status in (409, 429, 500):
        kube, _ = _kube(_api_error(status, {"message": "try again"}))
        with pytest.raises(ApiException):
            asyncio.run(kube.dry_run_pod(POD))
        kube.close()


def test_a_refused_create_raises_refused_and_a_taken_name_is_not_an_error():
    kube, _ = _kube(_api_error(400, {"message": DECODE}))
    with pytest.raises(RefusedError) as caught:
        asyncio.run(kube.create(POD))
    assert caught.value.refusal == Refusal(400, DECODE)
    kube.close()
    kube, _ = _kube(_api_error(409, {"message": "already exists"}))
    assert asyncio.run(kube.create(POD)) is False
    kube.close()
