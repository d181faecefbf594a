"""A stream cut short says so (issue 19), through the official openai and anthropic clients.

The server's shutdown ends long generations at a short --shutdown-timeout: every stream
ends with its API's error event (the clients raise) and no finish_reason / stop_reason,
every non-streamed answer is a 503; a consumer cut off for falling behind gets an error
event too. Complete outputs keep finish_reason `length` / `stop` and stop_reason
`max_tokens` / `stop_sequence`.
"""

from __future__ import annotations

import socket
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import trio

from tests.api.wsclient import LONG_PROMPT, STATS_POLL_SLEEP, stats, wait_stats
from tests.conftest import start_server

LONG = 2000  # tokens no row finishes within the 0.2 s --shutdown-timeout
SLOW_POLLS = 3000  # /v1/stats reads while waiting for the slow client's row to go
MESSAGES = [{"role": "user", "content": LONG_PROMPT}]
GREEDY = {"extra_body": {"temperature": 0}}


def openai_client(url: str, **kwargs: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                              timeout=60, **kwargs)


def anthropic_client(url: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0,
                                    timeout=60)


async def openai_stream(url: str, chat: bool, first: trio.Event, out: dict[str, Any]) -> None:
    """Stream a long generation; file its text, its finish reasons and what it raised."""
    api = openai_client(url)
    if chat:
        stream = await api.chat.completions.create(model="m", messages=MESSAGES,
                                                   max_tokens=LONG, temperature=0, stream=True)
    else:
        stream = await api.completions.create(model="m", prompt=LONG_PROMPT, max_tokens=LONG,
                                              temperature=0, stream=True)
    out.update(text="", finishes=[])
    try:
        async for chunk in stream:
            choice = chunk.choices[0]
            out["text"] += (choice.delta.content or "") if chat else choice.text
            if choice.finish_reason is not None:
                out["finishes"].append(choice.finish_reason)
            if out["text"]:
                first.set()
    except openai.APIError as exc:
        out["error"] = exc
    finally:
        first.set()  # a stream that ended early fails the test, not its hang guard


async def anthropic_stream(url: str, first: trio.Event, out: dict[str, Any]) -> None:
    out.update(text="", stop_reasons=[])
    try:
        async with anthropic_client(url).messages.stream(
                model="m", max_tokens=LONG, messages=MESSAGES, **GREEDY) as stream:
            async for event in stream:
                if event.type == "text":
                    out["text"] += event.text
                    first.set()
                elif event.type == "message_delta":
                    out["stop_reasons"].append(event.delta.stop_reason)
    except anthropic.APIError as exc:
        out["error"] = exc
    finally:
        first.set()


async def openai_plain(url: str, out: dict[str, Any]) -> None:
    try:
        out["answer"] = await openai_client(url).completions.create(
            model="m", prompt=LONG_PROMPT, max_tokens=LONG, temperature=0)
    except openai.APIError as exc:
        out["error"] = exc


async def anthropic_plain(url: str, out: dict[str, Any]) -> None:
    try:
        out["answer"] = await anthropic_client(url).messages.create(
            model="m", max_tokens=LONG, messages=MESSAGES, **GREEDY)
    except anthropic.APIError as exc:
        out["error"] = exc


async def test_a_shutdown_mid_stream_is_an_error_on_every_api(nursery, draft_model):
    trigger = trio.Event()
    server = await start_server(nursery, draft_model, shutdown_trigger=trigger,
                                shutdown_timeout=0.2)
    outs: dict[str, dict[str, Any]] = {k: {} for k in ("chat", "completions", "messages",
                                                       "plain_openai", "plain_anthropic")}
    firsts = [trio.Event() for _ in range(3)]
    with trio.fail_after(120):  # a hang guard
        async with trio.open_nursery() as clients:
            clients.start_soon(openai_stream, server.url, True, firsts[0], outs["chat"])
            clients.start_soon(openai_stream, server.url, False, firsts[1],
                               outs["completions"])
            clients.start_soon(anthropic_stream, server.url, firsts[2], outs["messages"])
            clients.start_soon(openai_plain, server.url, outs["plain_openai"])
            clients.start_soon(anthropic_plain, server.url, outs["plain_anthropic"])
            for first in firsts:
                await first.wait()  # every stream has text: all five decode
            async with httpx.AsyncClient() as raw:
                await wait_stats(raw, server.url, rows_active=5)
            trigger.set()
    for name in ("chat", "completions"):
        out = outs[name]
        error = out.get("error")
        assert type(error) is openai.APIError, (name, out)  # raised on the streamed event
        assert error.body["code"] == "shutdown", error.body
        assert error.body["type"] == "service_unavailable", error.body
        assert "shut down" in error.message and out["text"] and out["finishes"] == [], out
    out = outs["messages"]
    error = out.get("error")
    assert isinstance(error, anthropic.APIStatusError), out
    assert error.body["type"] == "error", error.body
    assert error.body["error"]["type"] == "overloaded_error", error.body
    assert out["text"] and out["stop_reasons"] == [], out
    for name, exc_type in (("plain_openai", openai.InternalServerError),
                           ("plain_anthropic", anthropic.ServiceUnavailableError)):
        out = outs[name]
        error = out.get("error")
        assert isinstance(error, exc_type) and error.status_code == 503, (name, out)
        assert "shut down" in error.message and "tokens generated" in error.message, error


async def test_complete_outputs_keep_length_and_stop(server):
    api = openai_client(server.url)
    full = await api.completions.create(model="m", prompt=LONG_PROMPT, max_tokens=12,
                                        temperature=0)
    text = full.choices[0].text
    full_chat = await api.chat.completions.create(model="m", messages=MESSAGES,
                                                  max_tokens=12, temperature=0)
    chat_text = full_chat.choices[0].message.content
    for stop in (None, text[4:8]):
        chunks = [c async for c in await api.completions.create(
            model="m", prompt=LONG_PROMPT, max_tokens=12, temperature=0, stop=stop,
            stream=True)]
        assert [c.choices[0].finish_reason for c in chunks][-1] == ("stop" if stop else
                                                                    "length")
        got = "".join(c.choices[0].text for c in chunks)
        assert got == (text[:text.index(stop)] if stop else text)
    for stop in (None, chat_text[4:8]):
        chunks = [c async for c in await api.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=12, temperature=0, stop=stop,
            stream=True)]
        assert [c.choices[0].finish_reason for c in chunks][-1] == ("stop" if stop else
                                                                    "length")
        got = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert got == (chat_text[:chat_text.index(stop)] if stop else chat_text)
    claude = anthropic_client(server.url)
    for stops, reason in (([], "max_tokens"), ([chat_text[4:8]], "stop_sequence")):
        async with claude.messages.stream(model="m", max_tokens=12, messages=MESSAGES,
                                          stop_sequences=stops, **GREEDY) as stream:
            final = await stream.get_final_message()
        assert final.stop_reason == reason, final


async def test_a_consumer_cut_off_for_falling_behind_gets_an_error(nursery, draft_model):
    """The overload cut: a client that stops reading; its row goes, and once it reads
    again its stream ends with the error event (slow_consumer), not a finish_reason."""
    server = await start_server(nursery, draft_model, stream_buffer=8)
    small_window = httpx2.AsyncHTTPTransport(  # so that the socket's buffers fill soon
        socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)])
    api = openai_client(server.url, http_client=httpx2.AsyncClient(transport=small_window))
    stream = await api.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=4000, temperature=0, stream=True,
        logprobs=True, top_logprobs=20)
    chunks = [await stream.__anext__()]
    async with httpx.AsyncClient() as raw:  # not reading: the row must be cut off
        current = await stats(raw, server.url)
        for _ in range(SLOW_POLLS):
            if current["steps"] > 0 and current["rows_active"] == 0:
                break
            await trio.sleep(STATS_POLL_SLEEP)
            current = await stats(raw, server.url)
        assert current["rows_active"] == 0 and current["steps"] < 2000, current  # cut off
    error = None
    try:
        async for chunk in stream:
            chunks.append(chunk)
    except openai.APIError as exc:
        error = exc
    assert type(error) is openai.APIError and error.body["code"] == "slow_consumer", error
    assert all(c.choices[0].finish_reason is None for c in chunks)
