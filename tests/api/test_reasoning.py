"""Reasoning: a `<think>` span in the output comes back as reasoning_content and
reasoning (chat, streamed and not), as reasoning items (Responses) and as thinking blocks
(Anthropic). The bundled model is made to write one with a regex response_format."""

from __future__ import annotations

import anthropic
import openai

from tests.api.chatkit import TEMPLATE
from tests.conftest import start_server

THINK = {"type": "regex", "pattern": "<think>[a-z]{3,9} [a-z]{3,9}</think>[a-z]{2,9}"}
ASK = [{"role": "user", "content": "Think, then answer."}]


async def test_think_spans_split_out(nursery, draft_model):
    server = await start_server(nursery, draft_model, chat_template=str(TEMPLATE))
    api = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    raw = await api.chat.completions.create(model="m", messages=ASK, max_tokens=40,
                                            temperature=0, response_format=THINK,
                                            reasoning_effort="high")
    message = raw.choices[0].message.model_dump()
    reasoning, content = message["reasoning_content"], message["content"]
    assert message["reasoning"] == reasoning and " " in reasoning and "<" not in reasoning
    assert content.isalpha() and raw.choices[0].finish_reason == "stop"
    r_parts, c_parts, r2_parts = [], [], []
    async for chunk in await api.chat.completions.create(
            model="m", messages=ASK, max_tokens=40, temperature=0, response_format=THINK,
            stream=True):
        delta = chunk.choices[0].delta.model_dump()
        r_parts.append(delta.get("reasoning_content") or "")
        r2_parts.append(delta.get("reasoning") or "")
        c_parts.append(delta.get("content") or "")
    assert "".join(r_parts) == "".join(r2_parts) == reasoning
    assert "".join(c_parts) == content
    got = await api.responses.create(model="m", input=ASK[0]["content"], temperature=0,
                                     max_output_tokens=40, text={"format": THINK})
    assert [o.type for o in got.output] == ["reasoning", "message"]
    assert got.output[0].content[0].text == reasoning and got.output_text == content
    events = [e async for e in await api.responses.create(
        model="m", input=ASK[0]["content"], temperature=0, max_output_tokens=40,
        text={"format": THINK}, stream=True)]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") \
        == reasoning
    claude = anthropic.AsyncAnthropic(base_url=server.url, api_key="k", max_retries=0)
    message = await claude.messages.create(
        model="m", max_tokens=5, messages=ASK, thinking={"type": "enabled",
                                                         "budget_tokens": 1024})
    assert message.usage.output_tokens == 5  # thinking accepted
