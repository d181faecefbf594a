"""The time-aware speculation core (engine.speculative.throughput), with synthetic step
durations: no clock, no model. Each scenario drives it as the runner does: ask
`speculate(batch)`, then report the step it ran (a speculative step only if it said so)."""

from __future__ import annotations

import pytest

from tqserve.engine.speculative.throughput import (ThroughputPolicy, ThroughputSettings,
                                                   bucket_of)


def drive(policy: ThroughputPolicy, batch: int, steps: int, spec_tokens: float,
          spec_seconds: float, plain_seconds: float) -> tuple[list[bool], float, int]:
    """Run `steps` steps of `batch` rows: a speculative step emits `spec_tokens` per row
    in `spec_seconds`, a plain one a token per row in `plain_seconds`. Returns the modes
    taken, the seconds spent and the tokens emitted."""
    modes, seconds, tokens = [], 0.0, 0
    for _ in range(steps):
        spec = policy.speculate(batch)
        n = round(spec_tokens * batch) if spec else batch
        t = spec_seconds if spec else plain_seconds
        policy.observe(batch, spec, n, t)
        modes.append(spec)
        seconds += t
        tokens += n
    return modes, seconds, tokens


def test_buckets_are_powers_of_two() -> None:
    assert [bucket_of(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 64)] == [
        0, 1, 2, 2, 3, 3, 4, 4, 5, 6]
    with pytest.raises(ValueError, match="batch_size"):
        bucket_of(0)


def test_switches_off_where_speculation_is_slower_and_stays_above_097() -> None:
    policy = ThroughputPolicy()
    # speculation 25x slower per token (the H200 figure: 0.04x of plain)
    modes, seconds, tokens = drive(policy, 8, 2000, spec_tokens=2.0, spec_seconds=0.5,
                                   plain_seconds=0.01)
    n = ThroughputSettings().min_samples
    assert modes[:n] == [True] * n and modes[n:2 * n] == [False] * n  # learns both
    assert sum(modes[2 * n:]) <= 2 * ThroughputSettings().explore_steps  # ~1%: a few tries
    plain_rate = 8 / 0.01
    # over a long run the exploration costs little; past the learning, >= 0.97x
    tail_modes, tail_seconds, tail_tokens = drive(policy, 8, 4000, 2.0, 0.5, 0.01)
    assert tail_tokens / tail_seconds >= 0.97 * plain_rate
    (stats,) = policy.statistics()
    assert (stats.bucket, stats.mode, stats.num_switches) == (3, "plain", 1)
    assert stats.plain_tok_s == pytest.approx(plain_rate)
    assert stats.speculative_tok_s == pytest.approx(16 / 0.5)


def test_stays_on_where_faster_and_explores_plain_rarely() -> None:
    policy = ThroughputPolicy()
    modes, seconds, tokens = drive(policy, 1, 3000, spec_tokens=3.0, spec_seconds=0.015,
                                   plain_seconds=0.01)
    assert sum(1 for m in modes if not m) <= 2 + 2 * 3000 * 0.015 * 0.02 / (2 * 0.01) + 2
    assert tokens / seconds >= 0.97 * 3.0 / 0.015
    assert policy.statistics()[0].mode == "speculative"
    assert policy.statistics()[0].num_switches == 0


def test_buckets_decide_independently() -> None:
    policy = ThroughputPolicy(ThroughputSettings(min_samples=1))
    drive(policy, 1, 50, spec_tokens=3.0, spec_seconds=0.02, plain_seconds=0.01)
    drive(policy, 8, 50, spec_tokens=1.5, spec_seconds=0.03, plain_seconds=0.01)
    assert policy.speculate(1) and not policy.speculate(7)
    assert [(s.bucket, s.mode) for s in policy.statistics()] == [
        (0, "speculative"), (3, "plain")]


def test_re_explores_and_switches_back_when_speculation_becomes_faster() -> None:
    policy = ThroughputPolicy()
    drive(policy, 4, 200, spec_tokens=1.2, spec_seconds=0.05, plain_seconds=0.01)
    assert not policy.speculate(4)
    # the batch changed (e.g. an edit task: long accepted runs): speculation now wins
    modes, _, _ = drive(policy, 4, 3000, spec_tokens=4.0, spec_seconds=0.012,
                        plain_seconds=0.01)
    switch = modes.index(True)
    assert switch < 3000 and all(modes[switch + 5:switch + 50])  # it stays on
    assert policy.statistics()[0].num_switches == 2
    # and back off again when it gets slow
    modes, _, _ = drive(policy, 4, 3000, spec_tokens=1.0, spec_seconds=0.02,
                        plain_seconds=0.01)
    assert not any(modes[-100:]) or sum(modes[-100:]) <= 2
    assert policy.statistics()[0].mode == "plain"


def test_margin_and_bad_input() -> None:
    policy = ThroughputPolicy(ThroughputSettings(margin=1.5, min_samples=1))
    drive(policy, 10, 20, spec_tokens=1.3, spec_seconds=0.01, plain_seconds=0.01)
    assert policy.statistics()[0].mode == "plain"  # 1.3x faster is below the 1.5x margin
    with pytest.raises(ValueError, match="cannot be measured"):
        policy.observe(2, True, 3, -0.1)
    with pytest.raises(ValueError, match="explore_fraction"):
        ThroughputSettings(explore_fraction=1.5)
