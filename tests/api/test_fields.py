"""Fields and endpoints clients send beyond the basics: unknown fields, served model
names, /v1/models/{id}, tokenize, count_tokens, headers, images and embeddings."""

from __future__ import annotations

import logging

import anthropic
import httpx
import openai
import pytest

from tests.api.chatkit import TEMPLATE, TOOLS
from tests.api.test_cli_flags import serve_config
from tests.conftest import start_server

MESSAGES = [{"role": "user", "content": "def add(a, b):"}]


def oai(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                              timeout=60)


async def test_unknown_fields_ignored_with_a_warning_strict_refuses(nursery, draft_model,
                                                                    caplog):
    server = await start_server(nursery, draft_model)
    api = oai(server)
    plain = await api.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5,
                                              temperature=0)
    with caplog.at_level(logging.WARNING, logger="tqserve.api"):
        extra = await api.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=5, temperature=0, store=False,
            reasoning_effort="low", stream_options={"include_usage": True},
            extra_body={"bogus": 1, "chat_template_kwargs": {"x": 1}})
    assert extra.choices[0].message.content == plain.choices[0].message.content
    assert "bogus" in caplog.text and "chat_template_kwargs" in caplog.text
    message = await anthropic.AsyncAnthropic(base_url=server.url, api_key="k").messages.create(
        model="m", max_tokens=3, messages=MESSAGES, extra_body={"bogus": True},
        extra_headers={"anthropic-beta": "prompt-caching-2024-07-31"})
    assert message.usage.output_tokens == 3
    strict = await start_server(nursery, draft_model, strict_fields=True)
    with pytest.raises(openai.BadRequestError, match="bogus"):
        await oai(strict).chat.completions.create(model="m", messages=MESSAGES, max_tokens=2,
                                                  extra_body={"bogus": 1})


async def test_served_model_names(nursery, draft_model):
    server = await start_server(nursery, draft_model, served_model_name=("coder", "gpt-x"))
    api = oai(server)
    assert [m.id for m in (await api.models.list()).data] == ["coder", "gpt-x"]
    assert (await api.models.retrieve("gpt-x")).id == "gpt-x"
    got = await api.completions.create(model="gpt-x", prompt="def f(", max_tokens=2)
    assert got.model == "coder"
    for call in (api.completions.create(model="nope", prompt="x", max_tokens=2),
                 api.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2),
                 api.responses.create(model="nope", input="x", max_output_tokens=2),
                 api.models.retrieve("nope")):
        with pytest.raises(openai.NotFoundError) as info:
            await call
        assert info.value.body["code"] == "model_not_found"
        assert "coder, gpt-x" in info.value.message and "nope" in info.value.message
    with pytest.raises(anthropic.NotFoundError, match="coder"):
        await anthropic.AsyncAnthropic(base_url=server.url, api_key="k").messages.create(
            model="nope", max_tokens=2, messages=MESSAGES)
    assert serve_config(["--served-model-name", "a", "b"]).served_model_name == ("a", "b")
    assert serve_config([]).served_model_name == ()
    assert serve_config(["--strict-fields"]).strict_fields


async def test_tokenize_detokenize_embeddings_images(nursery, draft_model):
    server = await start_server(nursery, draft_model, chat_template=str(TEMPLATE))
    api = oai(server)
    async with httpx.AsyncClient(timeout=60) as raw:
        tok = (await raw.post(server.url + "/tokenize", json={"prompt": "def f(x):"})).json()
        assert tok["tokens"] == draft_model.tokenizer.encode("def f(x):")
        assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] > 0
        back = await raw.post(server.url + "/detokenize", json={"tokens": tok["tokens"]})
        assert back.json() == {"prompt": "def f(x):"}
        chat = (await raw.post(server.url + "/tokenize",
                               json={"messages": MESSAGES, "tools": TOOLS})).json()
        bad = await raw.post(server.url + "/detokenize", json={"tokens": [-1]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        emb = await raw.post(server.url + "/v1/embeddings", json={"input": "x"})
        assert emb.status_code == 404 and "embeddings are not served" in emb.text
    got = await api.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS,
                                            tool_choice="none", max_tokens=1)
    plain = await api.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS,
                                              max_tokens=1)
    assert plain.usage.prompt_tokens == chat["count"] > got.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="image"):
        await api.chat.completions.create(model="m", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                         {"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(anthropic.BadRequestError, match="image"):
        await anthropic.AsyncAnthropic(base_url=server.url, api_key="k").messages.create(
            model="m", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": "AA=="}}]}])
