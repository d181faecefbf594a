"""Prompt logprobs: `echo` with `logprobs` on /v1/completions and `prompt_logprobs: N` on
the WebSocket, against a reference log-softmax of mlx-lm's own full-prompt forward on
pycoder-29m (float32), on a live server."""

from __future__ import annotations

import mlx.core as mx
import openai
import pytest
from trio_websocket import open_websocket_url

from tests.api.wsclient import Session, run_alone
from tests.conftest import start_server
from tqserve.engine.prompt_logprobs import MAX_PROMPT_LOGPROBS_TOKENS

PROMPT = ("class Stack:\n    def __init__(self):\n        self.items = []\n\n"
          "    def push(self, x):\n        self.items.append(x)\n")
TOLERANCE = 1e-4
TOP = 3


def reference(loaded, ids: list[int]) -> tuple[list[float], list[list[int]]]:
    """Each prompt token's log-softmax given its prefix (from position 1 on) and the top
    ids there, from one forward of the whole prompt without a cache."""
    logits = loaded.model(mx.array(ids)[None])[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    values = [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]
    tops = mx.argsort(-logprobs, axis=-1)[:, :TOP].tolist()
    return values, [tops[i - 1] for i in range(1, len(ids))]


@pytest.fixture
async def big_server(nursery, big_model):
    # small prefill chunks: the prompt's logprobs are gathered over several forwards
    return await start_server(nursery, big_model, prefill_chunk=16)


def client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                              timeout=60)


async def test_websocket_prompt_logprobs_equal_the_reference(big_server, big_model):
    ids = big_model.tokenizer.encode(PROMPT)
    assert len(ids) > 2 * 16  # spans several prefill chunks
    want, want_top = reference(big_model, ids)
    got = await run_alone(big_server.ws_url, "p", prompt=PROMPT, max_tokens=3,
                          temperature=0, prompt_logprobs=TOP)
    (frame,) = [f for f in got.frames if f["type"] == "prompt_logprobs"]
    assert got.frames.index(frame) == 1  # after queued, before the first token
    assert frame["id"] == "p" and frame["token_ids"] == ids
    assert frame["logprobs"][0] is None and frame["top_logprobs"][0] is None
    assert frame["logprobs"][1:] == pytest.approx(want, abs=TOLERANCE)
    assert [[t for t, _ in top] for top in frame["top_logprobs"][1:]] == want_top
    for top, value, token in zip(frame["top_logprobs"][1:], want, ids[1:]):
        values = [lp for _, lp in top]
        assert values == sorted(values, reverse=True) and len(top) == TOP
        if token in [t for t, _ in top]:
            assert dict(top)[token] == pytest.approx(value, abs=TOLERANCE)
    plain = await run_alone(big_server.ws_url, "q", prompt=PROMPT, max_tokens=3, temperature=0)
    assert got.token_ids == plain.token_ids and len(got.tokens) == 3
    assert not [f for f in plain.frames if f["type"] == "prompt_logprobs"]


async def test_a_batch_mixing_asking_rows_leaves_the_others_alone(big_server):
    prompts = ["def fib(n):\n", "import numpy as np\n\n\ndef softmax(x):\n",
               "for i in range(10):\n"]
    alone = [await run_alone(big_server.ws_url, f"a{i}", prompt=p, max_tokens=12,
                             temperature=0) for i, p in enumerate(prompts)]
    async with open_websocket_url(big_server.ws_url) as ws:
        session = Session(ws)
        for i, p in enumerate(prompts):  # sent at once: rows 0 and 2 ask, row 1 does not
            extra = {"prompt_logprobs": 2} if i != 1 else {}
            await session.generate(f"b{i}", prompt=p, max_tokens=12, temperature=0, **extra)
        mixed = await session.wait("b0", "b1", "b2")
    for i, (one, both) in enumerate(zip(alone, mixed)):
        assert both.token_ids == one.token_ids, i
        asked = [f for f in both.frames if f["type"] == "prompt_logprobs"]
        assert len(asked) == (i != 1)


async def test_completions_echo_with_logprobs_through_the_openai_sdk(big_server, big_model):
    ids = big_model.tokenizer.encode(PROMPT)
    want, _ = reference(big_model, ids)
    api = client(big_server)
    got = await api.completions.create(model="m", prompt=PROMPT, echo=True, logprobs=2,
                                       max_tokens=2, temperature=0)
    (choice,) = got.choices
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT) and got.usage.completion_tokens == 2
    assert len(lp.tokens) == len(ids) + 2 and "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(want, abs=TOLERANCE)
    assert all(len(top) <= 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # streamed: the echo chunk carries the prompt's logprobs, then one chunk per token
    stream = await api.completions.create(model="m", prompt=PROMPT, echo=True, logprobs=0,
                                          max_tokens=2, temperature=0, stream=True)
    chunks = [c async for c in stream]
    first = chunks[0].choices[0]
    assert first.text == PROMPT
    assert first.logprobs.token_logprobs[0] is None
    assert first.logprobs.token_logprobs[1:] == pytest.approx(want, abs=TOLERANCE)
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    # echo without logprobs just prepends the prompt
    bare = await api.completions.create(model="m", prompt=PROMPT, echo=True, max_tokens=2,
                                        temperature=0)
    assert bare.choices[0].text == choice.text and bare.choices[0].logprobs is None


async def test_max_tokens_0_with_echo_scores_the_prompt_only(big_server, big_model):
    """What eval harnesses send to score a text: the prompt back with its logprobs, no
    completion (usage 0, finish_reason length); streamed the same."""
    ids = big_model.tokenizer.encode(PROMPT)
    want, _ = reference(big_model, ids)
    api = client(big_server)
    got = await api.completions.create(model="m", prompt=PROMPT, echo=True, logprobs=1,
                                       max_tokens=0, temperature=0)
    (choice,) = got.choices
    assert (choice.text, choice.finish_reason) == (PROMPT, "length")
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), 0)
    assert len(choice.logprobs.tokens) == len(ids) and "".join(choice.logprobs.tokens) == PROMPT
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(want, abs=TOLERANCE)
    stream = await api.completions.create(model="m", prompt=PROMPT, echo=True, logprobs=1,
                                          max_tokens=0, temperature=0, stream=True,
                                          stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == PROMPT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0
    # without echo, max_tokens 0 is still refused, naming the field
    with pytest.raises(openai.BadRequestError) as caught:
        await api.completions.create(model="m", prompt=PROMPT, max_tokens=0)
    assert "max_tokens" in caught.value.message


async def test_a_prompt_over_the_limit_is_refused_naming_it(big_server):
    api = client(big_server)
    too_long = [5] * (MAX_PROMPT_LOGPROBS_TOKENS + 1)
    with pytest.raises(openai.BadRequestError) as caught:
        await api.completions.create(model="m", prompt=too_long, echo=True, logprobs=1,
                                     max_tokens=1)
    assert str(MAX_PROMPT_LOGPROBS_TOKENS) in caught.value.message
    assert caught.value.body["param"] == "prompt"
    # a short prompt is served: the server is still up
    ok = await api.completions.create(model="m", prompt=too_long[:8], echo=True, logprobs=1,
                                      max_tokens=1)
    assert ok.choices[0].logprobs.token_logprobs[0] is None
    got = await run_alone(big_server.ws_url, "w", prompt_tokens=too_long, max_tokens=1,
                          prompt_logprobs=0)
    assert got.end["type"] == "error" and str(MAX_PROMPT_LOGPROBS_TOKENS) in got.end["message"]
