"""Several choices per request (`n`, lists of prompts), `echo`, penalties and logit_bias
over the official client."""

from __future__ import annotations

import openai

PROMPTS = ["def add(a, b):", "class Stack:"]


def client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                              timeout=60)


async def test_n_and_prompt_lists_equal_single_requests(server):
    api = client(server)
    common = dict(model="m", max_tokens=8, temperature=1.0, seed=11)
    got = await api.completions.create(prompt=PROMPTS, n=2, **common)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(PROMPTS):
        for j in range(2):  # sample j of a prompt is seeded seed + j
            alone = await api.completions.create(prompt=prompt, **{**common, "seed": 11 + j})
            assert got.choices[2 * i + j].text == alone.choices[0].text, (i, j)
    assert got.usage.completion_tokens == 4 * 8
    singles = [await api.completions.create(prompt=p, model="m", max_tokens=1) for p in PROMPTS]
    assert got.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    chat = await api.chat.completions.create(
        model="m", n=3, messages=[{"role": "user", "content": PROMPTS[0]}], **{
            k: v for k, v in common.items() if k != "model"})
    assert len({c.message.content for c in chat.choices}) > 1  # different seeds, samples
    texts, finishes = {}, {}
    async for chunk in await api.chat.completions.create(
            model="m", n=3, messages=[{"role": "user", "content": PROMPTS[0]}], stream=True,
            **{k: v for k, v in common.items() if k != "model"}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            finishes[c.index] = c.finish_reason or finishes.get(c.index)
    assert texts == {c.index: c.message.content for c in chat.choices}
    assert finishes == {0: "length", 1: "length", 2: "length"}


async def test_echo_penalties_and_logit_bias(server, draft_model):
    api = client(server)
    echoed = await api.completions.create(model="m", prompt=PROMPTS[0], max_tokens=5,
                                          temperature=0, echo=True)
    plain = await api.completions.create(model="m", prompt=PROMPTS[0], max_tokens=5,
                                         temperature=0)
    assert echoed.choices[0].text == PROMPTS[0] + plain.choices[0].text
    text = ""
    async for chunk in await api.completions.create(model="m", prompt=PROMPTS[0],
                                                    max_tokens=5, temperature=0, echo=True,
                                                    stream=True):
        text += chunk.choices[0].text if chunk.choices else ""
    assert text == echoed.choices[0].text
    token = draft_model.tokenizer.encode(" banana")[0]
    biased = await api.completions.create(model="m", prompt=PROMPTS[0], max_tokens=4,
                                          temperature=0, logit_bias={str(token): 100})
    assert biased.choices[0].text == draft_model.tokenizer.decode([token] * 4)
    greedy = await api.completions.create(model="m", prompt=PROMPTS[1], max_tokens=24,
                                          temperature=0)
    penalized = [await api.completions.create(model="m", prompt=PROMPTS[1], max_tokens=24,
                                              temperature=0, presence_penalty=2.0,
                                              frequency_penalty=1.0) for _ in range(2)]
    assert penalized[0].choices[0].text == penalized[1].choices[0].text  # deterministic
    assert penalized[0].choices[0].text != greedy.choices[0].text
    ids = draft_model.tokenizer.encode(penalized[0].choices[0].text)
    assert len(set(ids)) > len(set(draft_model.tokenizer.encode(greedy.choices[0].text)))
