"""Time-aware speculation: per batch-size bucket, speculate only where it is faster.

Sans-io: the caller measures each decode step (seconds, tokens emitted, whether any row
proposed) and passes it in; this core never reads the clock. Per bucket of decode batch
sizes (1, 2, 3-4, 5-8, 9-16, ...) it keeps two decayed throughput estimates:

* plain: tokens per second of steps where no row proposed (one token per row);
* speculative: tokens emitted per second of verify steps (the proposers' time included:
  the step's duration is all of it).

A bucket speculates while its speculative estimate is at least `margin` times its plain
one and turns proposals off where speculation is slower. Both estimates go stale (the
batch's content and acceptance change), so each mode explores the other now and then:
a bucket banks `explore_fraction` of the time it spends in its current mode and, once
the bank covers one step of the other mode (its last measured duration), runs
`explore_steps` measured steps of it, its old estimate scaled by `stale_weight` first (weighed
like about one new step, so the fresh steps decide). So exploring never costs more than about `explore_fraction`
of the time, whichever mode is slow: with speculation 25x slower per token, a plain
bucket still spends at most ~2% of its time trying it. Until a bucket has measured both
modes (`min_samples` steps each) it alternates to learn them: speculative first.
"""

from __future__ import annotations

import enum

import attrs


class Mode(enum.Enum):
    PLAIN = "plain"
    SPECULATIVE = "speculative"


def _fraction(inst: object, attr: attrs.Attribute, value: float) -> None:
    if not 0.0 < value < 1.0:
        raise ValueError(f"{attr.name} must be in (0, 1), got {value!r}")


def _positive(inst: object, attr: attrs.Attribute, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attr.name} must be > 0, got {value!r}")


@attrs.frozen(kw_only=True)
class ThroughputSettings:
    """See the module doc. `decay`: the weight an estimate keeps per new step of its mode."""

    margin: float = attrs.field(default=1.0, validator=_positive)
    # 1%: the actor's decisions lag a step and a switch costs an unmeasured step or two,
    # so an exploration of 4 measured steps runs ~6 steps of the other mode (~1.5% in all)
    explore_fraction: float = attrs.field(default=0.01, validator=_fraction)
    # A verify step's yield swings with acceptance (k + 1 tokens, or 1, at B1): two steps
    # decided on chance (pycoder-29m + draft at B1 learned from two all-rejected steps,
    # 28 tok/s against 60 plain, where speculation ran 1.40x without the policy), so a
    # bucket learns from 8 steps of each mode and explores 4 at a time.
    explore_steps: int = attrs.field(default=4, validator=_positive)
    min_samples: int = attrs.field(default=8, validator=_positive)
    decay: float = attrs.field(default=0.9, validator=_fraction)
    stale_weight: float = attrs.field(default=0.1, validator=_fraction)


def bucket_of(batch_size: int) -> int:
    """The bucket of a decode batch size: 0 for 1, 1 for 2, 2 for 3-4, 3 for 5-8, ..."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return (batch_size - 1).bit_length()


@attrs.define
class _Rate:
    """Decayed sums of tokens and seconds: rate = tokens / seconds."""

    tokens: float = 0.0
    seconds: float = 0.0
    num_samples: int = 0
    last_seconds: float = 0.0  # the duration of the latest step (what exploring costs)

    def add(self, tokens: int, seconds: float, decay: float) -> None:
        self.tokens = self.tokens * decay + tokens
        self.seconds = self.seconds * decay + seconds
        self.num_samples += 1
        self.last_seconds = seconds

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@attrs.define
class _Bucket:
    plain: _Rate = attrs.Factory(_Rate)
    speculative: _Rate = attrs.Factory(_Rate)
    mode: Mode = Mode.SPECULATIVE   # what the estimates favour
    bank: float = 0.0               # seconds earned towards exploring the other mode
    exploring: int = 0              # steps of the other mode still to run
    num_switches: int = 0


@attrs.frozen(kw_only=True)
class BucketStatistics:
    bucket: int
    mode: str
    plain_tok_s: float
    speculative_tok_s: float
    num_plain_steps: int
    num_speculative_steps: int
    num_switches: int


class ThroughputPolicy:
    """Per-bucket throughput books: `speculate(batch)` decides, `observe(...)` learns."""

    def __init__(self, settings: ThroughputSettings = ThroughputSettings()) -> None:
        self.settings = settings
        self._buckets: dict[int, _Bucket] = {}

    def _bucket(self, batch_size: int) -> _Bucket:
        return self._buckets.setdefault(bucket_of(batch_size), _Bucket())

    def speculate(self, batch_size: int) -> bool:
        """Whether rows may propose in a step of `batch_size` decoding rows."""
        b = self._bucket(batch_size)
        want = b.mode
        if b.exploring > 0:
            want = _other(b.mode)
        else:
            learning = self._learning(b)
            if learning is not None:
                want = learning
        return want is Mode.SPECULATIVE

    def _learning(self, b: _Bucket) -> Mode | None:
        """The mode still short of `min_samples` (speculative first), or None."""
        n = self.settings.min_samples
        if b.speculative.num_samples < n:
            return Mode.SPECULATIVE
        if b.plain.num_samples < n:
            return Mode.PLAIN
        return None

    def observe(self, batch_size: int, speculative: bool, tokens: int, seconds: float) -> None:
        """One measured decode step: `batch_size` rows, whether any row proposed, the
        tokens it emitted, its duration. ValueError for a negative duration or count."""
        if seconds < 0 or tokens < 0:
            raise ValueError(f"a step of {tokens} tokens in {seconds} s cannot be measured")
        s = self.settings
        b = self._bucket(batch_size)
        mode = Mode.SPECULATIVE if speculative else Mode.PLAIN
        (b.speculative if speculative else b.plain).add(tokens, seconds, s.decay)
        if self._learning(b) is not None:
            return
        if mode is b.mode:
            b.bank += s.explore_fraction * seconds
            other = b.plain if mode is Mode.SPECULATIVE else b.speculative
            if b.exploring == 0 and b.bank >= other.last_seconds * s.explore_steps:
                b.bank = 0.0
                b.exploring = s.explore_steps
                other.tokens *= s.stale_weight  # old figures count about as much as
                other.seconds *= s.stale_weight  # one new step: the batch has changed
        elif b.exploring > 0:
            b.exploring -= 1
        best = Mode.SPECULATIVE if b.speculative.rate >= s.margin * b.plain.rate else Mode.PLAIN
        if best is not b.mode:
            b.mode, b.bank, b.exploring = best, 0.0, 0
            b.num_switches += 1

    def statistics(self) -> tuple[BucketStatistics, ...]:
        return tuple(BucketStatistics(
            bucket=k, mode=b.mode.value, plain_tok_s=b.plain.rate,
            speculative_tok_s=b.speculative.rate, num_plain_steps=b.plain.num_samples,
            num_speculative_steps=b.speculative.num_samples, num_switches=b.num_switches)
            for k, b in sorted(self._buckets.items()))


def _other(mode: Mode) -> Mode:
    return Mode.PLAIN if mode is Mode.SPECULATIVE else Mode.SPECULATIVE
