"""Sans-io parts of speculation: prompt lookup, the per-row policy (batch-size limit,
back-off), and the request field's validation."""

from __future__ import annotations

import random

import pytest

from tqserve.engine.speculative.policy import (SpecChoice, SpecPolicy, SpeculationPolicy,
                                               parse_speculative)
from tqserve.engine.speculative.lookup import LookupSettings, lookup_tokens
from tqserve.engine.speculative.throughput import ThroughputSettings
from tqserve.tools.bench_lookup import scan_lookup  # the definition, scanned in Python


def test_lookup_proposes_what_followed_the_latest_match() -> None:
    s = LookupSettings(max_ngram=3, min_ngram=1)
    assert lookup_tokens([1, 2, 3, 4, 5, 9, 1, 2, 3], 2, s) == (4, 5)
    # the most recent match of the longest n-gram wins
    assert lookup_tokens([1, 2, 7, 8, 1, 2, 5, 6, 1, 2], 3, s) == (5, 6, 1)
    assert lookup_tokens([5, 6, 7], 4, s) == ()
    assert lookup_tokens([3, 3], 4, s) == (3,)
    with pytest.raises(ValueError, match="n-gram"):
        LookupSettings(max_ngram=2, min_ngram=3)


def test_lookup_equals_the_plain_scan_on_random_contexts() -> None:
    rng = random.Random(7)
    found = 0
    for _ in range(3000):
        vocab = rng.choice([2, 3, 5, 100, 32000])
        context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))]
        high = rng.randrange(1, 6)
        s = LookupSettings(max_ngram=high, min_ngram=rng.randrange(1, high + 1))
        k = rng.randrange(0, 6)
        want = scan_lookup(context, k, s)
        assert lookup_tokens(context, k, s) == want, (context, k, s)
        found += bool(want)
    assert 1000 < found < 3000  # both outcomes were exercised
    long = [rng.randrange(50) for _ in range(5000)]  # a long context, numpy's int64 path
    assert lookup_tokens(long, 4, LookupSettings()) == scan_lookup(long, 4, LookupSettings())


def test_policy_limits_by_batch_and_backs_off() -> None:
    policy = SpeculationPolicy(SpecPolicy(max_batch=4, backoff_threshold=0.5, backoff_steps=2,
                                          ema_weight=0.5, time_policy=False))
    policy.open_row("a", SpecChoice(method="lookup", num_tokens=4))
    policy.open_row("plain", None)
    assert policy.decide(["plain", "a"], 1) == {"plain": 0, "a": 4}
    assert policy.decide(["a"], 4) == {"a": 4}
    assert policy.decide(["a"], 5) == {"a": 0}       # batch larger than the policy's limit
    policy.verified("a", 4, 4)
    assert policy.decide(["a"], 1) == {"a": 4}
    policy.verified("a", 4, 0)                      # rate 0.5 -> 0.5: not below
    policy.verified("a", 4, 0)                      # 0.25: backs off for 2 steps
    assert [policy.decide(["a"], 1)["a"] for _ in range(3)] == [0, 0, 4]
    stats = policy.statistics()
    assert (stats.num_proposed, stats.num_accepted, stats.num_verify_steps,
            stats.num_backoffs, stats.buckets) == (12, 4, 3, 1, ())
    policy.verified("a", 4, 0)                      # back at the threshold: one bad step
    assert policy.decide(["a"], 1) == {"a": 0}
    policy.close_row("a")
    assert policy.decide(["a"], 1) == {"a": 0} and policy.statistics().num_rows == 1


def test_policy_asks_the_time_policy_per_bucket() -> None:
    policy = SpeculationPolicy(SpecPolicy(throughput=ThroughputSettings(min_samples=1)))
    policy.open_row("a", SpecChoice(method="draft", num_tokens=3))
    assert policy.decide(["a"], 1) == {"a": 3}      # learning: speculative first
    policy.observe_step(1, True, 2, 0.1)            # 20 tok/s speculating
    assert policy.decide(["a"], 1) == {"a": 0}      # learning: plain next
    policy.observe_step(1, False, 1, 0.01)          # 100 tok/s plain: off in bucket 0
    assert policy.decide(["a"], 1) == {"a": 0}
    assert policy.decide(["a", "b"], 2) == {"a": 3, "b": 0}  # bucket 1 still learns
    (bucket,) = policy.statistics().buckets[:1]
    assert (bucket.bucket, bucket.mode, bucket.plain_tok_s, bucket.speculative_tok_s) == (
        0, "plain", pytest.approx(100.0), pytest.approx(20.0))


@pytest.mark.parametrize("value,message", [
    ({"method": "beam"}, "speculative.method must be one of"),
    ({"method": "draft", "num_tokens": 0}, "speculative.num_tokens must be"),
    ({"method": "draft", "extra": 1}, "speculative must be false, true or"),
    ("draft", "speculative must be false, true or"),
    ({"num_tokens": 3}, "speculative must be false, true or"),
])
def test_bad_speculative_fields_are_named(value, message) -> None:
    with pytest.raises(ValueError) as info:
        parse_speculative(value)
    assert str(info.value).startswith(message)


def test_speculative_field_forms() -> None:
    assert parse_speculative(None) is None and parse_speculative(False) is False
    assert parse_speculative({"method": "mtp"}) == SpecChoice(method="mtp", num_tokens=4)
