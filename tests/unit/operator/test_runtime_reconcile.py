"""A whole reconcile pass (observe -> plan -> execute) against an in-memory Kubernetes API: the first pass creates
the children and the pod and writes the status once; a pass with nothing new writes nothing (the status read
back through JSON compares equal); a deleted model is forgotten, and its memory with it."""

import asyncio
import base64
import contextlib
import copy
from collections.abc import Callable

import httpx
import pytest
from memory_kube import MemoryKube, start_pod, worker_state
from prometheus_client import CollectorRegistry, generate_latest

from tidal.operator.api import constants as c
from tidal.operator.config import OperatorConfig
from tidal.operator.metrics import OperatorMetrics
from tidal.operator.runtime.reconcile import Reconciler
from tidal.operator.runtime.workers import WorkerFleet


async def _broken(*args, **kwargs):
    raise RuntimeError("API down")


CONFIG = OperatorConfig(namespace="tidal-system", pod_labels={"app.kubernetes.io/name": "tidal-operator"})


@contextlib.asynccontextmanager
async def reconciler_for(kube: MemoryKube, worker: Callable[[httpx.Request], httpx.Response] | None = None):
    """A Reconciler over `kube`, its worker calls answered by `worker` (none: no worker answers)."""
    metrics = OperatorMetrics(CollectorRegistry())
    transport = httpx.MockTransport(worker) if worker is not None else None
    async with httpx.AsyncClient(transport=transport) as http:
        yield Reconciler(kube, WorkerFleet(http, metrics), metrics, CONFIG)


def one_pass(kube: MemoryKube) -> float:
    """One reconcile pass of the model in `kube`, no worker answering. -> its requeue delay."""

    async def main() -> float:
        async with reconciler_for(kube) as reconcile:
            return await reconcile(("ml", "tiny"))

    return asyncio.run(main())


def serving_base(request: httpx.Request) -> httpx.Response:
    """A worker's answer to /state or /weights/checksum while it serves `base`."""
    if request.url.path == "/state":
        return httpx.Response(200, json=worker_state("base"))
    return httpx.Response(200, json={"version": "base", "overall": "sum-base", "tensors": {}})


def refusing_worker(calls: list[str], status: int, code: str) -> Callable[[httpx.Request], httpx.Response]:
    """A worker serving `base` that records every other call's path in `calls` and refuses it with `code`."""

    def worker(request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/state", "/weights/checksum"):
            return serving_base(request)
        calls.append(request.url.path)
        return httpx.Response(status, json={"code": code, "message": "refused"})

    return worker


def test_first_pass_creates_then_a_quiet_pass_writes_nothing_then_deletion_is_forgotten():
    kube = MemoryKube()
    metrics = OperatorMetrics(CollectorRegistry())

    async def main():
        async with httpx.AsyncClient() as http:
            reconcile = Reconciler(kube, WorkerFleet(http, metrics), metrics, CONFIG)
            first = await reconcile(("ml", "tiny"))
            assert first == 1.0  # acted: come back soon
            assert kube.writes == [
                "create Secret/tiny-control-token", "create Service/tiny-group", "create Service/tiny",
                "create NetworkPolicy/tiny-control", "create Pod/tiny-r0-0", "status",
            ]  # fmt: skip
            assert kube.model["status"]["phase"] == "Pending" and kube.model["status"]["ready"] == "0/1"
            await reconcile(("ml", "tiny"))  # the pod exists now: Progressing moves from CreatingPods on
            kube.writes.clear()
            quiet = await reconcile(("ml", "tiny"))
            assert kube.writes == [] and quiet == CONFIG.resync_seconds
            kube.model = None
            assert await reconcile(("ml", "tiny")) is None

    asyncio.run(main())
    text = generate_latest(metrics.registry).decode()
    assert 'tidal_operator_reconciles_total{result="acted"} 1.0' in text
    assert 'tidal_operator_reconciles_total{result="gone"} 1.0' in text
    assert 'tidal_operator_models{phase="Pending"} 0.0' in text  # forgotten with the model


def test_a_failing_api_backs_off_and_counts_an_error():
    kube = MemoryKube()
    kube.list_model_pods = _broken
    metrics = OperatorMetrics(CollectorRegistry())

    async def main():
        async with httpx.AsyncClient() as http:
            reconcile = Reconciler(kube, WorkerFleet(http, metrics), metrics, CONFIG)
            return [await reconcile(("ml", "tiny")) for _ in range(3)]

    assert asyncio.run(main()) == [2.0, 4.0, 8.0]
    assert 'tidal_operator_reconciles_total{result="error"} 3.0' in generate_latest(metrics.registry).decode()


def test_back_off_stays_capped_after_many_failures():
    # 2.0 ** count overflows a float after 1023 failures (about 8.5 hours at 30 s): the pass must still return the
    # cap, or the exception escapes the queue and the model is never scheduled again.
    kube = MemoryKube()
    kube.list_model_pods = _broken

    async def main():
        async with reconciler_for(kube) as reconcile:
            reconcile.memories.of(("ml", "tiny")).error_streak = 1100
            return await reconcile(("ml", "tiny"))

    assert asyncio.run(main()) == 30.0


def test_a_status_field_this_operator_does_not_know_does_not_stop_reconciling():
    # A newer operator (and its CRD, which Helm never downgrades) may have written status fields this one does not
    # know; after a rollback they stay in etcd. The status is the operator's output: reading it must not refuse.
    kube = MemoryKube()
    kube.model["status"] = {
        "phase": "Ready",
        "fieldFromANewerOperator": {"x": 1},
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "AllRanksReady", "lastTransitionTime": "2026-01-01T00:00:00Z",
             "newConditionField": "x"},
        ],
    }  # fmt: skip

    assert one_pass(kube) == 1.0
    assert "create Pod/tiny-r0-0" in kube.writes and "status" in kube.writes


def test_a_deleted_model_leaves_nothing_behind():
    # Every kind of memory is filled (checksums, a refused update, the roll's start, back-off streaks), then the
    # model is deleted: one pass that finds it gone drops all of it.
    kube = MemoryKube()
    kube.model["spec"]["weights"] = {"source": "tiny-llama-v2", "version": "v2"}
    answer = {"code": "busy", "message": "another operation is running"}

    def worker(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/state":
            return httpx.Response(200, json=worker_state("base"))
        if request.url.path == "/weights/checksum":
            return httpx.Response(200, json={"version": "base", "overall": "sum-base", "tensors": {}})
        return httpx.Response(409 if answer["code"] == "busy" else 400, json=answer)

    metrics = OperatorMetrics(CollectorRegistry())
    key = ("ml", "tiny")

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(worker)) as http:
            reconcile = Reconciler(kube, WorkerFleet(http, metrics), metrics, CONFIG)
            await reconcile(key)  # creates the children and the pod
            start_pod(kube)
            await reconcile(key)  # the update is answered "busy": the roll has started, asked again later
            memory = reconcile.memories.of(key)
            assert memory.failed_calls_streak == 1 and memory.roll is not None and memory.roll.version == "v2"
            answer.update(code="bad_checkpoint", message="truncated file")
            await reconcile(key)  # refused: remembered until a later update succeeds
            list_model_pods, kube.list_model_pods = kube.list_model_pods, _broken
            await reconcile(key)
            kube.list_model_pods = list_model_pods
            assert memory.checksums == {("uid-4", "base", None): "sum-base"}
            assert memory.update_failures["tiny-r0-0"].version == "v2"
            assert memory.roll is not None and memory.error_streak == 1
            kube.model = None
            assert await reconcile(key) is None
            return reconcile

    reconcile = asyncio.run(main())
    assert key not in reconcile.memories and len(reconcile.memories) == 0
    by_phase = [line for line in generate_latest(metrics.registry).decode().splitlines() if "_models{" in line]
    assert by_phase and all(line.endswith(" 0.0") for line in by_phase)


def test_a_model_forgotten_during_its_pass_is_not_remembered_again():
    # kopf's DELETED event can arrive while a pass for the model runs; what that pass learns afterwards must not
    # bring the model back into the map.
    kube = MemoryKube()
    metrics = OperatorMetrics(CollectorRegistry())
    key = ("ml", "tiny")

    async def main():
        async with httpx.AsyncClient() as http:
            reconcile = Reconciler(kube, WorkerFleet(http, metrics), metrics, CONFIG)
            get_model = kube.get_model

            async def deleted_meanwhile(namespace, name):
                body = await get_model(namespace, name)
                reconcile.forget(key)
                return body

            kube.list_model_pods = _broken
            kube.get_model = deleted_meanwhile
            assert await reconcile(key) == 2.0  # the pass fails after the forget and counts its error...
            return reconcile

    assert key not in asyncio.run(main()).memories  # ...in a memory no longer in the map


@pytest.mark.parametrize(
    ("spec", "answer", "asked", "event"),
    [
        # "Not now" (busy, draining): each pass re-sends the update, and a drain holds the rank's new requests.
        ({"weights": {"source": "tiny-llama-v2", "version": "v2"}}, "busy", "/weights/update", "WorkerUnavailable"),
        # Refused for good (no host memory for a level-1 sleep): nothing in the status holds that refusal either.
        ({"sleep": {"state": "Asleep", "level": 1}}, "no_host_memory", "/sleep", "SleepFailed"),
    ],
    ids=["busy-update", "refused-sleep"],
)
def test_a_worker_call_that_keeps_failing_is_asked_again_with_back_off(spec, answer, asked, event):
    # Asked again on a later pass, but not every second: each try disturbs the rank and posts a Warning Event.
    kube = MemoryKube()
    kube.model["spec"].update(spec)
    calls: list[str] = []
    worker = refusing_worker(calls, 409, answer)

    async def main():
        async with reconciler_for(kube, worker) as reconcile:
            await reconcile(("ml", "tiny"))  # creates the children and the pod
            start_pod(kube)
            return [await reconcile(("ml", "tiny")) for _ in range(3)]

    delays = asyncio.run(main())
    assert calls == [asked] * 3  # asked on every pass
    assert delays == [2.0, 4.0, 8.0]
    assert kube.writes.count(f"event {event}") == 3


def test_a_refused_version_is_tried_again_once_the_spec_named_other_weights_in_between():
    # v2 is refused and held; the spec goes back to base (the hold ends: Synced), the checkpoint is fixed, and the
    # spec names v2 again: that is a new roll, not the old refusal remembered by this process alone.
    kube = MemoryKube()
    v2 = {"source": "tiny-llama-v2", "version": "v2"}
    kube.model["spec"]["weights"] = v2
    updates: list[str] = []
    worker = refusing_worker(updates, 422, "bad_checkpoint")

    async def main():
        async with reconciler_for(kube, worker) as reconcile:
            await reconcile(("ml", "tiny"))  # creates the children and the pod
            start_pod(kube)
            await reconcile(("ml", "tiny"))  # the update is refused
            await reconcile(("ml", "tiny"))  # ...and held
            assert kube.model["status"]["weightsRollout"]["failedVersion"] == "v2" and updates == ["/weights/update"]
            del kube.model["spec"]["weights"]
            await reconcile(("ml", "tiny"))
            assert "weightsRollout" not in kube.model["status"]
            kube.model["spec"]["weights"] = v2
            await reconcile(("ml", "tiny"))

    asyncio.run(main())
    assert updates == ["/weights/update"] * 2


def test_a_pod_is_asked_on_its_own_control_port_until_it_is_replaced():
    # spec.serving.controlPort changed: the pods still running were started on the old port, and the pass that
    # decides their replacement (and any sleep or update before it) must still reach them there.
    kube = MemoryKube()
    asked = []

    def worker(request: httpx.Request) -> httpx.Response:
        asked.append((request.url.path, request.url.port))
        return serving_base(request)

    async def main():
        async with reconciler_for(kube, worker) as reconcile:
            await reconcile(("ml", "tiny"))  # creates the children and the pod
            start_pod(kube)
            kube.model["spec"]["serving"] = {"port": 8000, "controlPort": 9001}
            kube.model["metadata"]["generation"] = 2
            await reconcile(("ml", "tiny"))

    asyncio.run(main())
    assert ("/state", 8001) in asked and ("/state", 9001) not in asked


class LabelListingKube(MemoryKube):
    """Lists pods by the model's label, as the API server does: a pod without it is found only by name."""

    async def list_model_pods(self, namespace, model):
        pods = await super().list_model_pods(namespace, model)
        return [p for p in pods if (p["metadata"].get("labels") or {}).get(c.LABEL_MODEL) == model]


def test_a_planted_pod_under_a_rank_name_is_never_touched_and_is_reported():
    kube = LabelListingKube()
    kube.model["spec"]["replicas"] = 2
    planted = {"kind": "Pod", "metadata": {"name": "tiny-r1-0", "labels": {"app": "web"}}, "status": {}}
    kube.objects[("Pod", "tiny-r1-0")] = copy.deepcopy(planted)

    async def main():
        async with reconciler_for(kube) as reconcile:
            for _ in range(2):
                await reconcile(("ml", "tiny"))

    asyncio.run(main())
    assert kube.objects[("Pod", "tiny-r1-0")] == planted  # not patched, labelled or adopted
    assert not [w for w in kube.writes if "tiny-r1-0" in w]  # not created over, deleted or labelled either
    assert "create Pod/tiny-r0-0" in kube.writes  # the other rank goes on
    assert kube.writes.count("event ForeignObject") == 1
    degraded = next(cond for cond in kube.model["status"]["conditions"] if cond["type"] == "Degraded")
    assert degraded["reason"] == "ForeignObject"
    assert "Pod/tiny-r1-0 exists and is not this model's" in degraded["message"]


SECRET = ("Secret", "tiny-control-token")


def _token_of(kube: MemoryKube) -> str:
    return base64.b64decode(kube.objects[SECRET]["data"]["token"]).decode()


@pytest.mark.parametrize(
    "data",
    [{}, {"token": ""}, {"token": "not base64!"}, {"token": base64.b64encode(b"\xff\xfe").decode()}],
    ids=["no-key", "empty", "not-base64", "not-utf8"],
)
def test_a_damaged_token_secret_gets_a_new_token_and_pods_holding_the_old_one_are_replaced(data):
    # The Secret is there but holds no usable token: it must be repaired as a deleted one is re-created, or no
    # worker is ever called again and no new pod can start (its TIDAL_CONTROL_TOKEN has no key to read).
    kube = MemoryKube()
    held: dict[str, str] = {}

    def worker(request: httpx.Request) -> httpx.Response:
        if request.headers.get("Authorization") != f"Bearer {held['token']}":
            return httpx.Response(401, json={"code": "unauthorized", "message": "bad token"})
        return serving_base(request)

    async def main():
        async with reconciler_for(kube, worker) as reconcile:
            await reconcile(("ml", "tiny"))  # creates the children and the pod
            held["token"] = _token_of(kube)  # what the pod's worker reads at start
            start_pod(kube)
            await reconcile(("ml", "tiny"))
            kube.objects[SECRET]["data"] = dict(data)
            kube.writes.clear()
            await reconcile(("ml", "tiny"))
            assert "patch Secret" in kube.writes
            fresh = _token_of(kube)
            assert len(fresh) >= 32 and fresh != held["token"]
            kube.writes.clear()
            await reconcile(("ml", "tiny"))  # the worker rejects the new token: its pod goes
            assert "delete tiny-r0-0" in kube.writes
            assert "patch Secret" not in kube.writes and _token_of(kube) == fresh

    asyncio.run(main())


@pytest.mark.parametrize(
    "edit",
    [
        {c.LABEL_MODEL: None},
        {c.LABEL_RANK: "x"},
        {c.LABEL_REPLICA: None},
        {c.LABEL_REPLICA: "3"},
    ],
    ids=["model-removed", "rank-not-a-number", "replica-removed", "replica-changed"],
)
def test_a_pod_whose_identity_labels_were_edited_is_replaced_not_created_over_and_over(edit):
    # The pod is this model's (its ownerReference says so) and holds the rank's name: creating the rank again can
    # only answer AlreadyExists, every second. It is found by name and replaced, which puts its labels back.
    kube = LabelListingKube()
    metrics = OperatorMetrics(CollectorRegistry())
    creates = []
    create = kube.create

    async def counting_create(manifest):
        creates.append(manifest["metadata"]["name"])
        return await create(manifest)

    kube.create = counting_create

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(503))) as http:
            reconcile = Reconciler(kube, WorkerFleet(http, metrics), metrics, CONFIG)
            await reconcile(("ml", "tiny"))
            start_pod(kube)
            labels = kube.objects[("Pod", "tiny-r0-0")]["metadata"]["labels"]
            for key, value in edit.items():
                if value is None:
                    labels.pop(key)
                else:
                    labels[key] = value
            creates.clear()
            kube.writes.clear()
            await reconcile(("ml", "tiny"))
            assert creates == [] and kube.writes[0] == "delete tiny-r0-0"
            await reconcile(("ml", "tiny"))
            assert creates == ["tiny-r0-0"]
            assert kube.objects[("Pod", "tiny-r0-0")]["metadata"]["labels"][c.LABEL_REPLICA] == "0"

    asyncio.run(main())


def test_one_missed_state_read_neither_rewrites_the_status_nor_posts_an_event():
    # A slow answer or a network blip: the rank still serves what it said a pass ago. Conditions people alert on
    # must not flip (and post two Events) for it.
    kube = MemoryKube()
    answer = {"ok": True}

    def worker(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/state":
            if not answer["ok"]:
                raise httpx.ReadTimeout("slow")
            return httpx.Response(200, json=worker_state("base"))
        return httpx.Response(200, json={"version": "base", "overall": "sum-base", "tensors": {}})

    async def main():
        async with reconciler_for(kube, worker) as reconcile:
            await reconcile(("ml", "tiny"))  # creates the children and the pod
            start_pod(kube)
            for _ in range(2):
                await reconcile(("ml", "tiny"))
            assert kube.model["status"]["phase"] == "Ready"
            before = copy.deepcopy(kube.model["status"])
            kube.writes.clear()
            answer["ok"] = False
            await reconcile(("ml", "tiny"))
            assert kube.writes == [] and kube.model["status"] == before
            answer["ok"] = True
            await reconcile(("ml", "tiny"))
            assert kube.writes == []

    asyncio.run(main())


def test_status_values_this_operator_does_not_know_do_not_stop_reconciling_and_are_rewritten():
    # A newer operator wrote a phase, a condition type and a rank state this one does not know, then was rolled back
    # (its CRD, which Helm never downgrades, accepts them). The spec is read strictly, the status leniently: what it
    # does not understand is dropped, and the pass writes the status anew.
    kube = MemoryKube()
    since = "2026-01-01T00:00:00Z"
    kube.model["status"] = {
        "phase": "Hibernating",
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "AllRanksReady", "lastTransitionTime": since},
            {"type": "Autoscaled", "status": "True", "reason": "ByKeda", "lastTransitionTime": since},
        ],
        "ranks": [{"pod": "tiny-r0-0", "replica": 0, "rank": 0, "state": "Migrating"}],
    }  # fmt: skip

    assert one_pass(kube) == 1.0
    assert "create Pod/tiny-r0-0" in kube.writes and "status" in kube.writes
    status = kube.model["status"]
    assert status["phase"] == "Pending" and status["ranks"][0]["state"] == "Pending"
    assert {cond["type"] for cond in status["conditions"]} == {
        "Ready", "Progressing", "Degraded", "Sleeping", "WeightsSynced"
    }  # fmt: skip
