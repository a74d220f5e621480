"""The executor's side of group epochs against fake workers (httpx.MockTransport): every member is called at once and
on its own, the pass does not wait, answers and refusals land in the model's memory (and reach the planner as a
SentEpoch), a refusal becomes one Warning Event, the model is queued again once all answered; the serving label is
patched on the pod; /state silence is counted per process, and a suspect rank's /state holds no pass yet counts when
it comes late."""

import asyncio
import gc
import itertools
import json

import httpx
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from tidal.operator.metrics import OperatorMetrics
from tidal.operator.planner.actions import EpochMemberRef, ReconfigureGroup, SetServingLabel
from tidal.operator.runtime.execute import Context, execute
from tidal.operator.runtime.memory import ModelMemories, ModelMemory, StateAnswer
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


class _Rank:
    """A fake worker's `/state`: each call answers after the next of `delays` (the last repeats); a call whose delay
    exceeds its read timeout fails as httpx would (MockTransport applies no timeout itself). Records each call's
    timeout, how many are in flight at most, and whether one was cancelled."""

    def __init__(self, *delays: float) -> None:
        self.delays = list(delays)
        self.timeouts: list[float] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.cancelled = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/weights/checksum":
            return httpx.Response(200, json={"version": "base", "overall": "c" * 64, "tensors": {}})
        timeout = request.extensions["timeout"]["read"]
        self.timeouts.append(timeout)
        delay = self.delays.pop(0) if len(self.delays) > 1 else self.delays[0]
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(min(delay, timeout))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1
        if delay > timeout:
            raise httpx.ReadTimeout("frozen")
        return httpx.Response(200, json=_state(0, len(self.timeouts)))  # its epoch: which call this answers


async def _timed_observe(fleet, memory, target, timeout):
    started = asyncio.get_running_loop().time()
    seen = await fleet.observe(("ns", "m"), memory, target, 8001, TOKEN, timeout)
    return seen["m-r0-0"], asyncio.get_running_loop().time() - started


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


def test_a_rank_that_missed_its_last_state_gets_a_short_wait():
    timeouts: list[float] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        timeouts.append(request.extensions["timeout"]["read"])
        if len(timeouts) > 1:
            await asyncio.Event().wait()  # a call that never ends: only the pass's own wait bounds it
        raise httpx.ReadTimeout("frozen")

    memory = ModelMemory()

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            fleet = WorkerFleet(http, OperatorMetrics(CollectorRegistry()))
            target = {"m-r0-0": TARGETS["m-r0-0"]}
            await fleet.observe(("ns", "m"), memory, target, 8001, TOKEN, 0.3)
            second, seconds = await _timed_observe(fleet, memory, target, 0.3)
            memory.stop()
            return second, seconds

    second, seconds = asyncio.run(main())
    # The suspect's call cannot hold the pass that may reconfigure its survivors (though it is asked with the whole
    # timeout, and goes on after the pass).
    assert seconds < SUSPECT_STATE_TIMEOUT_S + 0.1 and second.missed_reads == 2
    assert timeouts == [0.3, 0.3]


def test_a_slow_rank_that_missed_once_gets_its_answers_counted():
    # It stalled once (past the 0.3 s timeout), then answers every /state in 0.2 s: slower than a suspect's wait, well
    # within the timeout. Its answer must count, or its silence grows until it is failed and its pod deleted.
    rank = _Rank(1.0, 0.2)
    memory = ModelMemory()

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(rank)) as http:
            fleet = WorkerFleet(http, OperatorMetrics(CollectorRegistry()))
            target = {"m-r0-0": TARGETS["m-r0-0"]}
            first, _ = await _timed_observe(fleet, memory, target, 0.3)
            passes = []
            for _ in range(4):
                await asyncio.sleep(0.1)  # the next pass (the group timer's are 0.5 s apart)
                passes.append(await _timed_observe(fleet, memory, target, 0.3))
                if passes[-1][0].state is not None:
                    break
            return first, passes

    first, passes = asyncio.run(main())
    assert first.state is None and first.missed_reads == 1
    seen = [obs for obs, _ in passes]
    assert seen[-1].state is not None and seen[-1].state.group_epoch == 2 and len(seen) <= 3
    assert all(obs.state is None for obs in seen[:-1]) and "uid-0" not in memory.state_misses
    assert memory.state_answers["uid-0"] == StateAnswer(seen[-1].state, "c" * 64)  # then its checksum is read
    # No pass waited for it much longer than a suspect's wait.
    assert all(seconds < SUSPECT_STATE_TIMEOUT_S + 0.1 for _, seconds in passes), passes


def test_a_frozen_rank_holds_no_pass_and_its_silence_grows():
    rank = _Rank(60.0)  # never answers: every call times out
    memory = ModelMemory()

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(rank)) as http:
            fleet = WorkerFleet(http, OperatorMetrics(CollectorRegistry()))
            target = {"m-r0-0": TARGETS["m-r0-0"]}
            seen = [await _timed_observe(fleet, memory, target, 0.3)]
            for _ in range(8):
                await asyncio.sleep(0.05)
                seen.append(await _timed_observe(fleet, memory, target, 0.3))
            memory.stop()
            return seen

    seen = asyncio.run(main())
    assert seen[0][1] >= 0.3  # the first miss takes the whole timeout
    # The suspect's call cannot hold the pass that may reconfigure its survivors.
    assert all(seconds < SUSPECT_STATE_TIMEOUT_S + 0.1 for _, seconds in seen[1:]), seen
    assert [obs.missed_reads for obs, _ in seen] == list(range(1, 10))
    silences = [obs.silent_for_s for obs, _ in seen]
    assert all(later > earlier for earlier, later in itertools.pairwise(silences))
    assert all(obs.state is None and obs.last_state is None for obs, _ in seen)
    # Each call is given the whole timeout (an answer within it counts), and a suspect has one call at a time.
    assert set(rank.timeouts) == {0.3} and rank.most_in_flight == 1 and len(rank.timeouts) < len(seen)


def test_the_state_call_of_a_gone_pod_or_model_is_cancelled():
    rank = _Rank(60.0)
    memories = ModelMemories()
    memory = memories.of(("ns", "m"))

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(rank)) as http:
            fleet = WorkerFleet(http, OperatorMetrics(CollectorRegistry()))
            target = {"m-r0-0": TARGETS["m-r0-0"]}
            replaced = {"m-r0-0": Target(address="10.0.0.1", uid="uid-new")}
            for _ in range(2):
                await fleet.observe(("ns", "m"), memory, target, 8001, TOKEN, 0.3)
            assert rank.in_flight == 1 and not rank.cancelled  # the suspect's call goes on after the pass
            assert "uid-0" in memory.state_misses
            await fleet.observe(("ns", "m"), memory, replaced, 8001, TOKEN, 0.0)  # the pod was replaced
            await asyncio.sleep(0.01)
            assert (rank.cancelled, rank.in_flight) == (1, 0) and "uid-0" not in memory.state_misses
            # The model is deleted while a pass waits for the suspect's call: the call stops, the pass sees a miss.
            waiting = asyncio.create_task(fleet.observe(("ns", "m"), memory, replaced, 8001, TOKEN, 0.3))
            await asyncio.sleep(0.01)
            assert rank.in_flight == 1
            memories.forget(("ns", "m"))
            return (await waiting)["m-r0-0"]

    seen = asyncio.run(main())
    assert (rank.cancelled, rank.in_flight) == (2, 0)
    assert seen.state is None and seen.missed_reads == 2


def test_a_late_answer_older_than_the_timeout_is_not_this_pass_read():
    # The suspect's call is answered 0.1 s after the pass stopped waiting, but the next pass comes only 0.5 s later:
    # that answer is older than a direct read's could be. It still shows the rank answers, so it is asked again with
    # the whole timeout, and that fresh answer is the read.
    rank = _Rank(1.0, 0.1, 0.0)
    memory = ModelMemory()

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(rank)) as http:
            fleet = WorkerFleet(http, OperatorMetrics(CollectorRegistry()))
            target = {"m-r0-0": TARGETS["m-r0-0"]}
            seen = []
            for pause in (0.0, 0.0, 0.5):
                await asyncio.sleep(pause)
                seen.append((await _timed_observe(fleet, memory, target, 0.3))[0])
            return seen

    first, second, third = asyncio.run(main())
    assert (first.missed_reads, second.missed_reads) == (1, 2) and second.state is None
    assert third.state is not None and third.state.group_epoch == 3 and third.missed_reads == 0
    assert rank.timeouts == [0.3, 0.3, 0.3] and not memory.state_misses and not memory.state_probes


def test_a_failed_state_call_dropped_unread_logs_nothing():
    # A pass still running for a forgotten model writes into its detached memory, which nobody prunes or stops: the
    # suspect's call it started fails on its own and is dropped with it, unread.
    rank = _Rank(1.0)
    errors: list[dict] = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        memory = ModelMemory()
        async with httpx.AsyncClient(transport=httpx.MockTransport(rank)) as http:
            fleet = WorkerFleet(http, OperatorMetrics(CollectorRegistry()))
            target = {"m-r0-0": TARGETS["m-r0-0"]}
            for _ in range(2):
                await fleet.observe(("ns", "m"), memory, target, 8001, TOKEN, 0.08)
            await asyncio.sleep(0.1)  # the suspect's call fails after the pass
            assert memory.state_probes["uid-0"].done()
            del memory
            gc.collect()
            await asyncio.sleep(0)

    asyncio.run(main())
    assert errors == []
