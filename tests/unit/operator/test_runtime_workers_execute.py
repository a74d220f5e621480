"""The worker control client against an in-process fake worker (httpx.MockTransport), the checksums and failed updates
the fleet leaves in a model's memory, and the executor's phases and log lines, all without a cluster."""

import asyncio
import base64
import json
import logging
import typing

import httpx
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from tidal.operator.api.status import InferenceModelStatus, WeightsRolloutStatus
from tidal.operator.metrics import OperatorMetrics
from tidal.operator.planner.actions import (
    Action,
    CreatePod,
    CreateSecret,
    EmitEvent,
    PatchStatus,
    SleepRank,
    UpdateWeights,
    WakeRank,
)
from tidal.operator.planner.observed import controlled_by
from tidal.operator.runtime.execute import (
    CHILD_ACTIONS,
    GROUP_ACTIONS,
    POD_ACTIONS,
    STATUS_ACTIONS,
    WORKER_ACTIONS,
    Context,
    execute,
    status_patch,
)
from tidal.operator.runtime.memory import ModelMemory
from tidal.operator.runtime.observe import read_token, targets_of
from tidal.operator.runtime.workers import CallFailure, Target, WorkerFleet
from tidal.operator.workerclient import WorkerCallError, WorkerClient

TOKEN = SecretStr("s" * 40)


def _state(version: str = "base", asleep: bool = False, source: str | None = None) -> dict:
    return {
        "sleep_state": "asleep" if asleep else "awake", "sleep_level": 1 if asleep else None,
        "resident": [] if asleep else ["weights", "kv_cache"], "weights_version": version, "weights_source": source,
        "model_loaded": True,
        "rank": 0, "world_size": 1, "group_epoch": 0, "coordinator_rank": 0, "group_formed": True,
        "in_flight_requests": 0, "seconds_since_last_request": None,
    }  # fmt: skip


class FakeWorker:
    def __init__(self) -> None:
        self.version = "base"
        self.source = "/m/base"
        self.calls: list[str] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(f"{request.method} {request.url.path}")
        if request.headers.get("Authorization") != f"Bearer {TOKEN.get_secret_value()}":
            return httpx.Response(401, json={"code": "unauthorized", "message": "bad token"})
        if request.url.path == "/state":
            return httpx.Response(200, json=_state(self.version, source=self.source))
        if request.url.path == "/weights/checksum":
            return httpx.Response(200, json={"version": self.version, "overall": f"sum-{self.version}", "tensors": {}})
        if request.url.path == "/weights/update":
            body = json.loads(request.content)
            if body["source"].endswith("busy"):
                return httpx.Response(409, json={"code": "busy", "message": "another operation is running"})
            if body["source"].endswith("broken"):
                return httpx.Response(400, json={"code": "bad_checkpoint", "message": "truncated file"})
            self.version, self.source = body["version"], body["source"]
            return httpx.Response(
                200, json={"version": self.version, "checksum": f"sum-{self.version}", "duration_s": 0.1,
                           "bytes_loaded": 10},
            )  # fmt: skip
        return httpx.Response(404, json={"code": "not_found", "message": request.url.path})


def _run(coro):
    return asyncio.run(coro)


def test_client_sends_the_token_and_raises_the_workers_error():
    worker = FakeWorker()

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(worker.handle)) as http:
            state = await WorkerClient(http, "10.0.0.1", 8001, TOKEN).state()
            assert state.weights_version == "base"
            try:
                await WorkerClient(http, "10.0.0.1", 8001, SecretStr("wrong-token-" * 4)).state()
                raise AssertionError("expected 401")
            except WorkerCallError as exc:
                assert exc.code == "unauthorized"
            try:
                await WorkerClient(http, "10.0.0.1", 8001, TOKEN).update_weights("/m/broken", "v2")
                raise AssertionError("expected a refusal")
            except WorkerCallError as exc:
                assert (exc.code, exc.message) == ("bad_checkpoint", "truncated file")

    _run(main())


def test_unreachable_worker_is_an_error_with_its_own_code():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as http:
            try:
                await WorkerClient(http, "10.0.0.1", 8001, TOKEN).state()
            except WorkerCallError as exc:
                return exc.code

    assert _run(main()) == "unreachable"


def test_fleet_caches_checksums_per_pod_and_remembers_failed_updates():
    worker = FakeWorker()
    metrics = OperatorMetrics(CollectorRegistry())
    key, targets, memory = ("ns", "m"), {"m-r0-0": Target("10.0.0.1", "uid-1")}, ModelMemory()

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(worker.handle)) as http:
            fleet = WorkerFleet(http, metrics)
            first = await fleet.observe(key, memory, targets, 8001, TOKEN)
            await fleet.observe(key, memory, targets, 8001, TOKEN)
            assert first["m-r0-0"].checksum == "sum-base"
            assert worker.calls.count("GET /weights/checksum") == 1  # cached for (uid, version, source)
            assert memory.checksums == {("uid-1", "base", "/m/base"): "sum-base"}
            busy = await fleet.update_weights(
                memory, [UpdateWeights(pod="m-r0-0", replica=0, source="/m/busy", version="v2")], targets, 8001, TOKEN
            )
            assert [f.message for f in busy] == ["another operation is running"]
            seen = await fleet.observe(key, memory, targets, 8001, TOKEN)
            assert seen["m-r0-0"].update_failure is None  # busy is "not now": the roll is not stopped
            failed = await fleet.update_weights(
                memory, [UpdateWeights(pod="m-r0-0", replica=0, source="/m/broken", version="v2")], targets, 8001, TOKEN
            )
            assert [f.message for f in failed] == ["truncated file"]
            seen = await fleet.observe(key, memory, targets, 8001, TOKEN)
            assert seen["m-r0-0"].update_failure.version == "v2"
            assert seen["m-r0-0"].update_failure.source == "/m/broken"
            assert "bad_checkpoint" in seen["m-r0-0"].update_failure.message
            ok = await fleet.update_weights(
                memory, [UpdateWeights(pod="m-r0-0", replica=0, source="/m/good", version="v3")], targets, 8001, TOKEN
            )
            assert ok == [None]
            seen = await fleet.observe(key, memory, targets, 8001, TOKEN)
            assert seen["m-r0-0"].update_failure is None and seen["m-r0-0"].checksum == "sum-v3"
            assert worker.calls.count("GET /weights/checksum") == 1  # the update's answer carried it
            # The pod is replaced: the old process's checksums go with it.
            await fleet.observe(key, memory, {"m-r0-0": Target("10.0.0.1", "uid-2")}, 8001, TOKEN)
            assert set(memory.checksums) == {("uid-2", "v3", "/m/good")}

    _run(main())


def test_fleet_marks_a_rank_that_rejects_the_token():
    worker = FakeWorker()
    metrics = OperatorMetrics(CollectorRegistry())
    key, targets = ("ns", "m"), {"m-r0-0": Target("10.0.0.1", "uid-1")}

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(worker.handle)) as http:
            fleet = WorkerFleet(http, metrics)
            good = await fleet.observe(key, ModelMemory(), targets, 8001, TOKEN)
            other = await fleet.observe(key, ModelMemory(), targets, 8001, SecretStr("o" * 40))
            return good["m-r0-0"], other["m-r0-0"]

    good, other = _run(main())
    assert not good.token_rejected and good.state is not None
    assert other.token_rejected and other.state is None


def test_status_patch_removes_cleared_fields_but_keeps_lists_free_of_nulls():
    status = InferenceModelStatus.model_validate(
        {"phase": "Ready", "ranks": [{"pod": "p", "replica": 0, "rank": 0, "state": "Pending"}]}
    )
    patch = status_patch(status)
    assert patch["weightsRollout"] is None and patch["weightsVersion"] is None
    assert patch["ranks"] == [{"pod": "p", "replica": 0, "rank": 0, "state": "Pending"}]
    held = status.model_copy(update={"weights_rollout": WeightsRolloutStatus(failed_version="x", message="m")})
    # Inside an object a null removes the field too (merge patch), so a source held before is not kept.
    assert status_patch(held)["weightsRollout"] == {"failedVersion": "x", "failedSource": None, "message": "m"}


class FakeKube:
    def __init__(self) -> None:
        self.log: list[str] = []

    async def create(self, manifest):
        self.log.append(f"create {manifest['metadata']['name']}")
        return manifest["kind"] != "Secret"  # the Secret "already exists"

    async def patch_status(self, namespace, name, status):
        self.log.append("status")

    async def post_event(self, body, type_, reason, message):
        self.log.append(f"event {reason}")


class RecordingFleet:
    """Sleeps succeed; wakes are answered "busy"; weight updates are refused."""

    def __init__(self, kube: FakeKube) -> None:
        self.kube = kube

    async def transition(self, actions, targets, port, token):
        self.kube.log += [f"{a.describe()}" for a in actions]
        return [
            None if isinstance(a, SleepRank) else CallFailure(a.pod, "wake_up", "another operation", "busy")
            for a in actions
        ]

    async def update_weights(self, memory, actions, targets, port, token):
        self.kube.log += [f"{a.describe()}" for a in actions]
        return [CallFailure(a.pod, "weights/update", "truncated file", "bad_checkpoint") for a in actions]


def _context(token: SecretStr | None = TOKEN) -> Context:
    body = {"metadata": {"name": "m", "namespace": "ns"}}
    return Context(body, "ns", "m", 8001, {}, token, ModelMemory())


SECRET = CreateSecret(manifest={"kind": "Secret", "metadata": {"name": "m-token"}, "data": {"token": "hidden"}})


def test_executor_acts_on_kubernetes_then_posts_events_and_writes_status_then_calls_workers():
    kube = FakeKube()
    actions = [
        SleepRank(pod="m-r0-0", level=1),
        CreatePod(manifest={"kind": "Pod", "metadata": {"name": "m-r1-0", "namespace": "ns"}}, reason="missing"),
        PatchStatus(status=InferenceModelStatus()),
        EmitEvent(type="Normal", reason="Synced", message="m"),
        SECRET,
    ]
    done = _run(execute(kube, RecordingFleet(kube), _context(), actions))
    # Events before the status patch: an operator killed between the two would otherwise never post them (the next
    # one finds no transition against the status already written).
    assert kube.log == [
        "create m-token", "create m-r1-0", "event Synced", "status", "sleep m-r0-0 (level 1)",
    ]  # fmt: skip
    assert done.acted and done.changed_objects and done.calls == 1 and done.failures == []


def test_executor_logs_each_action_once_with_its_outcome(caplog):
    kube = FakeKube()
    actions = [
        SECRET,
        CreatePod(manifest={"kind": "Pod", "metadata": {"name": "m-r1-0", "namespace": "ns"}}, reason="missing"),
        SleepRank(pod="m-r0-0", level=1),
        WakeRank(pod="m-r2-0"),
        UpdateWeights(pod="m-r3-0", replica=3, source="/m/broken", version="v2"),
        PatchStatus(status=InferenceModelStatus()),
    ]
    with caplog.at_level(logging.INFO, logger="tidal.operator.execute"):
        done = _run(execute(kube, RecordingFleet(kube), _context(), actions))
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "ns/m: create Secret m-token: already exists"),
        ("INFO", "ns/m: create pod m-r1-0 (missing): created"),
        ("INFO", "ns/m: patch status (phase Pending, ready 0/0): written"),
        ("INFO", "ns/m: sleep m-r0-0 (level 1): done"),
        ("WARNING", "ns/m: wake m-r2-0: failed: busy: another operation (asked again on a later pass)"),
        ("WARNING", "ns/m: update weights of m-r3-0 to v2 from /m/broken: failed: bad_checkpoint: truncated file"),
    ]
    assert "hidden" not in caplog.text
    # Each failed call is also an Event on the model, after the calls.
    assert kube.log[-2:] == ["event WorkerUnavailable", "event WeightsUpdateFailed"]
    assert done.calls == 3 and len(done.failures) == 2 and [u.pod for u in done.updates] == ["m-r3-0"]


def test_executor_without_a_token_skips_the_worker_calls_and_says_so(caplog):
    kube = FakeKube()
    with caplog.at_level(logging.INFO, logger="tidal.operator.execute"):
        done = _run(execute(kube, RecordingFleet(kube), _context(token=None), [WakeRank(pod="m-r0-0")]))
    assert [r.getMessage() for r in caplog.records] == ["ns/m: wake m-r0-0: skipped: no control token yet"]
    assert kube.log == [] and not done.acted and done.calls == 0


def test_every_kind_of_action_has_exactly_one_phase():
    union = typing.get_args(Action)[0]
    kinds = set(typing.get_args(union))
    phases = [GROUP_ACTIONS, CHILD_ACTIONS, POD_ACTIONS, STATUS_ACTIONS, WORKER_ACTIONS]
    assert sum(len(p) for p in phases) == len(kinds)  # no kind in two phases
    assert set().union(*phases) == kinds  # and none left out


def test_observe_helpers():
    secret = {"data": {"token": base64.b64encode(b"t" * 40).decode()}}
    assert read_token(secret).get_secret_value() == "t" * 40
    assert read_token(None) is None and read_token({"data": {"token": "!!"}}) is None
    pod = {
        "metadata": {"name": "m-r0-0", "uid": "u1", "ownerReferences": [{"uid": "model-uid", "controller": True}]},
        "status": {"phase": "Running", "podIP": "127.0.0.5"},
    }
    assert controlled_by(pod, "model-uid") and not controlled_by(pod, "other")
    assert targets_of([pod]) == {"m-r0-0": Target("127.0.0.5", "u1")}
    pending = {**pod, "status": {"phase": "Pending"}}
    assert targets_of([pending]) == {}
