"""The WebSocket protocol on a real server: frame kinds, multiplexing, streams, stops."""

from __future__ import annotations

import pytest
from trio_websocket import open_websocket_url

from tests.api.wsclient import Session, assert_well_formed, run_alone
from tests.conftest import start_server

PROMPT = "def add(a, b):"


async def test_multiplexed_mixed_requests_match_running_alone(server, draft_model):
    tok = draft_model.tokenizer
    eos = draft_model.eos_token_ids
    assert getattr(tok, "chat_template", None) is None  # chat falls back to "role: content"
    prompt_ids = list(tok.encode(PROMPT))
    chat = [{"role": "user", "content": "hi"}]
    requests = {  # id -> (binary, fields, expected prompt_tokens)
        "p-json": (False, dict(prompt=PROMPT, max_tokens=12, temperature=0), len(prompt_ids)),
        "t-msgpack": (True, dict(prompt_tokens=prompt_ids, max_tokens=12, temperature=0),
                      len(prompt_ids)),
        "m-json": (False, dict(messages=chat, max_tokens=10, temperature=0),
                   len(tok.encode("user: hi\nassistant: "))),
        "s-msgpack": (True, dict(prompt="class Foo:", max_tokens=12, temperature=0.8,
                                 seed=1234), len(tok.encode("class Foo:"))),
    }
    async with open_websocket_url(server.ws_url) as ws:
        session = Session(ws)
        for rid, (binary, fields, _) in requests.items():
            await session.generate(rid, binary, **fields)
        results = await session.wait(*requests)
    assert session.unrouted == []
    for result, (rid, (binary, fields, n_prompt)) in zip(results, requests.items()):
        assert_well_formed(result, tok, binary=binary, stop_ids=eos, prompt_tokens=n_prompt)
        assert 1 <= len(result.tokens) <= fields["max_tokens"]
        if result.finish_reason == "length":
            assert len(result.tokens) == fields["max_tokens"]
        else:
            assert result.finish_reason == "stop" and result.token_ids[-1] in eos
        alone = await run_alone(server.ws_url, rid, binary, **fields)
        assert alone.token_ids == result.token_ids, rid
        assert alone.text == result.text
    # prompt text and its token ids are the same request
    assert results[0].token_ids == results[1].token_ids


async def test_logprobs_and_top_logprobs(server, draft_model):
    common = dict(prompt=PROMPT, max_tokens=8, temperature=0)
    async with open_websocket_url(server.ws_url) as ws:
        session = Session(ws)
        await session.generate("top", True, logprobs=True, top_logprobs=5, **common)
        await session.generate("lp", False, logprobs=True, **common)
        await session.generate("none", False, **common)
        await session.generate("sampled", False, top_logprobs=20, seed=7, **{
            **common, "temperature": 1.0})
        top, lp, none, sampled = await session.wait("top", "lp", "none", "sampled")
    for result, binary in ((top, True), (lp, False), (none, False), (sampled, False)):
        assert_well_formed(result, draft_model.tokenizer, binary=binary,
                           stop_ids=draft_model.eos_token_ids)
    assert top.token_ids == lp.token_ids == none.token_ids
    for t_top, t_lp, t_none in zip(top.tokens, lp.tokens, none.tokens):
        pairs = t_top["top_logprobs"]
        assert len(pairs) == 5
        values = [v for _, v in pairs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert len({i for i, _ in pairs}) == 5
        assert isinstance(t_top["logprob"], float) and t_top["logprob"] <= 0
        # greedy: the sampled token is the most likely one
        assert pairs[0][0] == t_top["token_id"]
        assert pairs[0][1] == pytest.approx(t_top["logprob"], abs=1e-6)
        assert t_lp["logprob"] == pytest.approx(t_top["logprob"], abs=1e-4)
        assert t_lp["top_logprobs"] is None
        assert t_none["logprob"] is None and t_none["top_logprobs"] is None
    for t in sampled.tokens:
        pairs = t["top_logprobs"]
        assert len(pairs) == 20
        values = [v for _, v in pairs]
        assert values == sorted(values, reverse=True)
        assert t["logprob"] <= values[0] + 1e-6 and t["logprob"] <= 0
        assert sum(2.718281828459045 ** v for v in values) <= 1 + 1e-4
        listed = dict((i, v) for i, v in pairs)
        if t["token_id"] in listed:
            assert listed[t["token_id"]] == pytest.approx(t["logprob"], abs=1e-6)


async def test_stop_string_ends_before_it(server, draft_model):
    tok = draft_model.tokenizer
    ref = await run_alone(server.ws_url, "ref", prompt=PROMPT, max_tokens=16, temperature=0)
    assert ref.finish_reason == "length" and len(ref.text) >= 8, ref.text
    mid = len(ref.text) // 2
    stop = ref.text[mid:mid + 3]
    cut = ref.text.find(stop)
    # the stop string completes with the first token whose decode contains it
    n_tokens = next(k for k in range(1, 17) if stop in tok.decode(ref.token_ids[:k]))
    result = await run_alone(server.ws_url, "s", True, prompt=PROMPT, max_tokens=16,
                             temperature=0, stop=["\x00never", stop])
    assert_well_formed(result, tok, binary=True, check_text=False)
    assert result.finish_reason == "stop"
    assert result.text == ref.text[:cut]
    assert stop not in result.text
    assert result.token_ids == ref.token_ids[:n_tokens]


async def test_stop_token_ids(server, draft_model):
    tok = draft_model.tokenizer
    ref = await run_alone(server.ws_url, "ref", prompt=PROMPT, max_tokens=16, temperature=0)
    assert ref.finish_reason == "length"
    stop_id = ref.token_ids[4]
    first = ref.token_ids.index(stop_id)
    result = await run_alone(server.ws_url, "s", prompt=PROMPT, max_tokens=16, temperature=0,
                             stop_token_ids=[stop_id])
    assert_well_formed(result, tok, binary=False, stop_ids=frozenset({stop_id}))
    assert result.finish_reason == "stop"
    assert result.token_ids == ref.token_ids[:first + 1]
    assert result.tokens[-1]["text"] == ""
    assert result.text == tok.decode(ref.token_ids[:first])


async def test_max_tokens_and_default_max_tokens(nursery, draft_model):
    server = await start_server(nursery, draft_model, default_max_tokens=3)
    one = await run_alone(server.ws_url, "one", prompt=PROMPT, max_tokens=1, temperature=0)
    default = await run_alone(server.ws_url, "default", True, prompt=PROMPT, temperature=0)
    for result, binary, n in ((one, False, 1), (default, True, 3)):
        assert_well_formed(result, draft_model.tokenizer, binary=binary)
        assert result.finish_reason == "length"
        assert len(result.tokens) == n
    assert default.token_ids[:1] == one.token_ids
