"""tqserve.client against a real server: multiplexing, frame kinds, typed events, errors,
connection loss (in-flight requests fail with ConnectionLost) and reconnect."""

from __future__ import annotations

import pytest
import trio

from tqserve.api.server import serve
from tqserve.api.config import ServerConfig
from tests.conftest import start_server
from tqserve.client import (Client, ConnectionLost, DoneEvent, ErrorEvent, QueuedEvent,
                            TokenEvent)

PROMPT = "def add(a, b):"
CONNECT_TIMEOUT = 60.0  # hang guard, not a measurement
CLOSE_POLLS = 3000      # bounded polls of client.connected after the server stops


async def _collect(client: Client, **fields):
    return [ev async for ev in client.generate(**fields)]


@pytest.mark.parametrize("binary", [True, False])
async def test_multiplexed_requests_match_running_alone(server, draft_model, binary):
    prompts = ["def add(a, b):", "import os\n", "class Foo:", "for i in range(10):"]
    results: dict[int, list] = {}
    async with Client.connect(server.ws_url, binary=binary) as client:
        async def one(i: int) -> None:
            results[i] = await _collect(client, prompt=prompts[i], max_tokens=10,
                                        temperature=0)

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        assert client.statistics().num_connects == 1
        assert client.num_active == 0
        for i, events in results.items():
            assert isinstance(events[0], QueuedEvent)
            tokens = [e for e in events if isinstance(e, TokenEvent)]
            done = events[-1]
            assert isinstance(done, DoneEvent) and done.completion_tokens == len(tokens)
            assert [t.index for t in tokens] == list(range(len(tokens)))
            assert done.prompt_tokens == len(draft_model.tokenizer.encode(prompts[i]))
            assert set(done.cached_tokens_by_tier) == {"ram", "ssd"}
            alone = await _collect(client, prompt=prompts[i], max_tokens=10, temperature=0,
                                   request_id=f"alone{i}")
            assert [e.token_id for e in alone if isinstance(e, TokenEvent)] == \
                [t.token_id for t in tokens]
        bad = await _collect(client, prompt=PROMPT, max_tokens=4, temperature=-1)
        assert len(bad) == 1 and isinstance(bad[0], ErrorEvent)
        assert bad[0].code == "invalid_request" and "temperature" in bad[0].message
        gen = client.generate(prompt="import os\n", max_tokens=50, request_id="same")
        assert isinstance(await gen.__anext__(), QueuedEvent)
        with pytest.raises(ValueError, match="in flight"):
            await _collect(client, prompt=PROMPT, request_id="same")
        await gen.aclose()  # leaving early cancels it
        assert client.num_active == 0


async def test_leaving_early_cancels_on_the_server(server):
    async with Client.connect(server.ws_url) as client:
        async for ev in client.generate(prompt="import os\n", max_tokens=500, temperature=0):
            if isinstance(ev, TokenEvent):
                break
        events = await _collect(client, prompt=PROMPT, max_tokens=3, temperature=0)
        assert isinstance(events[-1], DoneEvent)
        assert client.num_active == 0


async def test_connection_loss_fails_in_flight_requests_then_reconnects(draft_model):
    async with trio.open_nursery() as outer:
        first_scope = trio.CancelScope()
        started = trio.Event()
        url: list[str] = []

        async def first_server() -> None:
            with first_scope:
                async with trio.open_nursery() as n:
                    srv = await start_server(n, draft_model)
                    url.append(srv.ws_url)
                    started.set()
                    await trio.sleep_forever()

        outer.start_soon(first_server)
        await started.wait()
        port = int(url[0].rsplit(":", 1)[1].split("/")[0])
        with trio.fail_after(CONNECT_TIMEOUT):
            async with Client.connect(url[0]) as client:
                seen_token = trio.Event()
                failures: list[BaseException] = []

                async def long_request() -> None:
                    try:
                        async for ev in client.generate(prompt="import os\n", max_tokens=4000,
                                                        temperature=0):
                            if isinstance(ev, TokenEvent):
                                seen_token.set()
                    except ConnectionLost as exc:
                        failures.append(exc)

                async with trio.open_nursery() as n:
                    n.start_soon(long_request)
                    await seen_token.wait()
                    first_scope.cancel()  # the server goes away mid-request
                assert len(failures) == 1 and "in flight" in str(failures[0])
                assert client.statistics().num_lost == 1
                second = await outer.start(lambda task_status: serve(
                    ServerConfig(port=port), loaded=draft_model, task_status=task_status))
                assert second.replace("http://", "ws://") + "/v1/stream" == url[0]
                events = await _collect(client, prompt=PROMPT, max_tokens=4, temperature=0)
                assert isinstance(events[-1], DoneEvent)  # a new socket, not a restart
                assert client.statistics().num_connects == 2
        outer.cancel_scope.cancel()


async def test_no_reconnect_raises_connection_lost_and_bad_url_is_typed(draft_model):
    with pytest.raises(ConnectionLost, match="cannot connect"):
        async with Client.connect("ws://127.0.0.1:9/v1/stream", reconnect_attempts=1):
            pass
    async with trio.open_nursery() as outer:
        scope = trio.CancelScope()
        ready = trio.Event()
        url: list[str] = []

        async def srv() -> None:
            with scope:
                async with trio.open_nursery() as n:
                    url.append((await start_server(n, draft_model)).ws_url)
                    ready.set()
                    await trio.sleep_forever()

        outer.start_soon(srv)
        await ready.wait()
        async with Client.connect(url[0], reconnect=False, binary=False,
                                  api_key="secret") as client:
            events = await _collect(client, prompt=PROMPT, max_tokens=2, temperature=0)
            assert isinstance(events[-1], DoneEvent)
            scope.cancel()
            for _ in range(CLOSE_POLLS):  # the reader notices the close
                if not client.connected:
                    break
                await trio.sleep(0.01)
            assert not client.connected
            with pytest.raises(ConnectionLost, match="reconnect off"):
                await _collect(client, prompt=PROMPT, max_tokens=2)
