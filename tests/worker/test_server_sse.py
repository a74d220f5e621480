"""The SSE response frees its request on every exit: normal end, a client that stops reading, a disconnect.

These drive the ASGI response directly with a `send` that behaves like a stuck or vanished client, which is hard to
provoke reliably through real sockets (kernel buffers absorb megabytes first). The end-to-end disconnect test, with
the real engine, is in test_server_e2e.py.
"""

from __future__ import annotations

import asyncio

from tidal.worker.server.streaming import DONE, SSEResponse

SCOPE = {"type": "http", "asgi": {"spec_version": "2.3"}}


def _events(count: int, produced: list[int]):
    async def gen():
        for i in range(count):
            produced.append(i)
            yield f"data: {i}\n\n"
        yield DONE

    return gen()


async def _never_disconnects() -> dict:
    await asyncio.Event().wait()
    return {}


def test_normal_end_closes_once():
    closed: list[bool] = []
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def run():
        response = SSEResponse(_events(3, []), on_close=lambda: closed.append(True), write_timeout_s=1.0)
        await response(SCOPE, _never_disconnects, send)

    asyncio.run(run())
    assert closed == [True]
    assert sent[0]["headers"] and (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert sent[-2]["body"] == DONE.encode()
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


def test_client_that_stops_reading_is_dropped_after_the_write_timeout():
    closed: list[bool] = []
    produced: list[int] = []
    sent: list[dict] = []

    async def stuck_send(message):
        sent.append(message)
        if len(sent) > 2:  # headers and one chunk got through, then the client's window stays full
            await asyncio.Event().wait()

    async def run():
        response = SSEResponse(_events(1000, produced), on_close=lambda: closed.append(True), write_timeout_s=0.2)
        await asyncio.wait_for(response(SCOPE, _never_disconnects, stuck_send), timeout=10)

    asyncio.run(run())
    assert closed == [True]
    assert len(produced) < 5  # generation did not run ahead of the stuck client


def test_disconnect_cancels_the_stream_and_closes():
    closed: list[bool] = []
    produced: list[int] = []
    disconnect = asyncio.Event()

    async def slow_events():
        for i in range(1000):
            produced.append(i)
            if i == 3:
                disconnect.set()
            await asyncio.sleep(0.01)
            yield f"data: {i}\n\n"

    async def send(_message):
        return None

    async def receive():
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def run():
        response = SSEResponse(slow_events(), on_close=lambda: closed.append(True), write_timeout_s=5.0)
        await asyncio.wait_for(response(SCOPE, receive, send), timeout=10)

    asyncio.run(run())
    assert closed == [True]
    assert len(produced) < 10
