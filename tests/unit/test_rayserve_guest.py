"""api.rayserve.guest on plain asyncio (no Ray): trio as a guest, ASGI calls bridged in.

A small trio ASGI app stands in for quart-trio; the asyncio side plays Ray Serve's replica
(its own receive/send coroutines). Checked: a call round-trips messages both ways; an
exception in the app, or a BaseExceptionGroup, fails that call only (the next one works); the asyncio caller being
cancelled cancels the trio task; `call` reads trio state; stop ends the run and later
calls fail with GuestEnded. And `tqserve ray-serve` without Ray names the extra."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import trio

from tqserve.api.rayserve.guest import GuestEnded, GuestRun


async def _main(stop: trio.Event, *, task_status: Any) -> None:
    state = {"cancelled": 0, "calls": 0}
    task_status.started(state)
    await stop.wait()


def _app(state: dict[str, int]) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        trio.lowlevel.current_task()  # raises outside trio: the app runs in the guest
        state["calls"] += 1
        message = await receive()
        if message["body"] == b"boom":
            raise RuntimeError("boom")
        if message["body"] == b"group":  # what a nursery makes of a generator's aclose
            raise BaseExceptionGroup("cleanup", [GeneratorExit()])
        if message["body"] == b"hang":
            try:
                await trio.sleep_forever()
            finally:
                state["cancelled"] += 1
        await send({"type": "http.response.body", "body": message["body"][::-1]})
    return app


async def _call(guest: GuestRun, app: Any, body: bytes) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(0)  # a real asyncio await inside the bridged receive
        return {"type": "http.request", "body": body}

    async def send(message: dict[str, Any]) -> None:
        await asyncio.sleep(0)
        sent.append(message)

    await guest.asgi(app, {"type": "http"}, receive, send)
    return sent


async def _scenario() -> None:
    guest = GuestRun()
    state = await guest.start(_main)
    app = _app(state)
    assert await _call(guest, app, b"abc") == [{"type": "http.response.body", "body": b"cba"}]
    with pytest.raises(RuntimeError, match="boom"):
        await _call(guest, app, b"boom")
    assert await _call(guest, app, b"xy") == [{"type": "http.response.body", "body": b"yx"}]
    # a BaseExceptionGroup (not an Exception) fails its call, not the engine: it once
    # ended a Ray replica's whole engine when a client dropped an SSE stream
    with pytest.raises(RuntimeError, match="the call failed"):
        await _call(guest, app, b"group")
    assert guest.running

    hung = asyncio.ensure_future(_call(guest, app, b"hang"))
    while state["calls"] < 5:  # the app has taken the call
        await asyncio.sleep(0.01)
    hung.cancel()
    with pytest.raises(asyncio.CancelledError):
        await hung
    while not state["cancelled"]:  # the trio task saw the cancellation
        await asyncio.sleep(0.01)
    assert await guest.call(lambda: dict(state)) == {"cancelled": 1, "calls": 5}

    assert guest.running
    await guest.stop()
    assert not guest.running
    with pytest.raises(GuestEnded):
        await _call(guest, app, b"late")


def test_guest_bridges_asgi_calls_into_trio() -> None:
    asyncio.run(asyncio.wait_for(_scenario(), 30))


def test_ray_serve_without_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    from tqserve.api.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if absent
    monkeypatch.delitem(sys.modules, "tqserve.api.rayserve.deployment", raising=False)
    assert main(["ray-serve", "--replicas", "2"]) == 2
    assert capsys.readouterr().err == ("tqserve: error: tqserve ray-serve needs Ray Serve: "
                                       "pip install 'tqserve[ray]'\n")
