"""Least work: a request goes where the prompt tokens it waits for plus its own are fewest.

Sans-io, over a RouteTable (api.router.core: backends, health, what each holds): no I/O,
and the caller passes the time (`now`, seconds of one monotonic clock). The Ray Serve
router (api.rayserve.routing) calls `choose()` with a request's prefix keys and token
count, `routed()` once Ray has sent it, `prefilled()` when its first token was seen and
`completed()` when it ended; every decision comes back as data (`Route`, `Estimate`).

The estimate for each candidate backend, in prompt tokens:
* `num_pending`: what it still has to compute for the requests sent to it whose prompts
  are not computed yet, each booked at what it cost there when it was sent. A backend
  computes them oldest first; the oldest has been computing since it was sent or since
  the previous one's first token, at the backend's measured rate (prompt tokens per
  second, from the time each request took to its first token), so that much of it is
  counted done;
* `num_cached`: this prompt's tokens it holds: the deepest prefix block its KV events
  name, or the prompt of a request it computed (the table's routed-before owner);
* `num_wait_cached`: the tokens a prompt it is computing now shares with this one. The
  engine does not share a prefix still being computed with a second request, so the
  request would wait for it (until its first token) and then reuse it;
* `num_uncached`: this prompt's tokens it would compute (less the better of the two).
The request goes to the candidate whose pending + COMPUTE_WEIGHT x uncached is least: the
wait, its own compute, and the delay that compute adds to the requests behind it. So the
backend holding the prefix gets it while it is not further behind than twice what its
cache saves, the least loaded one otherwise. Ties go to the one holding the most, then the
fewest requests in flight, then in turn. A backend `spill_threshold` requests busier than
the least loaded (Ray's queue length) is not a candidate: cached requests are cheap in
tokens, not free.

Reasons: `affinity` (the chosen one holds the most of the prompt), `spill` (another holds
more but costs more), `least_loaded` (none holds any of it), `wait` (the best is a prompt
being computed: the request is not sent yet, and the caller asks again a little later).

Books: a request is booked at `choose()` (so requests routed at once see each other's
work), moved at `routed()` where Ray sent it (a candidate of a lower rank, maybe), has no
work left at `prefilled()`, and leaves at `completed()` (its prompt is then computed even
if no first token was seen). A request chosen but never sent (its client went away while it
waited) never completes: at most MAX_UNSENT such bookings are kept, the oldest dropped.
"""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict
from typing import Hashable, Sequence

import attrs

from tqserve.api.router.core import Key, NoHealthyBackend, Route, RouteTable

MAX_UNSENT = 64  # requests chosen and not yet sent; legitimately a few, for milliseconds
# a token the request computes counts this many times: once for its own wait, once for the
# requests that then queue behind it there (a prefix it reuses, or waits for, adds none)
COMPUTE_WEIGHT = 2
# a rate sample: a request's uncached tokens over the time to its first token, when it
# computed at least this many tokens for at least this long (else timing noise decides)
MIN_SAMPLE_TOKENS = 64
MIN_SAMPLE_S = 0.005
RATE_WEIGHT = 0.25  # of each new sample in a backend's rate (an exponential average)
# a request waits for a prefix being computed while that is its cheapest option, at most
# this long: a safety net (a wait ends at the prefix's first token, or when its request
# ends and leaves the books); and at most one request per candidate waits at once: Ray
# routes with 2 tasks per replica, and a waiting request holds one
MAX_WAIT_S = 60.0


class Stage(enum.Enum):
    CHOSEN = "chosen"          # booked where it was chosen; Ray has not sent it yet
    SENT = "sent"              # on its backend, its prompt not computed yet
    PREFILLED = "prefilled"    # its prompt is computed (its first token was seen)


@attrs.frozen(kw_only=True)
class Estimate:
    """One candidate's cost for one request, in prompt tokens."""

    backend: str
    num_pending: int       # tokens it still has to compute for requests sent before
    num_cached: int        # this prompt's tokens it holds (whole blocks)
    num_wait_cached: int   # this prompt's tokens a prompt it is computing now shares
    num_uncached: int      # this prompt's tokens it would compute
    num_in_flight: int     # its requests (Ray's queue length)

    @property
    def cost(self) -> int:
        return self.num_pending + COMPUTE_WEIGHT * self.num_uncached

    @property
    def waits(self) -> bool:
        """Whether its cost counts on a prompt still being computed."""
        return self.num_wait_cached > self.num_cached


@attrs.define
class _Booked:
    backend: str
    keys: tuple[Key, ...]
    num_uncached: int
    stage: Stage
    signals: bool  # its first token will be reported (`prefilled`), so one may wait for it
    sent_at: float | None = None


@attrs.define
class _Pace:
    """How fast a backend computes prompts, and since when it computes its oldest one."""

    rate: float | None = None  # prompt tokens per second (None: not measured yet)
    since: float = 0.0         # its last first token


class LeastWork:
    """The least-work policy and its books of work sent (module doc)."""

    def __init__(self, table: RouteTable) -> None:
        self.table = table
        self._books: OrderedDict[Hashable, _Booked] = OrderedDict()
        self._pending: dict[str, int] = {}  # backend -> its bookings' uncached tokens
        self._pace: dict[str, _Pace] = {}
        self._turn = itertools.count()
        self._waiting: dict[Hashable, float] = {}  # request -> when it began to wait
        self.num_waits = 0

    def rate(self, backend: str) -> float | None:
        """`backend`'s measured prompt tokens per second (None: not measured yet)."""
        pace = self._pace.get(backend)
        return pace.rate if pace is not None else None

    def num_pending(self, backend: str, now: float) -> int:
        """Prompt tokens booked to `backend` and not computed yet, less what its oldest
        one has computed since it started, at the measured rate."""
        pending = self._pending.get(backend, 0)
        pace = self._pace.get(backend)
        sent = [b for b in self._books.values() if b.backend == backend
                and b.stage is Stage.SENT and b.sent_at is not None]
        if not sent or pace is None or pace.rate is None:
            return pending
        oldest = min(sent, key=lambda b: b.sent_at or 0.0)
        started = max(oldest.sent_at or 0.0, pace.since)
        return pending - min(oldest.num_uncached, int(pace.rate * max(0.0, now - started)))

    def estimate(self, backend: str, keys: Sequence[Key], num_tokens: int,
                 now: float, *, may_wait: bool = True) -> Estimate:
        block = self.table.config.block_tokens
        cached = min(num_tokens, self.table.depth_held(backend, keys) * block)
        waited = (min(num_tokens, self._depth_computing(backend, keys) * block)
                  if may_wait else 0)
        return Estimate(backend=backend, num_pending=self.num_pending(backend, now),
                        num_cached=cached, num_wait_cached=waited,
                        num_uncached=num_tokens - max(cached, waited),
                        num_in_flight=self.table.num_in_flight(backend))

    def estimates(self, keys: Sequence[Key], num_tokens: int | None = None,
                  exclude: Sequence[str] = (), *, now: float,
                  may_wait: bool = True) -> list[Estimate]:
        """Every candidate's estimate (routable, not excluded, not `spill_threshold`
        requests busier than the least loaded). `num_tokens` None (the prompt was not
        tokenized): a block's worth per key. `may_wait` False: prefixes being computed
        count for nothing. Raises NoHealthyBackend if none is left."""
        names = [n for n in self.table.routable() if n not in exclude]
        if not names:
            raise NoHealthyBackend("no healthy backend")
        tokens = _tokens(keys, num_tokens, self.table.config.block_tokens)
        least = min(self.table.num_in_flight(n) for n in names)
        limit = least + self.table.config.spill_threshold
        return [self.estimate(n, keys, tokens, now, may_wait=may_wait) for n in names
                if self.table.num_in_flight(n) < limit]

    def choose(self, request_id: Hashable | None, keys: Sequence[Key],
               num_tokens: int | None = None, exclude: Sequence[str] = (), *,
               now: float) -> Route:
        """The backend for a request, booked under `request_id` (None: not booked); or
        reason `wait`: not sent yet, ask again (nothing is booked). A request chosen again
        (Ray's retry) is first taken off the books: it waits for no prompt of its own."""
        if request_id is not None:
            self._drop(request_id)
        options = self.estimates(keys, num_tokens, exclude, now=now,
                                 may_wait=self._may_wait(request_id, len(self.table.names),
                                                         now))
        turn = next(self._turn)
        order = {e.backend: (i - turn) % len(options) for i, e in enumerate(options)}
        best = min(options, key=lambda e: (e.cost, -max(e.num_cached, e.num_wait_cached),
                                           e.num_in_flight, order[e.backend]))
        if best.waits and request_id is not None:
            self.num_waits += request_id not in self._waiting
            self._waiting.setdefault(request_id, now)
            return Route(backend=best.backend, reason="wait")
        self._waiting.pop(request_id, None)
        most = max(e.num_cached for e in options)
        reason = ("least_loaded" if most == 0 else
                  "affinity" if best.num_cached == most else "spill")
        if request_id is not None:
            self._book(request_id, best.backend, keys, num_tokens, Stage.CHOSEN,
                       signals=False, now=None)
        return Route(backend=best.backend, reason=reason,
                     matched_blocks=self.table.depth_held(best.backend, keys))

    def routed(self, request_id: Hashable, backend: str, keys: Sequence[Key],
               num_tokens: int | None = None, *, signals: bool = False,
               now: float) -> None:
        """Ray sent the request to `backend` at `now` (maybe not the one chosen): book it
        there. `signals`: its first token will be reported (`prefilled`)."""
        if backend in self.table.names:
            self._book(request_id, backend, keys, num_tokens, Stage.SENT, signals=signals,
                       now=now)

    def prefilled(self, request_id: Hashable, now: float) -> None:
        """The request's first token was seen at `now`: its prompt is computed and cached
        where it ran, and its time measures that backend's rate. A request not sent from
        these books (another router's) is ignored."""
        booked = self._books.get(request_id)
        if booked is None or booked.stage is not Stage.SENT or booked.sent_at is None:
            return
        pace = self._pace.setdefault(booked.backend, _Pace())
        took = now - max(booked.sent_at, pace.since)
        if booked.num_uncached >= MIN_SAMPLE_TOKENS and took >= MIN_SAMPLE_S:
            sample = booked.num_uncached / took
            pace.rate = sample if pace.rate is None else (
                pace.rate + RATE_WEIGHT * (sample - pace.rate))
        pace.since = max(pace.since, now)
        self._pending[booked.backend] -= booked.num_uncached
        booked.stage, booked.num_uncached = Stage.PREFILLED, 0
        self.table.own(booked.backend, booked.keys)

    def completed(self, request_id: Hashable, backend: str) -> None:
        """The request on `backend` ended: a prompt it computed is cached there (the
        table's owner of its keys until KV events say otherwise)."""
        booked = self._books.get(request_id)
        if booked is None or booked.backend != backend:
            return  # not booked, or a refused try whose retry is booked elsewhere
        self._drop(request_id)
        if booked.stage is Stage.SENT:
            self.table.own(backend, booked.keys)

    def forget(self, backend: str) -> None:
        """`backend` is gone: drop what was booked to it."""
        for rid in [r for r, b in self._books.items() if b.backend == backend]:
            self._drop(rid)
        self._pending.pop(backend, None)
        self._pace.pop(backend, None)

    def _may_wait(self, request_id: Hashable | None, num_backends: int, now: float) -> bool:
        """Whether the request may wait for a prefix being computed: not past MAX_WAIT_S
        since it began, and no more waiting than there are backends (module doc). A wait
        is forgotten at twice MAX_WAIT_S: by then its request was sent, or is gone."""
        for rid in [r for r, since in self._waiting.items() if now - since > 2 * MAX_WAIT_S]:
            del self._waiting[rid]
        if request_id is None:
            return False
        since = self._waiting.get(request_id)
        if since is not None:
            return now - since <= MAX_WAIT_S
        return sum(now - s <= MAX_WAIT_S for s in self._waiting.values()) < num_backends

    def _depth_computing(self, backend: str, keys: Sequence[Key]) -> int:
        """The deepest of `keys` that a prompt `backend` is computing now shares, of the
        requests whose first token will be reported (0: none)."""
        depth = {key: i + 1 for i, key in enumerate(keys)}
        return max((depth.get(k, 0) for b in self._books.values()
                    if b.backend == backend and b.stage is Stage.SENT and b.signals
                    for k in b.keys), default=0)

    def _book(self, request_id: Hashable, backend: str, keys: Sequence[Key],
              num_tokens: int | None, stage: Stage, *, signals: bool,
              now: float | None) -> None:
        """Book what the request costs `backend`: what it holds of the prompt is not
        computed again; a prefix being computed there is (the engine does not share it)."""
        self._drop(request_id)
        tokens = _tokens(keys, num_tokens, self.table.config.block_tokens)
        work = tokens - min(tokens, self.table.depth_held(backend, keys)
                            * self.table.config.block_tokens)
        self._books[request_id] = _Booked(backend=backend, keys=tuple(keys),
                                          num_uncached=work, stage=stage, signals=signals,
                                          sent_at=now)
        self._pending[backend] = self._pending.get(backend, 0) + work
        unsent = [r for r, b in self._books.items() if b.stage is Stage.CHOSEN]
        for rid in unsent[:max(0, len(unsent) - MAX_UNSENT)]:
            self._drop(rid)

    def _drop(self, request_id: Hashable) -> None:
        booked = self._books.pop(request_id, None)
        if booked is not None:
            self._pending[booked.backend] -= booked.num_uncached


def _tokens(keys: Sequence[Key], num_tokens: int | None, block_tokens: int) -> int:
    return len(keys) * block_tokens if num_tokens is None else max(0, num_tokens)
