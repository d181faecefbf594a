"""The Responses API's WebSocket mode: response.create frames in, the SSE stream's events
out, one response at a time; errors as frames; previous_response_id across turns."""

from __future__ import annotations

import json

import openai
import pytest
import trio
from trio_websocket import ConnectionClosed, open_websocket_url

from tests.api.chatkit import TEMPLATE, TOOLS
from tests.conftest import start_server

FUNCTIONS = [{"type": "function", **t["function"]} for t in TOOLS]


async def turn(ws, **fields) -> list[dict]:
    """Send one response.create; the events up to its last one."""
    await ws.send_message(json.dumps({"type": "response.create", **fields}))
    events = []
    while True:
        events.append(json.loads(await ws.get_message()))
        if events[-1]["type"] in ("response.completed", "response.incomplete",
                                  "response.failed", "error"):
            return events


async def test_websocket_mode_equals_the_sse_stream(nursery, draft_model):
    server = await start_server(nursery, draft_model, chat_template=str(TEMPLATE))
    api = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    sse = [e async for e in await api.responses.create(
        model="m", input="Say hello.", max_output_tokens=6, temperature=0, stream=True)]
    url = server.url.replace("http://", "ws://") + "/v1/responses"
    async with open_websocket_url(url) as ws:
        events = await turn(ws, model="m", input="Say hello.", max_output_tokens=6,
                            temperature=0, stream=True)
        assert [e["type"] for e in events] == [e.type for e in sse]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert text == sse[-1].response.output_text
        first = events[-1]["response"]
        # a call, then its result continuing the stored response, on the same socket
        call_events = await turn(ws, model="m", input="Weather?", tools=FUNCTIONS,
                                 tool_choice="required", max_output_tokens=120, temperature=0)
        (call,) = [o for o in call_events[-1]["response"]["output"]
                   if o["type"] == "function_call"]
        assert set(json.loads(call["arguments"])) in ({"city", "unit"}, {"zone"})
        answer = await turn(ws, model="m", previous_response_id=call_events[-1]["response"]["id"],
                            input=[{"type": "function_call_output", "call_id": call["call_id"],
                                    "output": "18 C"}], max_output_tokens=4, tools=FUNCTIONS)
        done = answer[-1]["response"]
        assert done["previous_response_id"] and done["usage"]["input_tokens_details"][
            "cached_tokens"] > 0
        for bad, param in (({"type": "session.update"}, "type"),
                           ({"type": "response.create", "input": 5}, "input"),
                           ({"type": "response.create", "input": "x", "model": "m",
                             "previous_response_id": "resp_gone"}, "previous_response_id")):
            await ws.send_message(json.dumps(bad))
            error = json.loads(await ws.get_message())
            assert error["type"] == "error" and error["status"] == 400
            assert error["error"]["param"] == param, error
        await ws.send_message("{not json")
        assert json.loads(await ws.get_message())["status"] == 400
        again = await turn(ws, model="m", input="Say hello.", max_output_tokens=6, temperature=0)
        def texts(response: dict) -> list[str]:
            return [c["text"] for o in response["output"] for c in o["content"]]

        assert texts(again[-1]["response"]) == texts(first) and texts(first) == [text]


async def test_shutdown_fails_the_response_then_closes_1001(nursery, draft_model):
    trigger = trio.Event()
    server = await start_server(nursery, draft_model, chat_template=str(TEMPLATE),
                                shutdown_trigger=trigger, shutdown_timeout=0.2)
    url = server.url.replace("http://", "ws://") + "/v1/responses"
    with trio.fail_after(120):  # a hang guard
        async with open_websocket_url(url) as ws:
            # greedy: the bundled model's answer to "x" runs to 2,000 tokens without an
            # EOS, so the shutdown (grace 0.2 s) always finds it running (sampled, an EOS
            # in the grace period ended it `completed` once in CI)
            await ws.send_message(json.dumps({"type": "response.create", "input": "x",
                                              "max_output_tokens": 2000, "temperature": 0}))
            while json.loads(await ws.get_message())["type"] != "response.output_text.delta":
                pass
            trigger.set()
            events = []
            with pytest.raises(ConnectionClosed) as info:
                while True:
                    events.append(json.loads(await ws.get_message()))
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["code"] == "shutdown"
    assert info.value.reason.code == 1001
