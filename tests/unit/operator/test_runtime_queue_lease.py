"""The runtime's pure-ish parts without a cluster: the coalescing reconcile queue and the Lease elector (against an
in-memory Lease API with real compare-and-swap on resourceVersion)."""

import asyncio
import copy
import json
import time
from types import SimpleNamespace

from kubernetes.client.exceptions import ApiException

from tidal.operator.kube.lease import LeaseElector
from tidal.operator.runtime.queue import ReconcileQueue


def test_requests_during_a_pass_coalesce_into_one_more_pass():
    async def main() -> list[int]:
        runs: list[int] = []
        gate = asyncio.Event()

        async def reconcile(key, asked_at):
            runs.append(len(runs))
            if len(runs) == 1:
                await gate.wait()
            return None

        queue = ReconcileQueue(reconcile)
        first = asyncio.create_task(queue.request(("ns", "m")))
        await asyncio.sleep(0)
        others = [asyncio.create_task(queue.request(("ns", "m"))) for _ in range(5)]
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(first, *others)
        return runs

    assert asyncio.run(main()) == [0, 1]  # the first pass, then one pass for all five requests


def test_a_pass_that_waited_behind_another_counts_from_its_first_request():
    async def main() -> tuple[list[float], float]:
        asked: list[float] = []
        gate = asyncio.Event()

        async def reconcile(key, asked_at):
            asked.append(asked_at)
            if len(asked) == 1:
                await gate.wait()
            return None

        queue = ReconcileQueue(reconcile)
        first = asyncio.create_task(queue.request(("ns", "m")))
        await asyncio.sleep(0)
        event_time = time.monotonic()
        second = asyncio.create_task(queue.request(("ns", "m")))  # the event that a failure happened
        await asyncio.sleep(0.05)
        later = asyncio.create_task(queue.request(("ns", "m")))  # coalesced: the first request's time stands
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(first, second, later)
        return asked, event_time

    asked, event_time = asyncio.run(main())
    assert len(asked) == 2 and event_time <= asked[1] < event_time + 0.04


def test_requeue_timer_brings_the_model_back_and_forget_stops_it():
    async def main() -> tuple[int, int]:
        calls = {"a": 0, "b": 0}

        async def reconcile(key, asked_at):
            calls[key[1]] += 1
            return 0.01

        queue = ReconcileQueue(reconcile)
        await queue.request(("ns", "a"))
        await queue.request(("ns", "b"))
        queue.forget(("ns", "b"))
        await asyncio.sleep(0.1)
        await queue.close()
        return calls["a"], calls["b"]

    a, b = asyncio.run(main())
    assert a >= 3 and b == 1


def test_an_earlier_timer_wins():
    async def main() -> int:
        calls = []

        async def reconcile(key, asked_at):
            calls.append(key)
            return None

        queue = ReconcileQueue(reconcile)
        await queue.request(("ns", "a"))
        queue.schedule(("ns", "a"), 0.02)
        queue.schedule(("ns", "a"), 30)  # later: ignored
        await asyncio.sleep(0.1)
        await queue.close()
        return len(calls)

    assert asyncio.run(main()) == 2


def test_forget_during_a_pass_does_not_let_a_second_pass_run_beside_it():
    # The model is deleted (kopf's DELETED event -> forget) while a pass runs, and re-created (or one of its pods
    # changes) at once: the next pass must wait for the running one, not start beside it on a fresh lock.
    async def main() -> tuple[int, int]:
        running, most = [0], [0]
        gate = asyncio.Event()

        async def reconcile(key, asked_at):
            running[0] += 1
            most[0] = max(most[0], running[0])
            await gate.wait()
            running[0] -= 1
            return 0.01

        queue = ReconcileQueue(reconcile)
        key = ("ns", "m")
        first = asyncio.create_task(queue.request(key))
        await asyncio.sleep(0)
        queue.forget(key)
        second = asyncio.create_task(queue.request(key))
        await asyncio.sleep(0.01)
        gate.set()
        await asyncio.gather(first, second)
        await queue.close()
        return most[0], len(queue.keys())

    most, keys = asyncio.run(main())
    assert most == 1
    assert keys == 1  # the second pass started after the forget, so its timer stands


def test_a_pass_cut_short_by_forget_leaves_no_timer_behind():
    async def main() -> tuple[int, list]:
        calls = [0]
        gate = asyncio.Event()

        async def reconcile(key, asked_at):
            calls[0] += 1
            await gate.wait()
            return 0.01  # the pass acted before it learnt of the deletion

        queue = ReconcileQueue(reconcile)
        first = asyncio.create_task(queue.request(("ns", "m")))
        await asyncio.sleep(0)
        queue.forget(("ns", "m"))
        gate.set()
        await first
        await asyncio.sleep(0.05)
        await queue.close()
        return calls[0], queue.keys()

    assert asyncio.run(main()) == (1, [])


class FakeLeases:
    """Just enough of CoordinationV1Api: read, create, replace with resourceVersion compare-and-swap."""

    def __init__(self) -> None:
        self.obj: dict | None = None
        self.version = 0

    def _resp(self, obj):
        return SimpleNamespace(data=json.dumps(obj).encode())

    def read_namespaced_lease(self, name, namespace, **_):
        if self.obj is None:
            raise ApiException(status=404)
        return self._resp(self.obj)

    def create_namespaced_lease(self, namespace, body, **_):
        if self.obj is not None:
            raise ApiException(status=409)
        self.version += 1
        self.obj = copy.deepcopy(body)
        self.obj["metadata"]["resourceVersion"] = str(self.version)
        return self._resp(self.obj)

    def replace_namespaced_lease(self, name, namespace, body, **_):
        if body["metadata"].get("resourceVersion") != self.obj["metadata"]["resourceVersion"]:
            raise ApiException(status=409)
        self.version += 1
        self.obj = copy.deepcopy(body)
        self.obj["metadata"]["resourceVersion"] = str(self.version)
        return self._resp(self.obj)


def test_one_leader_at_a_time_and_takeover_after_expiry():
    api, now = FakeLeases(), [0.0]
    a = LeaseElector(api, "sys", "lease", "a", 15, clock=lambda: now[0])
    b = LeaseElector(api, "sys", "lease", "b", 15, clock=lambda: now[0])
    assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    now[0] = 10
    assert a.try_acquire_or_renew()  # renewed: b saw a change, its expiry clock restarts
    now[0] = 20
    assert not b.try_acquire_or_renew()
    now[0] = 36  # a stopped renewing 26 s ago; b has seen the same record for 16 s
    assert b.try_acquire_or_renew()
    assert api.obj["spec"]["holderIdentity"] == "b" and api.obj["spec"]["leaseTransitions"] == 1
    assert not a.try_acquire_or_renew()  # a is not leader any more


def test_release_hands_over_at_once_and_stale_writes_lose():
    api = FakeLeases()
    a = LeaseElector(api, "sys", "lease", "a", 15, clock=lambda: 0.0)
    b = LeaseElector(api, "sys", "lease", "b", 15, clock=lambda: 0.0)
    assert a.try_acquire_or_renew()
    a.release()
    assert b.try_acquire_or_renew()
    stale = copy.deepcopy(api.obj)
    stale["metadata"]["resourceVersion"] = "0"
    try:
        api.replace_namespaced_lease("lease", "sys", stale)
        raise AssertionError("a stale write must fail")
    except ApiException as exc:
        assert exc.status == 409
