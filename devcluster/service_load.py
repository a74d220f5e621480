"""A steady client load on a model's Service: N threads, each sending one greedy completion after another through the
official `openai` client (its own retries on), over `BalancingTransport` (see service_endpoints).

Each request records its attempts (which pod each went to, how it ended), its text and, when streamed, the arrival
time of every chunk. `LoadReport` sorts them the way the expert-parallel acceptance counts them, against the pods
that were failed on purpose ("victims"):
- a request that completed with the reference text, after attempts that failed on victims only, was retried by the
  client and is fine (counted: `retried_ok`);
- an attempt that failed on any other pod, a request that did not complete, or a text other than the reference is a
  survivor's loss.
Streamed requests also give the longest gap between two chunks of one request served by a survivor: what a client
saw of the group's interruption.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, cast

import httpx
import openai

from tidal.devcluster.service_endpoints import Attempt, BalancingTransport, scoped_request

BASE_URL = "http://service.devcluster.invalid/v1"  # the transport picks the endpoint; the host is never resolved


@dataclass
class RequestRecord:
    worker: int
    started: float
    ended: float = 0.0
    text: str | None = None
    error: str | None = None
    attempts: list[Attempt] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)

    @property
    def completed(self) -> bool:
        return self.text is not None and self.error is None

    @property
    def pods(self) -> set[str]:
        return {a.pod for a in self.attempts}

    def failed_on(self) -> list[str]:
        return [a.pod for a in self.attempts if a.failed]

    def longest_gap_s(self) -> float:
        times = self.chunk_times
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


@dataclass
class LoadReport:
    records: list[RequestRecord]
    reference: str
    victims: frozenset[str]

    @property
    def completed(self) -> list[RequestRecord]:
        return [r for r in self.records if r.completed]

    @property
    def wrong_text(self) -> list[RequestRecord]:
        return [r for r in self.completed if r.text != self.reference]

    @property
    def failed_attempts(self) -> Counter[str]:
        return Counter(pod for r in self.records for pod in r.failed_on())

    @property
    def retried_ok(self) -> list[RequestRecord]:
        """Completed after at least one failed attempt, all of them on victims."""
        return [r for r in self.completed if r.failed_on() and set(r.failed_on()) <= self.victims]

    @property
    def cut_on_victims(self) -> list[RequestRecord]:
        """Did not complete, and every failed attempt was on a victim (a stream cut mid-body is not retried)."""
        return [r for r in self.records if not r.completed and r.failed_on() and set(r.failed_on()) <= self.victims]

    @property
    def survivor_losses(self) -> list[RequestRecord]:
        """Everything else that went wrong: a failed attempt on a pod that was not a victim, a request that failed
        without one, or a text other than the reference."""
        lost = []
        for r in self.records:
            off_victims = set(r.failed_on()) - self.victims
            if off_victims or (r.completed and r.text != self.reference) or (not r.completed and not r.failed_on()):
                lost.append(r)
        return lost

    @property
    def longest_survivor_gap_s(self) -> float:
        served = [r for r in self.completed if not r.failed_on() and not (r.pods & self.victims)]
        return max((r.longest_gap_s() for r in served), default=0.0)

    def summary(self) -> dict[str, object]:
        return {
            "requests": len(self.records),
            "completed": len(self.completed),
            "retried_ok": len(self.retried_ok),
            "cut_on_victims": len(self.cut_on_victims),
            "failed_attempts": dict(self.failed_attempts),
            "survivor_losses": len(self.survivor_losses),
            "wrong_text": len(self.wrong_text),
            "longest_survivor_gap_s": round(self.longest_survivor_gap_s, 3),
            "examples": [
                {"error": r.error, "text": r.text, "attempts": [(a.pod, a.outcome) for a in r.attempts]}
                for r in self.survivor_losses[:3]
            ],
        }


class ServiceLoad:
    """Start with `start()`; `stop()` lets every request in flight finish and returns the report."""

    def __init__(
        self,
        transport: BalancingTransport,
        model: str,
        prompt: str,
        max_tokens: int,
        reference: str,
        streams: int = 8,
        stream: bool = False,
        timeout_s: float = 30.0,
        max_retries: int = 8,
    ) -> None:
        self._http = httpx.Client(transport=transport, timeout=timeout_s)
        # openai types http_client as its own httpx fork's Client and takes an httpx.Client as well (it checks both).
        self._client = openai.OpenAI(
            base_url=BASE_URL, api_key="unused", http_client=cast(Any, self._http), max_retries=max_retries,
            timeout=timeout_s,
        )  # fmt: skip
        self._model, self._prompt, self._max_tokens = model, prompt, max_tokens
        self.reference = reference
        self._stream = stream
        self._streams = streams
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self.records: list[RequestRecord] = []
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(streams)]

    def start(self) -> ServiceLoad:
        for thread in self._threads:
            thread.start()
        return self

    def count(self) -> int:
        with self._lock:
            return len(self.records)

    def wait_for_requests(self, n: int, timeout_s: float) -> None:
        """Block until `n` more requests than now have ended (the load is flowing)."""
        target, deadline = self.count() + n, time.monotonic() + timeout_s
        while self.count() < target:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{n} requests did not end within {timeout_s} s")
            time.sleep(0.05)

    def stop(self, victims: set[str] | frozenset[str] = frozenset(), timeout_s: float = 120.0) -> LoadReport:
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout_s)
        stuck = [t.name for t in self._threads if t.is_alive()]
        self._http.close()
        if stuck:
            raise TimeoutError(f"load threads {stuck} still in a request after {timeout_s} s")
        return LoadReport(list(self.records), self.reference, frozenset(victims))

    def _loop(self, worker: int) -> None:
        while not self._stopping.is_set():
            record = RequestRecord(worker, time.monotonic())
            with scoped_request() as scope:
                try:
                    record.text = self._streamed(record) if self._stream else self._whole()
                except Exception as exc:  # counted, never raised: the report decides what it means
                    record.error = f"{type(exc).__name__}: {exc}"
                record.attempts = list(scope.attempts)
            record.ended = time.monotonic()
            with self._lock:
                self.records.append(record)

    def _request_args(self) -> dict[str, object]:
        return {
            "model": self._model,
            "prompt": self._prompt,
            "max_tokens": self._max_tokens,
            "temperature": 0,
            "extra_body": {"ignore_eos": True},
        }

    def _whole(self) -> str:
        completion = self._client.completions.create(**self._request_args())  # type: ignore[call-overload]
        return str(completion.choices[0].text)

    def _streamed(self, record: RequestRecord) -> str:
        pieces = []
        finished = False
        for chunk in self._client.completions.create(stream=True, **self._request_args()):  # type: ignore[call-overload]
            if chunk.choices and chunk.choices[0].text:
                record.chunk_times.append(time.monotonic())
                pieces.append(chunk.choices[0].text)
            if chunk.choices and chunk.choices[0].finish_reason:
                finished = True
        if not finished:
            raise RuntimeError("the stream ended without a finish reason")
        return "".join(pieces)
