"""Presence / frequency penalties and logit_bias in batched sampling (engine.penalties)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tqserve.engine.sampling import RowSampler, SamplingParams, sample_rows

VOCAB = 16


def greedy_run(params: SamplingParams, logits: np.ndarray, steps: int) -> list[int]:
    row = RowSampler.create(params, prompt=[3, 3, 3])
    return [sample_rows(mx.array(logits[None]), [row]).tokens[0] for _ in range(steps)]


def test_penalties_and_bias_move_greedy_choices():
    logits = np.linspace(0.0, 1.5, VOCAB).astype(np.float32)  # token 15 best, steps of 0.1
    plain = SamplingParams(temperature=0, max_tokens=4)
    assert greedy_run(plain, logits, 4) == [15, 15, 15, 15]
    # presence 1.0 > the whole spread: each token once, down the ranking; the prompt's 3s
    # do not count (OpenAI's penalties are over the output)
    presence = SamplingParams(temperature=0, max_tokens=4, presence_penalty=1.0)
    assert greedy_run(presence, logits, 4) == [15, 14, 13, 12]
    # frequency 0.15: a token loses 0.15 per use; 15 (1.5) -> 1.35 < 14 (1.4) after one
    freq = SamplingParams(temperature=0, max_tokens=4, frequency_penalty=0.15)
    assert greedy_run(freq, logits, 4) == [15, 14, 15, 13]
    bias = SamplingParams(temperature=0, logit_bias={"2": 5.0, 15: -100})
    assert greedy_run(bias, logits, 2) == [2, 2]


def test_a_batch_mixes_rows_with_and_without():
    logits = mx.array(np.tile(np.linspace(0.0, 1.5, VOCAB, dtype=np.float32), (2, 1)))
    rows = [RowSampler.create(SamplingParams(temperature=0), []),
            RowSampler.create(SamplingParams(temperature=0, logit_bias={0: 50}), [])]
    assert sample_rows(logits, rows).tokens == [15, 0]
    # the advanced copy (a speculative verify position) carries the counts
    row = RowSampler.create(SamplingParams(temperature=0, presence_penalty=1.0), [])
    assert row.advanced([7, 7]).counts == {7: 2} and row.counts == {}


@pytest.mark.parametrize("kwargs, word", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency"),
    (dict(logit_bias={"a": 1}), "logit_bias"), (dict(logit_bias={1: 200}), "logit_bias"),
    (dict(logit_bias={-1: 1}), "logit_bias")])
def test_bad_values_name_the_field(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)
