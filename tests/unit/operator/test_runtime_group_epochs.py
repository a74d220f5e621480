"""The executor's side of group epochs against fake workers (httpx.MockTransport): every member is called at once and
on its own, the pass does not wait, answers and refusals land in the model's memory (and reach the planner as a
SentEpoch), a refusal becomes one Warning Event, the model is queued again once all answered; the serving label is
patched on the pod; /state silence is counted per process."""

import asyncio
import json

import httpx
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from tidal.operator.metrics import OperatorMetrics
from tidal.operator.planner.actions import EpochMemberRef, ReconfigureGroup, SetServingLabel
from tidal.operator.runtime.execute import Context, execute
from tidal.operator.runtime.memory import ModelMemories, ModelMemory
from tidal.operator.runtime.workers import SUSPECT_STATE_TIMEOUT_S, Target, WorkerFleet

TOKEN = SecretStr("s" * 40)
TARGETS = {f"m-r0-{r}": Target(address=f"10.0.0.{r + 1}", uid=f"uid-{r}") for r in range(3)}


def _state(rank: int, epoch: int) -> dict:
    return {
        "sleep_state": "awake", "sleep_level": None, "resident": ["weights", "kv_cache"], "weights_version": "base",
        "model_loaded": True, "rank": rank, "world_size": 3, "group_epoch": epoch, "coordinator_rank": 0,
        "group_formed": True, "group": {"health": "serving", "members": [0, 1, 2]}, "in_flight_requests": 0,
    }  # fmt: skip


class FakeKube:
    def __init__(self) -> None:
        self.log: list[str] = []

    async def patch_pod_labels(self, namespace, name, labels):
        self.log.append(f"label {name} {labels}")

    async def post_event(self, body, type_, reason, message):
        self.log.append(f"event {type_} {reason}: {message}")


def _action(epoch: int = 5) -> ReconfigureGroup:
    members = [EpochMemberRef(rank=r, pod=f"m-r0-{r}", address=f"10.0.0.{r + 1}:7100") for r in range(3)]
    return ReconfigureGroup(
        replica=0, epoch=epoch, members=members, coordinator_rank=0, group_size=3, timeout_s=30.0, reason="t"
    )


def _run_epoch(handler, action: ReconfigureGroup):
    kube, memory, woken = FakeKube(), ModelMemory(), []
    metrics = OperatorMetrics(CollectorRegistry())

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            fleet = WorkerFleet(http, metrics)
            ctx = Context({"metadata": {"name": "m", "namespace": "ns"}}, "ns", "m", 8001, TARGETS, TOKEN, memory,
                          lambda: woken.append(True))  # fmt: skip
            done = await execute(kube, fleet, ctx, [action, SetServingLabel(pod="m-r0-1", serving=True)])
            in_flight = memory.sent_epochs()[0]
            await memory.epochs[0].task
            return done, in_flight

    done, in_flight = asyncio.run(main())
    return kube, memory, woken, done, in_flight


def test_every_member_gets_the_epoch_and_the_answers_land_in_memory():
    bodies = []

    async def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/group/reconfigure"
        body = json.loads(request.content)
        bodies.append((request.url.host, body))
        rank = int(request.url.host.rsplit(".", 1)[1]) - 1
        if rank == 2:
            await asyncio.sleep(0.05)  # a slow member: the others are answered meanwhile
        return httpx.Response(200, json={"applied": True, "state": _state(rank, body["epoch"])})

    kube, memory, woken, done, in_flight = _run_epoch(handler, _action())
    assert done.acted and done.epochs and in_flight.in_flight  # the pass went on before the answers
    assert sorted(host for host, _ in bodies) == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    assert bodies[0][1]["members"] == [{"rank": r, "address": f"10.0.0.{r + 1}:7100"} for r in range(3)]
    assert bodies[0][1]["coordinator_rank"] == 0 and bodies[0][1]["timeout_s"] == 30.0
    answered = memory.sent_epochs()[0]
    assert answered.answered and not answered.refused and answered.applied_at is not None
    assert kube.log == ["label m-r0-1 {'tidal.dev/serving': 'true'}"] and woken == [True]


def test_a_refusal_is_recorded_and_posted_once():
    async def handler(request: httpx.Request) -> httpx.Response:
        rank = int(request.url.host.rsplit(".", 1)[1]) - 1
        if rank == 0:
            return httpx.Response(409, json={"code": "experts_unavailable", "message": "2 slots missing"})
        return httpx.Response(409, json={"code": "group_unreachable", "message": "the coordinator refused"})

    kube, memory, woken, _, _ = _run_epoch(handler, _action())
    sent = memory.sent_epochs()[0]
    assert sent.refused and [(r.rank, r.code) for r in sent.refusals] == [
        (0, "experts_unavailable"), (1, "group_unreachable"), (2, "group_unreachable"),
    ]  # fmt: skip
    refusals = [line for line in kube.log if "ReconfigureRefused" in line]
    assert len(refusals) == 1 and "rank 0: experts_unavailable: 2 slots missing" in refusals[0]
    assert woken == [True]


def test_a_newer_epoch_supersedes_and_forgetting_stops_the_calls():
    memories = ModelMemories()
    memory = memories.of(("ns", "m"))
    never = asyncio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        await never.wait()
        return httpx.Response(500)

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            fleet = WorkerFleet(http, OperatorMetrics(CollectorRegistry()))

            async def report(flight):
                raise AssertionError("a superseded epoch reports nothing")

            first = fleet.start_epoch(memory, _action(5), TARGETS, 8001, TOKEN, report)
            second = fleet.start_epoch(memory, _action(6), TARGETS, 8001, TOKEN, report)
            assert memory.epochs[0] is second
            memories.forget(("ns", "m"))
            await asyncio.gather(first.task, second.task, return_exceptions=True)
            assert first.task.cancelled() and second.task.cancelled()

    asyncio.run(main())


def test_state_silence_is_counted_from_the_first_miss_per_process():
    calls = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        raise httpx.ConnectTimeout("frozen")

    memory = ModelMemory()

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            fleet = WorkerFleet(http, OperatorMetrics(CollectorRegistry()))
            target = {"m-r0-0": TARGETS["m-r0-0"]}
            first = await fleet.observe(("ns", "m"), memory, target, 8001, TOKEN, 0.1)
            await asyncio.sleep(0.05)
            second = await fleet.observe(("ns", "m"), memory, target, 8001, TOKEN, 0.1)
            return first["m-r0-0"], second["m-r0-0"]

    first, second = asyncio.run(main())
    assert first.state is None and first.silent_for_s is not None
    assert second.silent_for_s >= first.silent_for_s + 0.05
    assert (first.missed_reads, second.missed_reads) == (1, 2) and second.last_state is None  # it never answered
    assert set(memory.state_misses) == {"uid-0"}


def test_a_rank_that_missed_its_last_state_gets_a_short_timeout():
    timeouts: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        timeouts.append(request.extensions["timeout"]["read"])
        raise httpx.ReadTimeout("frozen")

    memory = ModelMemory()

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            fleet = WorkerFleet(http, OperatorMetrics(CollectorRegistry()))
            target = {"m-r0-0": TARGETS["m-r0-0"]}
            for _ in range(2):
                await fleet.observe(("ns", "m"), memory, target, 8001, TOKEN, 0.3)

    asyncio.run(main())
    # The suspect's call cannot hold the pass that may reconfigure its survivors.
    assert timeouts == [0.3, SUSPECT_STATE_TIMEOUT_S]
