"""Prefix cache: the sans-io PrefixIndex over both tiers, the RAM tier, lookups and loads.

Owns: the PrefixIndex (books of both tiers; its KV event log, stamped with time.time), the
RAM tier's books (pinned donors, the tokens each snapshot covers, which RAM entries have a
file, the spill and drop orders for the next step), the requests waiting for loads, and
its SSD side, a PrefixSsd (actors.prefix_ssd: recovery, restores, writes, pending entries).
The snapshots' arrays live in the Runner (runner thread), keyed by the RAM keys here;
only keys, token ids and numbers cross into this module.

Used by the scheduler actor, in its task (no mailbox of its own; its SSD side,
actors.prefix_ssd, is the scheduler's end of the spill actor's two edges):
  * `lookup` when a request is about to take a row (not at arrival, so a request queued
    behind its donor reuses it): a RAM hit pins the donor; an SSD hit is LOADING: the
    request waits, holding no row, while the others keep decoding, and `start_loads`
    orders the spill actor to rebuild it in the runner (file read and checks on its disk
    thread, then the runner thread between steps); its answer, applied by
    `apply_replies` (drained between steps) or `wait_reply` (when idle), promotes the
    snapshot to the RAM tier and hands the reuse over through `take_ready`.
  * `finished` on each Finished event (a queued request's pinned donor is let go);
    `has_prompt` when a lookup ends (whether a joining row's prompt needs a snapshot);
    `advise(advice)` before each step hands the core its part of the StepAdvice
    (engine.step): snapshots on, write-through, the pending spill and drop orders. The
    core decides the plan's snapshot orders itself (engine.orders: a finished row's KV
    at its release, covering the plan's `release_tokens`; a joining row's prompt KV);
    nothing here edits a plan. `absorb(plan, result, prompt_of)` after the step books the
    tokens each ordered snapshot covers (a prompt read from the core through
    `prompt_of`), indexes the new snapshots and sends their writes to the spill actor.
  * `reconcile(held)` after a failed step: the index and the runner agree again.

Who changes the index: this module and its SSD side, both in the scheduler's task, the
only task that touches it (the spill actor reports by message).

Namespaces (engine.namespaces): a request looks up, and its row publishes, only in the
namespace of its speculation method: state-free (no speculation, lookup) or paired with
its proposer's state (draft, mtp; the runner reports which with each snapshot). A paired
entry's reuse bound includes its state's (`paired_minimum` in the file's header).

Reachability: a published snapshot stays matchable until it is gone for good, whatever the
RAM budget. An entry over the budget is SPILLING until its spill or drop order runs (the
runner still holds it: a hit takes it back into RAM and cancels the spill). With
write-through, or when its file exists already, RAM pressure only drops its RAM copy;
with write-back it is spilled (write modes, flushes and PENDING entries, matchable while
their write is queued or running: actors.prefix_ssd).

Files: every file operation (reads, writes, removals, quarantine; the other ranks' shards
under --distributed) is an order to the spill actor (actors.spill), the SSD tier's only
owner; recovery runs before the actors start and its files are indexed by `recovered`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import attrs

from tqserve.actors.mailbox import Inbox, Outbox
from tqserve.actors.messages import SpillLoaded, SpillWritten
from tqserve.actors.prefix_ssd import PrefixSsd, SnapshotWrite
from tqserve.actors.spill import SpillStatistics, reuse_bound
from tqserve.engine.kvevents import KvEventLog
from tqserve.engine.namespaces import CacheNamespaces
from tqserve.engine.prefix import PrefixEntry, PrefixIndex, Tier
from tqserve.engine.step import Finished, StepAdvice, StepPlan, StepResult
from tqserve.storage.tier import TierEntry

if TYPE_CHECKING:
    from tqserve.actors.shard_group import ShardOrders


@attrs.frozen(kw_only=True)
class PrefixIndexStatistics:
    """What the scheduler's side of the prefix cache posts (actors.board)."""

    ram_bytes: int
    ram_entries: int
    ssd_bytes: int
    ssd_entries: int
    hits_ram: int
    hits_ssd: int
    misses: int
    loads_pending: int
    spills_dropped: int    # async writes dropped: WRITE_QUEUE were in flight
    spilling_entries: int  # RAM entries over the budget whose spill or drop order waits
    orders_pending: int    # spill and drop orders waiting for the next step


@attrs.frozen(kw_only=True)
class PrefixCacheStatistics(PrefixIndexStatistics):
    """The prefix cache's statistics, both tiers: the index's record with the spill actor's
    fields (actors.spill.SpillStatistics; without a cache dir zeros and `ssd_state`
    "off"), put together by the facade."""

    spills: int = 0
    writes_pending: int = 0
    quarantined: int = 0
    ssd_write_errors: int = 0
    ssd_errors: int = 0
    ssd_state: str = "off"
    tier_entries: int = 0
    bytes_read: int = 0

    @classmethod
    def of(cls, index: PrefixIndexStatistics, spill: SpillStatistics | None
           ) -> PrefixCacheStatistics:
        return cls(**attrs.asdict(index), **(attrs.asdict(spill) if spill is not None else {}))


@attrs.frozen(kw_only=True)
class Reuse:
    """What a request reuses: `cached` tokens of runner snapshot `key`, from `tier`."""

    key: str
    cached: int
    tier: str


LOADING = "loading"  # `lookup`'s answer for an SSD hit: the request waits for `load`


class PrefixCache:
    """The tiers' policy, run by the scheduler actor (see the module doc)."""

    def __init__(self, *, namespace: str, fingerprint: str, ram_budget: int, flush: str,
                 write: str = "through", namespaces: CacheNamespaces | None = None,
                 spill: Outbox | None = None, replies: Inbox | None = None,
                 orders: ShardOrders | None = None) -> None:
        """`spill`/`replies`: the spill actor's mailbox and reply edge (None without a cache
        dir); `orders`: --distributed, the other ranks' write orders."""
        self.namespace = namespace  # the state-free one
        self.namespaces = namespaces or CacheNamespaces(base=namespace)
        self.fingerprint = fingerprint
        self.index = PrefixIndex(ram_budget, KvEventLog(clock=time.time))
        self.write_mode = write
        self._tick = 0
        self.ssd = PrefixSsd(self.index, fingerprint=fingerprint, flush=flush, outbox=spill,
                             replies=replies, orders=orders, tick=self._next_tick,
                             acknowledged=self._acknowledged)
        self._pinned: dict[str, str] = {}          # request id -> pinned RAM key
        self._tokens: dict[str, tuple[int, ...]] = {}  # RAM key -> covered tokens
        self._on_disk: set[str] = set()            # RAM keys with an SSD copy
        self._loading: dict[str, list[tuple[str, int]]] = {}  # SSD key -> (rid, length)
        self._started: dict[str, PrefixEntry] = {}  # SSD key -> its entry, while it loads
        self._ready: list[tuple[str, Reuse | None]] = []
        self._spill: list[str] = []
        self._drop: list[str] = []

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    @property
    def through(self) -> bool:
        return self.ssd.on and self.write_mode == "through"

    def recovered(self, entries: Iterable[TierEntry]) -> list[str]:
        """Index the SSD tier's recovered files (before the actors start); returns the
        keys their supersession leaves for the spill actor to remove."""
        return self.ssd.recovered([
            (e.key, e.header.namespace, tuple(e.header.token_ids), reuse_bound(e.header),
             e.num_bytes) for e in entries])

    def lookup(self, request_id: str, prompt: tuple[int, ...],
               speculative: object = None) -> Reuse | str | None:
        """A request (speculation choice `speculative`) is about to take a row: its RAM
        reuse, LOADING (an SSD hit: call `load(key)` unless `loading` says it runs
        already), or None on a miss."""
        match = self.index.lookup(self.namespaces.of_request(speculative), prompt,
                                  self._next_tick())
        if match is None:
            return None
        if match.tier is Tier.SPILLING:  # still in the runner: take it back, cancel the spill
            self.index.unspill(match.key)
            if match.key in self._spill:
                self._spill.remove(match.key)
        if match.tier in (Tier.RAM, Tier.SPILLING):
            self.index.pin(match.key)
            self._pinned[request_id] = match.key
            return Reuse(key=match.key, cached=match.length, tier="ram")
        self._loading.setdefault(match.key, []).append((request_id, match.length))
        return LOADING

    async def start_loads(self) -> None:
        """Order the spill actor to load every SSD hit with waiting requests and no load
        yet (its answer comes through `apply_replies` or `wait_reply`)."""
        for key in [k for k, waiters in self._loading.items()
                    if waiters and k not in self._started]:
            entry = self.index.entry(key) if key in self.index else None
            if entry is None:  # forgotten since the lookup: its requests look up again
                self._ready += [(rid, None) for rid, _ in self._loading.pop(key)]
                continue
            self._started[key] = entry
            await self.ssd.load(key, self.namespaces.state_of(entry.namespace) or "")

    async def apply_replies(self, taken: Iterable[SpillWritten | SpillLoaded] = ()) -> None:
        """Book the answers `taken` and every other answer of the spill actor waiting on
        the reply edge (without waiting for more)."""
        for reply in [*taken, *self.ssd.take_replies()]:
            await self.ssd.apply(reply)
        self._loads_ended()

    async def wait_reply(self) -> None:
        """Wait for the spill actor's next answer and book it (the scheduler is idle)."""
        assert self.ssd.replies is not None
        await self.apply_replies([await self.ssd.replies.receive()])

    def _loads_ended(self) -> None:
        """Promote the loaded snapshots to the RAM tier and hand their reuses over (None
        for each waiter if it failed, or is gone since the lookup: look it up again)."""
        for loaded in self.ssd.take_loaded():
            entry = self._started.pop(loaded.key, None)
            waiters = self._loading.pop(loaded.key, [])
            if loaded.num_bytes is None or entry is None:
                self._ready += [(rid, None) for rid, _ in waiters]
                if loaded.num_bytes is not None:  # nobody indexes it: the runner drops it
                    self._drop.append(loaded.temporary)
                continue
            ram_key = loaded.temporary
            for rid, length in waiters:  # pinned first: the budget cannot evict it at once
                self.index.pin(ram_key)
                self._pinned[rid] = ram_key
                self._ready.append((rid, Reuse(key=ram_key, cached=length, tier="ssd")))
            self._on_disk.add(ram_key)
            self._publish_ram(attrs.evolve(entry, key=ram_key, num_bytes=loaded.num_bytes))

    @property
    def loads_pending(self) -> bool:
        """Whether a load was ordered and not yet answered."""
        return bool(self._started)

    def take_ready(self) -> list[tuple[str, Reuse | None]]:
        """Finished loads: (request id, its reuse, or None: look it up again)."""
        ready, self._ready = self._ready, []
        return ready

    def release_reuse(self, request_id: str) -> None:
        """The request's row is built (or it will never be): unpin its donor."""
        key = self._pinned.pop(request_id, None)
        if key is not None:
            self._evict(self.index.unpin(key))

    def finished(self, event: Finished) -> None:
        """A request finished: one that never built its row lets its donor go."""
        if event.was_queued or event.row_id is None:
            self.release_reuse(event.request_id)

    def has_orders(self) -> bool:
        """Whether spill or drop orders wait for a step (the scheduler then runs one)."""
        return bool(self._spill or self._drop)

    def advise(self, advice: StepAdvice) -> StepAdvice:
        """`advice` with this cache's part for the next plan: snapshot orders on, write-
        through, and the pending spill and drop orders (handed over: they go in it)."""
        spill, drop = tuple(self._spill), tuple(self._drop)
        self._spill, self._drop = [], []
        return attrs.evolve(advice, prefix_cache=True, write_through=self.through,
                            spill=spill, drop=drop)

    def has_prompt(self, prompt: tuple[int, ...], speculative: object = None) -> bool:
        """Whether RAM holds a snapshot of exactly `prompt[:-1]` (the prompt snapshot a
        joining row would make): the core then orders none for it."""
        tokens = prompt[:-1]
        return not tokens or self.index.has_tokens(self.namespaces.of_request(speculative),
                                                   tokens, Tier.RAM)

    async def absorb(self, plan: StepPlan, result: StepResult,
                     prompt_of: Callable[[str], tuple[int, ...]]) -> None:
        """Index the step's snapshots (the core's orders: the tokens a released row's KV
        covers, or a joining row's prompt, read through `prompt_of`), write them (or queue
        them), release built rows' reuses, and hand spills (write-back) to the disk."""
        covered = dict(zip(plan.release, plan.release_tokens))
        for rid, key in plan.snapshot:
            self._tokens[key] = covered[rid]
        for rid, key in plan.prompt_snapshot:
            self._tokens[key] = prompt_of(rid)[:-1]
        for new in plan.new_rows:
            self.release_reuse(new.request_id)
        writes = {payload.key: payload for payload in result.writes}
        for made in result.snapshots:
            tokens = self._tokens.pop(made.key, ())[:made.offset]
            namespace = self.namespaces.of_state(made.state)
            if (len(tokens) != made.offset
                    or self.index.has_tokens(namespace, tokens, Tier.RAM)):
                self._drop.append(made.key)
                continue
            entry = PrefixEntry(key=made.key, namespace=namespace, tokens=tokens,
                                minimum_reusable_offset=made.minimum_reusable_offset,
                                trimmable=True, num_bytes=made.num_bytes)
            payload = writes.get(made.key)
            on_disk = (self.index.has_tokens(namespace, tokens, Tier.SSD)
                       or self.index.has_tokens(namespace, tokens, Tier.PENDING))
            job = SnapshotWrite(ram_key=made.key, namespace=namespace, tokens=tokens, payload=payload,
                         minimum_reusable_offset=made.minimum_reusable_offset) \
                if payload is not None and not on_disk else None
            if job is not None and self.ssd.flush == "sync":
                on_disk = await self.ssd.write_now(job)
                job = None
            self._tokens[made.key] = tokens
            if on_disk:
                self._on_disk.add(made.key)
            if job is not None:  # queued first: over the budget at once, it is PENDING
                self.ssd.write(job)
            self._publish_ram(entry)
        for _, key in plan.snapshot + plan.prompt_snapshot:
            if key not in self.index:
                self._tokens.pop(key, None)
        for payload in result.spills:
            await self.ssd.send_spill(payload, self._tokens.pop(payload.key, None))
        if self.ssd.orders is not None:  # before the next step: other ranks stage until then
            await self.ssd.orders.send()

    def _publish_ram(self, entry: PrefixEntry) -> None:
        with self.index.events.batch():  # one KV event batch with the evictions it causes
            superseded, over = self.index.publish(entry, Tier.RAM, self._next_tick())
            for key in superseded:
                self._tokens.pop(key, None)
                self._on_disk.discard(key)
            self._drop += superseded
            self._evict(over)

    def _evict(self, keys: Iterable[str]) -> None:
        """RAM entries over the budget (marked SPILLING): with write-through, or when their
        file exists already, drop the RAM copy (an entry whose write is pending stays
        matchable as PENDING); with write-back, spill them."""
        for key in keys:
            if self.ssd.is_pending(key):
                self.index.pending(key)
                self._tokens.pop(key, None)
                self._on_disk.discard(key)
                self._drop.append(key)
            elif self.through or key in self._on_disk or not self.ssd.on:
                self.index.forget(key)
                self._tokens.pop(key, None)
                self._on_disk.discard(key)
                self._drop.append(key)
            else:
                self._spill.append(key)

    def _acknowledged(self, key: str) -> None:
        """RAM key `key`'s write is acknowledged (the SSD side): while RAM holds it, its
        eviction only drops the RAM copy."""
        if self.index.tier(key) in (Tier.RAM, Tier.SPILLING):
            self._on_disk.add(key)

    def reconcile(self, held: set[str]) -> set[str]:
        """After a failed step: `held` are the snapshots the runner still holds. Entries
        whose snapshot is gone are forgotten; a SPILLING entry whose spill never ran is
        back in RAM. Returns the keys the runner should keep (every other is an orphan)."""
        for key in self.index.keys(Tier.SPILLING):
            if key in held:
                self.index.unspill(key)
            else:
                self.index.forget(key)
        for key in self.index.keys(Tier.RAM):
            if key not in held:
                self.index.forget(key)
        self._spill = []
        self._drop = [k for k in self._drop if k in held]
        keep = set(self.index.keys(Tier.RAM)) | set(self._drop) | set(self.ssd.restoring)
        self._tokens = {k: v for k, v in self._tokens.items() if k in keep}
        self._on_disk &= keep
        return keep

    def statistics(self) -> PrefixIndexStatistics:
        index = self.index.statistics()
        return PrefixIndexStatistics(
            ram_bytes=index.ram_bytes, ram_entries=index.ram_entries,
            ssd_bytes=index.ssd_bytes, ssd_entries=index.ssd_entries,
            hits_ram=index.hits_ram, hits_ssd=index.hits_ssd, misses=index.misses,
            loads_pending=len(self._loading), spills_dropped=self.ssd.num_dropped,
            spilling_entries=len(self.index.keys(Tier.SPILLING)),
            orders_pending=len(self._spill) + len(self._drop))
