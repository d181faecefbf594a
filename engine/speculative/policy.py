"""How many tokens each row proposes this step: the per-request choice, the batch-size
policy and per-row adaptive back-off. Sans-io (no MLX): plain books per row.

* A row speculates with its request's `SpecChoice` (method, num_tokens), or the server's
  default, or not at all (`speculative: false`).
* Batch-size policy (`max_batch`): when more rows decode than that, no row proposes (a
  verify block costs every row L positions of attention and the per-token saving shrinks
  as the batch grows); 0 means no limit.
* Back-off: each row keeps an exponential moving average of its acceptance rate (accepted
  / proposed per verify step, weight `ema_weight`); below `backoff_threshold` the row
  stops proposing for `backoff_steps` steps, then tries again with its average reset to
  the threshold (so one more bad step backs it off again).
* Time (engine.speculative.throughput, unless `time_policy` is off): per batch-size
  bucket, rows propose only while measured speculative throughput beats plain decoding;
  the caller reports every measured decode step (`observe_step`).
"""

from __future__ import annotations

import attrs

from tqserve.engine.speculative.throughput import (BucketStatistics, ThroughputPolicy,
                                                   ThroughputSettings)

METHODS = ("draft", "mtp", "lookup")
MAX_SPECULATIVE_TOKENS = 16


def _method(inst: object, attr: attrs.Attribute, value: str) -> None:
    if value not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, "
                         f"got {value!r}")


def _num_tokens(inst: object, attr: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not (
            1 <= value <= MAX_SPECULATIVE_TOKENS):
        raise ValueError(f"num_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                         f"got {value!r}")


@attrs.frozen(kw_only=True)
class SpecChoice:
    """A request's speculation: which proposer and how many tokens per step."""

    method: str = attrs.field(validator=_method)
    num_tokens: int = attrs.field(default=4, validator=_num_tokens)


# a request's choice: a SpecChoice, False (never speculate), True/None (the server's default)
RequestChoice = SpecChoice | bool | None


def parse_speculative(value: object) -> RequestChoice:
    """A request's `speculative` field: {"method": ..., "num_tokens": ...} (num_tokens
    optional, default 4), false (never speculate), true/null (the server's default).
    ValueError naming the field otherwise."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, SpecChoice):
        return value
    if not isinstance(value, dict) or set(value) - {"method", "num_tokens"} or "method" not in value:
        raise ValueError('speculative must be false, true or {"method": "draft"|"mtp"|"lookup", '
                         '"num_tokens": 1..16}')
    try:
        return SpecChoice(**value)
    except ValueError as exc:
        raise ValueError(f"speculative.{exc}") from None


def resolve_choice(choice: object, default: SpecChoice | None) -> SpecChoice | None:
    """A request's effective speculation: False -> none, None/True -> the server's
    default, a SpecChoice -> itself."""
    if choice is False:
        return None
    if choice is None or choice is True:
        return default
    if not isinstance(choice, SpecChoice):
        raise TypeError(f"speculative must be a SpecChoice, a bool or None, got {choice!r}")
    return choice


def check_speculative(methods: frozenset[str], speculative: object) -> None:
    """ValueError naming speculative.method if a request's method is not one of `methods`
    (the proposers served)."""
    method = getattr(speculative, "method", None)
    if method is not None and method not in methods:
        served = ", ".join(sorted(methods)) or "none"
        raise ValueError(f"speculative.method {method!r} is not served here (served: "
                         f"{served}; see --speculative and --speculative-config)")


@attrs.frozen(kw_only=True)
class SpecPolicy:
    """Batch-size policy and back-off settings (see the module doc)."""

    max_batch: int = 0
    backoff_threshold: float = 0.25
    backoff_steps: int = 16
    ema_weight: float = 0.3
    time_policy: bool = True
    throughput: ThroughputSettings = ThroughputSettings()


@attrs.define
class _RowBooks:
    choice: SpecChoice | None
    rate: float = 1.0
    cooldown: int = 0
    num_proposed: int = 0
    num_accepted: int = 0
    num_verify_steps: int = 0


@attrs.frozen(kw_only=True)
class SpeculationStatistics:
    num_rows: int
    num_proposed: int
    num_accepted: int
    num_verify_steps: int
    num_backoffs: int
    mean_accepted_length: float  # accepted tokens per verify step that proposed
    buckets: tuple[BucketStatistics, ...] = ()  # the time policy's books per batch bucket


class SpeculationPolicy:
    """Per-row books: what each row proposes next, what it got accepted."""

    def __init__(self, policy: SpecPolicy = SpecPolicy()) -> None:
        self.policy = policy
        self._rows: dict[str, _RowBooks] = {}
        self._num_proposed = self._num_accepted = self._num_steps = self._num_backoffs = 0
        self.time = ThroughputPolicy(policy.throughput) if policy.time_policy else None

    def open_row(self, request_id: str, choice: SpecChoice | None) -> None:
        self._rows[request_id] = _RowBooks(choice=choice)

    def close_row(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def row_ids(self) -> list[str]:
        """The rows with books, oldest first."""
        return list(self._rows)

    def choice(self, request_id: str) -> SpecChoice | None:
        books = self._rows.get(request_id)
        return books.choice if books is not None else None

    def decide(self, request_ids: list[str], batch_size: int) -> dict[str, int]:
        """Tokens each row proposes in the next step of `batch_size` decoding rows (0: it
        decodes plainly); the caller cuts them to what the row may still emit."""
        out = dict.fromkeys(request_ids, 0)
        if not self.allows(batch_size):
            return out
        for rid in request_ids:
            out[rid] = self._row_tokens(rid)
        return out

    def allows(self, batch_size: int) -> bool:
        """Whether rows may propose at all in a step of `batch_size` decoding rows (the
        hard cap and the time policy; rows' own back-off aside)."""
        if self.policy.max_batch and batch_size > self.policy.max_batch:
            return False
        return self.time is None or batch_size < 1 or self.time.speculate(batch_size)

    def _row_tokens(self, request_id: str) -> int:
        books = self._rows.get(request_id)
        if books is None or books.choice is None:
            return 0
        if books.cooldown > 0:
            books.cooldown -= 1
            if books.cooldown == 0:
                books.rate = self.policy.backoff_threshold
            return 0
        return books.choice.num_tokens

    def absorb(self, verified: list[tuple[str, int, int]], batch_size: int, speculative: bool,
               tokens: int, seconds: float | None) -> None:
        """One step's outcome: (request id, proposed, accepted) per row that proposed, and
        its measurement (`seconds` None: not a steady decode step, not measured)."""
        for rid, proposed, accepted in verified:
            self.verified(rid, proposed, accepted)
        if seconds is not None:
            self.observe_step(batch_size, speculative, tokens, seconds)

    def observe_step(self, batch_size: int, speculative: bool, tokens: int,
                     seconds: float) -> None:
        """A measured decode step (see engine.speculative.throughput)."""
        if self.time is not None and batch_size >= 1:
            self.time.observe(batch_size, speculative, tokens, seconds)

    def verified(self, request_id: str, proposed: int, accepted: int) -> None:
        """What the target kept of a row's proposal."""
        books = self._rows.get(request_id)
        if books is None or proposed == 0:
            return
        books.num_proposed += proposed
        books.num_accepted += accepted
        books.num_verify_steps += 1
        self._num_proposed += proposed
        self._num_accepted += accepted
        self._num_steps += 1
        w = self.policy.ema_weight
        books.rate = (1 - w) * books.rate + w * (accepted / proposed)
        if books.rate < self.policy.backoff_threshold:
            books.cooldown = self.policy.backoff_steps
            self._num_backoffs += 1

    def statistics(self) -> SpeculationStatistics:
        return SpeculationStatistics(
            num_rows=len(self._rows), num_proposed=self._num_proposed,
            num_accepted=self._num_accepted, num_verify_steps=self._num_steps,
            num_backoffs=self._num_backoffs,
            mean_accepted_length=self._num_accepted / self._num_steps if self._num_steps else 0.0,
            buckets=self.time.statistics() if self.time is not None else ())
