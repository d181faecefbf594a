"""serve --record's recorder: records admitted requests; a full queue drops messages
without waiting and leaves every request in flight at the drop out of the file."""

from __future__ import annotations

import trio.testing

from tqserve.engine.step import TokenOut
import tqserve.api.recorder as recorder_mod
from tqserve.actors.messages import (Done, Error, Queued, StepTokens, Submit, Token,
                                     encode)
from tqserve.engine.sampling import SamplingParams
from tqserve.storage.recording import read_recording

WRITE_POLLS = 10_000  # bounded polls for the worker thread's write


def _request(hook, rid: str, n_tokens: int, *, done: bool = True) -> None:
    hook("admission", encode(Submit(request_id=rid, prompt_tokens=(2, 3, 4),
                                    params=SamplingParams(max_tokens=9, seed=5))))
    hook("cache_owner", b"ignored")  # other mailboxes are not recorded
    hook("hub", encode(Queued(request_id=rid)))
    for i in range(n_tokens):
        hook("hub", encode(Token(request_id=rid, index=i, token_id=10 + i, text="x")))
    if done:
        hook("hub", encode(Done(request_id=rid, finish_reason="length", prompt_tokens=3,
                                completion_tokens=n_tokens)))


async def test_full_queue_drops_and_leaves_in_flight_requests_out(tmp_path, monkeypatch):
    monkeypatch.setattr(recorder_mod, "RECORD_QUEUE", 8)
    path = tmp_path / "rec.tqrec"
    async with recorder_mod.open_recorder(path, {"model": "m", "config": {}}) as (hook, stats):
        _request(hook, "a", 3)
        hook("admission", encode(Submit(request_id="refused", prompt_tokens=(2,),
                                        params=SamplingParams())))
        hook("hub", encode(Error(request_id="refused", code="overloaded", message="full")))
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(WRITE_POLLS):  # the write runs on a worker thread
            if stats().num_recorded == 1:
                break
            await trio.sleep(0.001)
        assert stats().num_recorded == 1
        _request(hook, "b", 4, done=False)   # 6 queued, then b's tokens overflow the queue
        _request(hook, "torn", 5)            # dropped in part
        assert stats().num_dropped_messages > 0
        await trio.testing.wait_all_tasks_blocked()
        _request(hook, "c", 2)               # after the gap: complete
        _request(hook, "d", 1)
    header, records = read_recording(path)
    assert header["model"] == "m"
    assert [r["request_id"] for r in records] == ["a", "c", "d"]
    a = records[0]
    assert a["prompt_tokens"] == [2, 3, 4] and a["output_tokens"] == [10, 11, 12]
    assert a["params"]["seed"] == 5 and a["params"]["max_tokens"] == 9
    assert a["finish_reason"] == "length" and a["arrival_s"] >= 0
    assert records[1]["output_tokens"] == [10, 11]
    s = stats()
    assert s.num_recorded == 3 and s.num_incomplete >= 1


async def test_step_tokens_are_recorded_and_cut_at_the_done_count(tmp_path):
    path = tmp_path / "rec.tqrec"
    async with recorder_mod.open_recorder(path, {"model": "m", "config": {}}) as (hook, stats):
        for rid in ("s", "t"):
            hook("admission", encode(Submit(request_id=rid, prompt_tokens=(2,),
                                            params=SamplingParams(max_tokens=9))))
            hook("hub", encode(Queued(request_id=rid)))
        hook("hub", encode(StepTokens(rows=(TokenOut(request_id="s", index=0,
                                                      token_ids=(5, 6)),
                                            TokenOut(request_id="t", index=0,
                                                      token_ids=(7,))))))
        hook("hub", encode(StepTokens(rows=(TokenOut(request_id="s", index=2,
                                                      token_ids=(8,)),))))
        # a stop string met at token 6 (the hub's cancel counted 2): token 8 is cut
        hook("hub", encode(Done(request_id="s", finish_reason="stop", prompt_tokens=1,
                                completion_tokens=2)))
        hook("hub", encode(Done(request_id="t", finish_reason="length", prompt_tokens=1,
                                completion_tokens=1)))
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(WRITE_POLLS):
            if stats().num_recorded == 2:
                break
            await trio.sleep(0.001)
    _, records = read_recording(path)
    assert {r["request_id"]: r["output_tokens"] for r in records} == {"s": [5, 6], "t": [7]}
