"""The hub: one StepTokens per step becomes one Token event per token, detokenized per
stream; a stop string found there ends the stream and cancels the row (reply edge)."""

import trio

from tqserve.engine.step import TokenOut
from tqserve.actors.hub import Hub
from tqserve.actors.messages import Cancel, Done, StepTokens, Token
from tqserve.engine.detokenize import TextStream


def _hub(tokenizer, buffer=64):
    return Hub(buffer, lambda stop: TextStream(tokenizer, stop))


def _drain(receive):
    out = []
    while True:
        try:
            out.append(receive.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return out


def _done(rid, n, reason="length"):
    return Done(request_id=rid, finish_reason=reason, prompt_tokens=3, completion_tokens=n)


async def test_step_tokens_split_per_stream_with_own_text(draft_model):
    tok = draft_model.tokenizer
    hub = _hub(tok)
    a, b = hub.open_stream("a"), hub.open_stream("b", label="caller's id")
    ids = tok.encode("def f(x):\n    return x")
    hub.deliver(StepTokens(rows=(
        TokenOut(request_id="a", index=0, token_ids=ids[:3], logprobs=(-1.0, -2.0, -3.0),
                  top_logprobs=(((ids[0], -1.0),), ((ids[1], -2.0),), ((ids[2], -3.0),))),
        TokenOut(request_id="b", index=0, token_ids=ids[:1]),
        TokenOut(request_id="gone", index=0, token_ids=ids[:1]))))
    hub.deliver(StepTokens(rows=(
        TokenOut(request_id="a", index=3, token_ids=tuple(ids[3:]) + (0,), final=True,
                  stop_token=True),)))
    hub.deliver(_done("a", len(ids) + 1, "stop"))
    events = _drain(a)
    tokens = [e for e in events if isinstance(e, Token)]
    assert [t.index for t in tokens] == list(range(len(ids) + 1))
    assert [t.token_id for t in tokens] == list(ids) + [0]
    assert [t.text for t in tokens[:-1]] == [tok.decode([t]) for t in ids]  # own text each
    assert tokens[-1].text == ""  # the stop token
    assert [t.logprob for t in tokens[:3]] == [-1.0, -2.0, -3.0] and tokens[3].logprob is None
    assert tokens[1].top_logprobs == ((ids[1], -2.0),) and tokens[3].top_logprobs is None
    assert events[-1] == _done("a", len(ids) + 1, "stop")
    [b_token] = _drain(b)
    assert b_token.token_id == ids[0] and b_token.request_id == "caller's id"
    stats = hub.statistics()
    assert stats.num_streams == 1 and stats.num_dropped == 1 and stats.num_stopped == 0


async def test_stop_string_drops_later_tokens_cancels_and_counts_what_was_delivered(draft_model):
    tok = draft_model.tokenizer
    hub = _hub(tok)
    receive = hub.open_stream("s", stop=("return",))
    ids = tok.encode("x = 1\nreturn y\nz = 2")
    cut = next(i for i in range(len(ids)) if "return" in tok.decode(ids[:i + 1]))
    # the stop string completes inside a multi-token entry; more tokens follow in it and in
    # the next step, sampled before the cancel could reach the scheduler
    hub.deliver(StepTokens(rows=(TokenOut(request_id="s", index=0, token_ids=ids[:cut + 2]),)))
    hub.deliver(StepTokens(rows=(TokenOut(request_id="s", index=cut + 2,
                                           token_ids=ids[cut + 2:]),)))
    [cancel] = await hub.wait_cancels()
    assert cancel == Cancel(request_id="s", reason="stop", num_tokens=cut + 1)
    hub.deliver(_done("s", len(ids), "length"))  # the row reached max_tokens meanwhile
    events = _drain(receive)
    tokens = [e for e in events if isinstance(e, Token)]
    assert [t.index for t in tokens] == list(range(cut + 1))
    assert "".join(t.text for t in tokens) == "x = 1\n"
    done = events[-1]
    assert isinstance(done, Done) and done.finish_reason == "stop"
    assert done.completion_tokens == cut + 1
    stats = hub.statistics()
    assert stats.num_streams == 0 and stats.num_stopped == 1
    assert stats.num_dropped == len(ids) - (cut + 1)


async def test_stop_string_on_a_final_token_needs_no_cancel(draft_model):
    tok = draft_model.tokenizer
    hub = _hub(tok)
    receive = hub.open_stream("s", stop=("\n",))
    ids = tok.encode("a = 1\n")
    hub.deliver(StepTokens(rows=(TokenOut(request_id="s", index=0, token_ids=ids,
                                           final=True),)))
    hub.deliver(_done("s", len(ids)))
    with trio.move_on_after(0) as scope:  # nothing queued: returns only if a cancel were
        await hub.wait_cancels()
    assert scope.cancelled_caught
    events = _drain(receive)
    assert "".join(e.text for e in events[:-1]) == "a = 1"
    assert events[-1].finish_reason == "stop" and events[-1].completion_tokens == len(ids)


async def test_overflow_cuts_the_stream_and_cancels(draft_model):
    hub = _hub(draft_model.tokenizer, buffer=2)
    hub.open_stream("slow")
    hub.deliver(StepTokens(rows=(TokenOut(request_id="slow", index=0, token_ids=(5, 6, 7)),)))
    assert hub.overflowed("slow") and not hub.is_open("slow")
    assert await hub.wait_cancels() == [Cancel(request_id="slow")]
