"""What one request may carry, checked without a model or an event loop."""

import pytest

from tqserve.engine.request import GenerateRequest
from tqserve.engine.sampling import (MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
                             MAX_TOKEN_ID, SamplingParams)

LIMITS = dict(max_prompt_chars=100, max_messages=3, max_prompt_tokens=50)


@pytest.mark.parametrize("field,value,needles", [
    ("stop_token_ids", (MAX_TOKEN_ID + 1,), ("stop_token_ids", str(MAX_TOKEN_ID))),
    ("stop_token_ids", (2**64,), ("stop_token_ids",)),
    ("stop_token_ids", (True,), ("stop_token_ids",)),
    ("stop_token_ids", (0,) * (MAX_STOP_TOKEN_IDS + 1), ("stop_token_ids",
                                                          str(MAX_STOP_TOKEN_IDS))),
    ("stop", ("s",) * (MAX_STOP_STRINGS + 1), ("stop", str(MAX_STOP_STRINGS))),
    ("stop", ("s" * (MAX_STOP_CHARS + 1),), ("stop", str(MAX_STOP_CHARS))),
])
def test_stop_lists_are_bounded(field, value, needles):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    assert all(n in str(info.value) for n in needles), info.value


def test_edges_that_are_accepted():
    SamplingParams(stop_token_ids=(0, MAX_TOKEN_ID) * (MAX_STOP_TOKEN_IDS // 2),
                   stop=("s" * MAX_STOP_CHARS,) * MAX_STOP_STRINGS, seed=2**63 - 1)
    GenerateRequest(prompt_tokens=(0, MAX_TOKEN_ID))
    with pytest.raises(ValueError, match="prompt_tokens"):
        GenerateRequest(prompt_tokens=(MAX_TOKEN_ID + 1,))


@pytest.mark.parametrize("request_,needles", [
    (GenerateRequest(prompt="a" * 101), ("prompt", "100", "--max-prompt-chars")),
    (GenerateRequest(messages=[{"role": "user", "content": "a"}] * 4),
     ("messages", "3", "--max-messages")),
    (GenerateRequest(messages=[{"role": "user", "content": "a" * 101}]),
     ("messages content", "100")),
    (GenerateRequest(prompt_tokens=(1,) * 51), ("prompt_tokens", "50")),
])
def test_check_limits_names_field_and_limit(request_, needles):
    with pytest.raises(ValueError) as info:
        request_.check_limits(**LIMITS)
    assert all(n in str(info.value) for n in needles), info.value


def test_within_the_limits():
    GenerateRequest(prompt="a" * 100).check_limits(**LIMITS)
    GenerateRequest(messages=[{"role": "user", "content": "a" * 33}] * 3).check_limits(**LIMITS)
    assert GenerateRequest(messages=[{"role": "user", "content": "ab"}] * 3).num_chars == 6
