"""api.ending, synchronously: which engine endings are complete, and what a cut answers."""

from __future__ import annotations

import pytest

from tqserve.actors.messages import Done, Error
from tqserve.api.ending import complete
from tqserve.api.httpcommon import ApiError, Outcome


def done(reason: str) -> Outcome:
    return Outcome(text="x", token_ids=[1, 2], done=Done(
        request_id="r", finish_reason=reason, prompt_tokens=3, completion_tokens=2))


def error(code: str) -> Outcome:
    return Outcome(error=Error(request_id="r", code=code, message=f"{code} happened"))


def test_stop_and_length_are_complete():
    for reason in ("stop", "length"):
        assert complete(done(reason)).finish_reason == reason


@pytest.mark.parametrize("outcome, status, code", [
    (done("shutdown"), 503, "shutdown"),
    (done("cancelled"), 500, "cancelled"),
    (done("something_new"), 500, "something_new"),  # an unknown ending is never complete
    (error("slow_consumer"), 500, "slow_consumer"),
    (error("internal_error"), 500, "internal_error"),
    (error("engine_closed"), 503, "engine_closed"),
    (error("invalid_request"), 400, "invalid_request"),
    (Outcome(), 503, "engine_closed"),
])
def test_every_other_ending_is_a_cut(outcome, status, code):
    with pytest.raises(ApiError) as info:
        complete(outcome)
    assert (info.value.status, info.value.code) == (status, code)
    if outcome.done is not None:
        assert "(2 tokens generated)" in info.value.message
