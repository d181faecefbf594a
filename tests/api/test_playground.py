"""The playground page at `/`: its routes over HTTP, then the page in a real headless Chromium.

The browser test drives Debian's `chromium` through Playwright (tools.playground_shot's
launch_chromium) against a real server, and reads the result back from the DOM: the
tinted token spans, the hover alternatives, the summary of the `done` frame and the
error box. It is skipped, naming what to install, where chromium or playwright is absent.
Browser work runs in a worker thread (Playwright's sync API) while trio serves.
"""

from __future__ import annotations

import colorsys
import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.api.chatkit import TEMPLATE, WEATHER_TOOL
from tests.api.wsclient import LONG_PROMPT, STATS_POLL_SLEEP, STATS_POLLS, run_alone, stats
from tests.conftest import start_server
from tqserve.tools.playground_shot import chromium_missing, launch_chromium, run_in_page, take_screenshot

PROMPT = "def fibonacci(n):"
OTHER_PROMPT = "class Stack:"  # shares no first token with PROMPT: a prefix-cache miss
MAX_TOKENS = 24
TOP = 5
MAX_MESSAGE_BYTES = 4096  # small, so the page can send a frame the server refuses whole
BROWSER_MISSING = chromium_missing()  # why the browser test cannot run here, or None
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


async def test_playground_routes(server, draft_model):
    async with httpx.AsyncClient() as client:
        page = await client.get(server.url + "/")
        assert page.status_code == 200
        assert page.headers["content-type"] == "text/html; charset=utf-8"
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert '<script src="/static/playground.js"' in page.text
        assert '<script src="/static/playground_chat.js"' in page.text
        for name, kind in (("playground.js", "text/javascript"), ("playground.css", "text/css"),
                           ("playground_chat.js", "text/javascript")):
            response = await client.get(f"{server.url}/static/{name}")
            assert response.status_code == 200, name
            assert response.headers["content-type"].startswith(kind), name
        for path in ("/static/nope.js", "/static/playground.html", "/static/..%2Fapp.py",
                     "/static/", "/playground/"):
            response = await client.get(server.url + path)
            assert response.status_code == 404, (path, response.status_code)
        vocab = (await client.get(server.url + "/playground/vocab.json")).json()
    tokenizer = draft_model.tokenizer
    assert vocab["model"] == draft_model.path.name
    assert len(vocab["tokens"]) == draft_model.vocab_size
    for token_id in (0, 1, 2, 100, 4000, draft_model.vocab_size - 1):
        assert vocab["tokens"][token_id] == tokenizer.decode([token_id]), token_id


def expected_rgb(logprob: float) -> tuple[int, int, int]:
    """The page's tint, hsl(120 * p, 70%, 85%), as the browser's rgb()."""
    hue = round(120 * min(1.0, math.exp(logprob)))
    r, g, b = colorsys.hls_to_rgb(hue / 360, 0.85, 0.70)
    return round(r * 255), round(g * 255), round(b * 255)


def parse_rgb(css: str) -> tuple[int, int, int]:
    inner = css[css.index("(") + 1:css.index(")")]
    r, g, b = (round(float(v)) for v in inner.split(",")[:3])
    return r, g, b


class Frames:
    """The page's WebSocket traffic, as Playwright sees it, by request id."""

    def __init__(self, page: Any) -> None:
        self.sent: list[dict[str, Any]] = []
        self.received: list[dict[str, Any]] = []
        page.on("websocket", self._attach)

    def _attach(self, ws: Any) -> None:
        ws.on("framesent", lambda payload: self.sent.append(json.loads(payload)))
        ws.on("framereceived", lambda payload: self.received.append(json.loads(payload)))

    def of(self, rid: str | None) -> list[dict[str, Any]]:
        return [f for f in self.received if f.get("id") == rid]

    def last_sent(self) -> dict[str, Any]:
        return self.sent[-1]


def dom_tokens(page: Any) -> list[dict[str, Any]]:
    return page.eval_on_selector_all(".tok", """spans => spans.map(s => ({
        text: s.textContent, token_id: Number(s.dataset.tokenId), index: Number(s.dataset.index),
        logprob: s.dataset.logprob === undefined ? null : Number(s.dataset.logprob),
        color: getComputedStyle(s).backgroundColor}))""")


def summary(page: Any) -> dict[str, str]:
    return page.eval_on_selector_all(".stats dd", """dds => Object.fromEntries(
        dds.map(d => [d.id.replace('stat-', ''), d.textContent]))""")


def error_text(page: Any) -> str:
    return page.eval_on_selector("#error", "e => e.hidden ? '' : e.textContent")


def check_page(page: Any, url: str, reference: Any, tokenizer: Any) -> None:
    """Everything the browser must show; runs in a worker thread."""
    frames = Frames(page)
    console_errors: list[str] = []  # script errors, CSP violations, failed loads
    page.on("console", lambda m: m.type == "error" and console_errors.append(m.text))
    page.on("pageerror", lambda exc: console_errors.append(str(exc)))
    page.goto(url + "/")
    page.wait_for_selector("#connection[data-state='open']")
    assert page.title() == "tqserve playground"
    for control in ("prompt", "max-tokens", "temperature", "seed", "top-logprobs", "schema"):
        assert page.eval_on_selector(f"#{control}", "e => e.labels.length") == 1, control

    # A repeated prompt: the reference client ran it first, so its prefix is cached.
    run_in_page(page, PROMPT, max_tokens=MAX_TOKENS, temperature=0, top_logprobs=TOP)
    rid = frames.last_sent()["id"]
    assert frames.last_sent() == {"type": "generate", "id": rid, "prompt": PROMPT,
                                  "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True,
                                  "top_logprobs": TOP}
    tokens = [f for f in frames.of(rid) if f["type"] == "token"]
    (done,) = [f for f in frames.of(rid) if f["type"] == "done"]
    spans = dom_tokens(page)
    assert "".join(s["text"] for s in spans) == reference.text
    assert [s["token_id"] for s in spans] == reference.token_ids
    assert [s["index"] for s in spans] == list(range(len(spans)))
    assert [s["logprob"] for s in spans] == [f["logprob"] for f in tokens]
    for span, ref in zip(spans, reference.tokens):
        assert span["logprob"] == pytest.approx(ref["logprob"], abs=1e-3)
        got, want = parse_rgb(span["color"]), expected_rgb(span["logprob"])
        assert all(abs(a - b) <= 1 for a, b in zip(got, want)), (span, want)
    assert len({s["color"] for s in spans}) > 1  # tints differ with the logprob
    usage = done["usage"]
    assert usage["cached_tokens"] > 0 and usage["cached_tokens_by_tier"]["ram"] > 0
    assert summary(page) | {"ttft": "", "rate": ""} == {
        "finish": done["finish_reason"], "prompt": str(usage["prompt_tokens"]),
        "completion": str(len(spans)), "cached": str(usage["cached_tokens"]), "tier": "ram",
        "ttft": "", "rate": ""}
    assert error_text(page) == ""

    # Hover: the top alternatives of a token, with their text from the vocabulary.
    for index in (0, len(spans) // 2):
        page.hover(f".tok[data-index='{index}']")
        page.wait_for_selector("#tooltip:not([hidden])")
        rows = page.eval_on_selector_all("#tooltip .alt", """rows => rows.map(r => ({
            token_id: Number(r.dataset.tokenId), logprob: Number(r.dataset.logprob),
            text: r.dataset.text, chosen: r.classList.contains('chosen')}))""")
        top = tokens[index]["top_logprobs"]
        assert [[r["token_id"], r["logprob"]] for r in rows] == top and len(top) == TOP
        assert [r["text"] for r in rows] == [tokenizer.decode([t]) for t, _ in top]
        assert rows[0]["token_id"] == spans[index]["token_id"] and rows[0]["chosen"]  # greedy
        assert not any(r["chosen"] for r in rows[1:])
    page.mouse.move(0, 0)
    page.wait_for_selector("#tooltip", state="hidden")
    page.focus("#output")  # the keyboard reaches the same alternatives
    page.keyboard.press("ArrowRight")
    page.wait_for_selector(".tok.focused[data-index='0']")
    page.keyboard.press("End")
    page.wait_for_selector(f".tok.focused[data-index='{len(spans) - 1}']")
    last = page.eval_on_selector_all("#tooltip .alt", "rows => rows.map(r => r.dataset.tokenId)")
    assert [int(t) for t in last] == [t for t, _ in tokens[-1]["top_logprobs"]]
    page.keyboard.press("Escape")
    page.wait_for_selector("#tooltip", state="hidden")

    # A prompt never seen: nothing cached.
    run_in_page(page, OTHER_PROMPT, max_tokens=4, temperature=0, seed=3, top_logprobs=0)
    assert frames.last_sent()["seed"] == 3 and frames.last_sent()["top_logprobs"] == 0
    assert summary(page)["cached"] == "0" and summary(page)["tier"] == "none"
    assert len(dom_tokens(page)) == 4

    # A bad request: the server's error frame is shown and the form is usable again.
    run_in_page(page, PROMPT, max_tokens=4, temperature=-1)
    (error,) = frames.of(frames.last_sent()["id"])
    assert error["type"] == "error" and "temperature" in error["message"]
    assert error_text(page) == f"{error['code']}: {error['message']}"
    assert dom_tokens(page) == [] and summary(page)["finish"] == ""

    # A frame over the server's size limit is refused whole (an error with no id).
    run_in_page(page, "x = 1\n" * (MAX_MESSAGE_BYTES // 6), max_tokens=4, temperature=0)
    (error,) = [f for f in frames.of(None) if f["type"] == "error"]
    assert error["code"] == "message_too_large"
    assert error_text(page) == f"message_too_large: {error['message']}"

    # The JSON-schema box: invalid JSON never leaves the page; valid JSON is sent as
    # response_format, and whatever the server answers (an error frame where structured
    # output is off) is what the page shows.
    num_sent = len(frames.sent)
    page.fill("#schema", "{not json")
    run_in_page(page, PROMPT, max_tokens=4, temperature=0)
    assert len(frames.sent) == num_sent
    assert error_text(page).startswith("JSON schema is not valid JSON")
    page.fill("#schema", json.dumps(SCHEMA))
    run_in_page(page, "data = ", max_tokens=8, temperature=0)
    sent = frames.last_sent()
    assert sent["response_format"] == {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    end = frames.of(sent["id"])[-1]
    if end["type"] == "error":
        assert error_text(page) == f"{end['code']}: {end['message']}"
    else:
        assert end["type"] == "done" and summary(page)["finish"] == end["finish_reason"]
        assert error_text(page) == ""
    page.fill("#schema", "")

    # Cancel: a long greedy run stops at the button.
    page.fill("#prompt", LONG_PROMPT)
    page.fill("#max-tokens", "2000")
    page.fill("#temperature", "0")
    page.click("#generate")
    page.wait_for_selector(".tok")
    page.click("#cancel")
    page.wait_for_selector("#generate:not([disabled])")
    assert frames.last_sent() == {"type": "cancel", "id": frames.sent[-2]["id"]}
    assert summary(page)["finish"] == "cancelled" and error_text(page) == ""
    assert 0 < len(dom_tokens(page)) < 2000
    assert summary(page)["completion"] == str(len(dom_tokens(page)))
    assert console_errors == []


async def wait_published(url: str) -> None:
    """Poll /v1/stats (bounded) until the prefix cache holds a RAM entry."""
    async with httpx.AsyncClient() as client:
        for _ in range(STATS_POLLS):
            if (await stats(client, url))["prefix_cache"]["ram_entries"] > 0:
                return
            await trio.sleep(STATS_POLL_SLEEP)
    raise AssertionError("the reference prompt's prefix was never published")


@pytest.mark.skipif(BROWSER_MISSING is not None, reason=str(BROWSER_MISSING))
async def test_playground_in_chromium(nursery, draft_model, tmp_path: Path):
    from playwright.sync_api import sync_playwright

    server = await start_server(nursery, draft_model, max_message_bytes=MAX_MESSAGE_BYTES)
    reference = await run_alone(server.ws_url, "ref", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                temperature=0, logprobs=True, top_logprobs=TOP)
    assert reference.end["type"] == "done" and reference.end["usage"]["cached_tokens"] == 0
    await wait_published(server.url)
    shot = tmp_path / "playground.png"

    def browse() -> None:
        with sync_playwright() as playwright:
            context = launch_chromium(playwright, tmp_path / "profile")
            try:
                check_page(context.new_page(), server.url, reference, draft_model.tokenizer)
                take_screenshot(context, server.url, shot, max_tokens=16)
            finally:
                context.close()

    await trio.to_thread.run_sync(browse)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(BROWSER_MISSING is not None, reason=str(BROWSER_MISSING))
async def test_playground_asks_for_the_api_key_and_then_streams(nursery, draft_model,
                                                                tmp_path: Path):
    """With --api-key the page loads, says it needs the key, refuses a wrong one, and with
    the right one (sent as a WebSocket subprotocol, see api.auth) generates."""
    from playwright.sync_api import sync_playwright

    key = "playground-key"
    server = await start_server(nursery, draft_model, api_key=key)

    def browse() -> None:
        with sync_playwright() as playwright:
            context = launch_chromium(playwright, tmp_path / "profile")
            try:
                page = context.new_page()
                page.goto(server.url + "/")
                page.wait_for_selector("#key-box:not([hidden])")
                page.wait_for_selector("#error:not([hidden])")  # (no wait_for_function:
                # the page's CSP forbids eval, which polling a JS expression needs)
                assert "needs an API key" in error_text(page)
                assert page.eval_on_selector("#connection", "e => e.dataset.state") == "closed"
                page.fill("#api-key", "wrong")
                page.press("#api-key", "Tab")  # blur: the change event
                page.wait_for_selector("#error p:has-text('the API key was refused')")
                page.fill("#api-key", key)
                page.press("#api-key", "Tab")
                page.wait_for_selector("#connection[data-state='open']")
                assert error_text(page) == ""
                run_in_page(page, PROMPT, max_tokens=8, temperature=0, top_logprobs=2)
                assert len(dom_tokens(page)) == 8
                assert summary(page)["finish"] == "length" and error_text(page) == ""
            finally:
                context.close()

    await trio.to_thread.run_sync(browse)


CHAT_SYSTEM = "You are a helpful assistant. Answer in one short sentence."
CHAT_TURNS = ["What is the capital of France?", "And of Germany?"]


def chat_reply(page: Any) -> dict[str, Any]:
    """The last assistant turn of the transcript: its text, tints and tool calls."""
    return page.eval_on_selector_all(".msg.assistant", """boxes => {
        const box = boxes[boxes.length - 1];
        const spans = [...box.querySelectorAll('.ctok')];
        return {text: spans.map(s => s.textContent).join(''),
                logprobs: spans.map(s => s.dataset.logprob === undefined ? null
                                         : Number(s.dataset.logprob)),
                calls: [...box.querySelectorAll('.tool-call')].map(c => ({
                    name: c.dataset.name, arguments: c.dataset.arguments}))}; }""")


def check_chat(page: Any, url: str, answers: list[str]) -> None:
    """Chat mode against the instruct model; runs in a worker thread."""
    sent: list[dict[str, Any]] = []
    page.on("request", lambda r: r.url.endswith("/v1/chat/completions")
            and sent.append(r.post_data_json))
    console_errors: list[str] = []
    page.on("console", lambda m: m.type == "error" and console_errors.append(m.text))
    page.on("pageerror", lambda exc: console_errors.append(str(exc)))
    page.goto(url + "/")
    page.wait_for_selector("#connection[data-state='open']")
    page.check("#mode-chat")
    page.wait_for_selector("#chat-box:not([hidden])")
    for control in ("system", "tools", "tool-choice"):
        assert page.eval_on_selector(f"#{control}", "e => e.labels.length") == 1, control
    page.fill("#system", CHAT_SYSTEM)
    history: list[dict[str, Any]] = []
    for turn, answer in zip(CHAT_TURNS, answers):
        run_in_page(page, turn, max_tokens=24, temperature=0, top_logprobs=2)
        history.append({"role": "user", "content": turn})
        assert sent[-1]["messages"] == [{"role": "system", "content": CHAT_SYSTEM}, *history]
        assert sent[-1]["stream"] is True and sent[-1]["logprobs"] is True
        assert "tools" not in sent[-1]
        reply = chat_reply(page)
        assert reply["text"] == answer and reply["calls"] == []
        assert all(isinstance(lp, float) and lp <= 0 for lp in reply["logprobs"])
        assert summary(page)["finish"] in ("stop", "length") and error_text(page) == ""
        history.append({"role": "assistant", "content": answer})
    roles = page.eval_on_selector_all(".msg", "boxes => boxes.map(b => b.dataset.role)")
    assert roles == ["user", "assistant"] * 2

    # A forced tool call: the page sends the tools and shows the call the model returns.
    page.click("#new-chat")
    page.fill("#tools", json.dumps([WEATHER_TOOL]))
    page.select_option("#tool-choice", "required")
    run_in_page(page, "What is the weather in Paris?", max_tokens=48, temperature=0)
    assert sent[-1]["tools"] == [WEATHER_TOOL] and sent[-1]["tool_choice"] == "required"
    assert len(sent[-1]["messages"]) == 2  # the new chat forgot the history
    (call,) = chat_reply(page)["calls"]
    assert call["name"] == "get_weather"
    assert set(json.loads(call["arguments"])) == {"city", "unit"}
    assert summary(page)["finish"] == "tool_calls" and error_text(page) == ""

    # Bad tools JSON never leaves the page.
    num_sent = len(sent)
    page.fill("#tools", "[not json")
    run_in_page(page, "Hi", max_tokens=4, temperature=0)
    assert len(sent) == num_sent and error_text(page).startswith("tools is not valid JSON")
    assert console_errors == []


@pytest.mark.skipif(BROWSER_MISSING is not None, reason=str(BROWSER_MISSING))
async def test_playground_chat_mode(nursery, instruct_model, tmp_path: Path):
    import openai
    from playwright.sync_api import sync_playwright

    server = await start_server(nursery, instruct_model, chat_template=str(TEMPLATE))
    api = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "system", "content": CHAT_SYSTEM}]
    answers = []
    for turn in CHAT_TURNS:  # the reference: the same conversation through the SDK
        messages.append({"role": "user", "content": turn})
        got = await api.chat.completions.create(model="m", messages=messages, max_tokens=24,
                                                temperature=0)
        answers.append(got.choices[0].message.content)
        messages.append({"role": "assistant", "content": answers[-1]})
    assert all(answers)

    def browse() -> None:
        with sync_playwright() as playwright:
            context = launch_chromium(playwright, tmp_path / "profile")
            try:
                check_chat(context.new_page(), server.url, answers)
            finally:
                context.close()

    await trio.to_thread.run_sync(browse)
