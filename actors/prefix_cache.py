"""Prefix cache: the RAM and SSD tiers around the sans-io PrefixIndex, and the writer task.

Owns: the PrefixIndex (books of both tiers; its KV event log, stamped with time.time),
the SsdTier (files), the write queue.
The snapshots' arrays live in the Runner (runner thread), keyed by the RAM keys here;
only keys, token ids and numbers cross into this module, plus plane bytes on their way
to disk (produced on the runner thread, never tensors).

Used by the scheduler actor, in its task (no mailbox of its own):
  * `lookup` when a request is about to take a row (not at arrival, so a request queued
    behind its donor reuses it): a RAM hit pins the donor; an SSD hit starts `load` in the
    scheduler's nursery (file read and checks on a worker thread, rebuild on the runner
    thread) and the request waits, holding no row, while the others keep decoding; the
    loaded snapshot is promoted to the RAM tier and handed over by `take_ready`.
  * `finished` on each Finished event (a queued request's pinned donor is let go);
    `has_prompt` when a lookup ends (whether a joining row's prompt needs a snapshot);
    `advise(advice)` before each step hands the core its part of the StepAdvice
    (engine.step): snapshots on, write-through, the pending spill and drop orders. The
    core decides the plan's snapshot orders itself (engine.orders: a finished row's KV
    at its release, covering the plan's `release_tokens`; a joining row's prompt KV);
    nothing here edits a plan. `absorb(plan, result, prompt_of)` after the step books the
    tokens each ordered snapshot covers (a prompt read from the core through
    `prompt_of`), indexes the new snapshots and writes them.
  * `reconcile(held)` after a failed step: the index and the runner agree again.

Namespaces (engine.namespaces): a request looks up, and its row publishes, only in the
namespace of its speculation method: state-free (no speculation, lookup) or paired with
its proposer's state (draft, mtp; the runner reports which with each snapshot). A paired
entry's reuse bound includes its state's (`paired_minimum` in the file's header).

Write modes (`--ssd-write`): "through" (default with a cache dir): every published
snapshot is also written to the SSD tier; RAM pressure then only drops RAM copies.
"back": a snapshot reaches the disk only when RAM pressure evicts it (a spill).
Flush (`--ssd-flush`): "async" (default): writes go through a bounded queue to the writer
task; `send_nowait`, and a full queue drops the write (counted in `spills_dropped`), so a
step never waits for the disk. "sync": the step's absorb awaits the write (on a worker
thread) and publishes only after the file is durable.

Reachability: a published snapshot stays matchable until it is gone for good, whatever the
RAM budget. An entry over the budget is SPILLING until its spill or drop order runs (the
runner still holds it: a hit takes it back into RAM and cancels the spill); once its RAM
copy is gone while its async write is queued or running, it is PENDING: a hit restores it
from the write's bytes (as an SSD hit, without reading the disk) until the write is
acknowledged (then the SSD entry serves it) or abandoned. With --distributed the other
ranks keep no bytes to restore from, so there an entry leaves the index with its RAM copy
and is matchable again once its write is acknowledged.

Files: every file operation (recovery, reads, writes, removals, quarantine; the other
ranks' shards under --distributed) goes through actors.spill, the SSD tier's only owner;
this module owns the index and indexes what spill reports. The writer task (spill's)
hands each queued write back to `write` here, which publishes it once durable (same trio
thread, no await in between), so there is no edge back and the graph stays a DAG.
Shutdown: the scheduler stops, then `close_writes` closes the queue; the writer drains it.

Acknowledgement: a snapshot is acknowledged when its file is durable (actors.spill) on
every rank; then "snapshot acknowledged <key>" is logged on tqserve.prefix. Files dropped
later (superseded, evicted) log "snapshot removed <key>" before the unlink.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import attrs
import trio

from tqserve.actors.spill import Spill, SnapshotWrite, reuse_bound
from tqserve.engine.kvevents import KvEventLog
from tqserve.engine.namespaces import CacheNamespaces
from tqserve.engine.prefix import PrefixEntry, PrefixIndex, Tier
from tqserve.engine.step import Finished, SpillPayload, StepAdvice, StepPlan, StepResult
from tqserve.storage import SsdTier

if TYPE_CHECKING:
    from tqserve.actors.shard_group import ShardGroup

log = logging.getLogger("tqserve.prefix")


@attrs.frozen(kw_only=True)
class PrefixCacheStatistics:
    ram_bytes: int
    ram_entries: int
    ssd_bytes: int
    ssd_entries: int
    hits_ram: int
    hits_ssd: int
    misses: int
    spills: int
    spills_dropped: int
    quarantined: int
    ssd_write_errors: int
    ssd_errors: int  # errors of the cache dir's file system (storage.health)
    ssd_state: str   # "ok", "read_only", "cold" (storage.health), or "off" (no cache dir)
    writes_pending: int
    loads_pending: int


@attrs.frozen(kw_only=True)
class Reuse:
    """What a request reuses: `cached` tokens of runner snapshot `key`, from `tier`."""

    key: str
    cached: int
    tier: str


LOADING = "loading"  # `lookup`'s answer for an SSD hit: the request waits for `load`


class PrefixCache:
    """The tiers' policy, run by the scheduler actor (see the module doc)."""

    def __init__(self, *, namespace: str, fingerprint: str, ram_budget: int,
                 tier: SsdTier | None, flush: str,
                 runner_call: Callable[..., Any], write: str = "through",
                 namespaces: CacheNamespaces | None = None,
                 group: ShardGroup | None = None) -> None:
        self.namespace = namespace  # the state-free one
        self.namespaces = namespaces or CacheNamespaces(base=namespace)
        self.fingerprint = fingerprint
        self.index = PrefixIndex(ram_budget, KvEventLog(clock=time.time))
        # the SSD tier's only owner (actors.spill): every file operation goes through it
        self.spill = (Spill(tier, fingerprint=fingerprint, group=group)
                      if tier is not None else None)
        self.flush = flush
        self.write_mode = write
        self._runner_call = runner_call  # awaitable: run a function on the runner thread
        self._ids = itertools.count()  # temporary keys s<n> (engine.orders numbers r, p)
        self._tick = 0
        self._pinned: dict[str, str] = {}          # request id -> pinned RAM key
        self._tokens: dict[str, tuple[int, ...]] = {}  # RAM key -> covered tokens
        self._on_disk: set[str] = set()            # RAM keys with an SSD copy
        self._pending: dict[str, SnapshotWrite] = {}      # RAM key -> its async write, until it ends
        self._loading: dict[str, list[tuple[str, int]]] = {}  # SSD key -> (rid, length)
        self._started: set[str] = set()            # SSD keys whose load task runs
        self._restoring: set[str] = set()          # runner keys of loads in flight
        self._ready: list[tuple[str, Reuse | None]] = []
        self._spill: list[str] = []
        self._drop: list[str] = []
        self._counts = {"spills": 0, "spills_dropped": 0}
        self.changed = trio.Event()  # set when a load finishes (the scheduler wakes up)

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    @property
    def tier(self) -> SsdTier | None:
        return self.spill.tier if self.spill is not None else None

    @property
    def group(self) -> ShardGroup | None:
        """--distributed: the other ranks' shards of the SSD tier (rank 0's side)."""
        return self.spill.group if self.spill is not None else None

    @property
    def through(self) -> bool:
        return self.spill is not None and self.write_mode == "through"

    async def recover(self) -> None:
        """Index the SSD tier's verified files of this namespace (after SsdTier.recover)."""
        if self.spill is None:
            return
        for entry in await self.spill.recover(self.namespace, self.namespaces.all()):
            header = entry.header
            if entry.key in self.index:
                continue
            superseded, _ = self.index.publish(PrefixEntry(
                key=entry.key, namespace=header.namespace, tokens=header.token_ids,
                minimum_reusable_offset=reuse_bound(header), trimmable=True,
                num_bytes=entry.num_bytes), Tier.SSD, self._next_tick())
            await self._remove_files(superseded)

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

    def loads_to_start(self) -> list[str]:
        """SSD keys with waiting requests and no load task yet (each returned once)."""
        keys = [k for k, waiters in self._loading.items() if waiters and k not in self._started]
        self._started.update(keys)
        return keys

    async def load(self, key: str) -> None:
        """Read SSD entry `key`, rebuild it on the runner and promote it to the RAM tier;
        the waiting requests' reuses then come out of `take_ready`."""
        entry = self.index.entry(key) if key in self.index else None
        job = self._pending.get(key) if self.index.tier(key) is Tier.PENDING else None
        if job is not None:
            restored = await self._restore_pending(job)
        elif entry is not None and self.index.tier(key) is Tier.SSD:
            restored = await self._restore(key, entry)
        else:  # gone since the lookup (its write ended): the request looks up again
            restored = None
        waiters = self._loading.pop(key, [])
        self._started.discard(key)
        if restored is None or entry is None:
            self._ready += [(rid, None) for rid, _ in waiters]
        else:
            ram_key, num_bytes = restored
            for rid, length in waiters:  # pinned first: the budget cannot evict it at once
                self.index.pin(ram_key)
                self._pinned[rid] = ram_key
                self._ready.append((rid, Reuse(key=ram_key, cached=length, tier="ssd")))
            self._on_disk.add(ram_key)
            self._publish_ram(attrs.evolve(entry, key=ram_key, num_bytes=num_bytes))
        self.changed.set()

    def take_ready(self) -> list[tuple[str, Reuse | None]]:
        """Finished loads: (request id, its reuse, or None: look it up again)."""
        ready, self._ready = self._ready, []
        self.changed = trio.Event()
        return ready

    async def _restore(self, key: str, entry: PrefixEntry) -> tuple[str, int] | None:
        """The SSD entry `key` rebuilt in the runner (actors.spill); None (the request runs
        cold) if its file is gone or fails any check (such a file is quarantined)."""
        if self.spill is None:
            return None
        temporary = f"s{next(self._ids)}"
        self._restoring.add(temporary)
        try:
            num_bytes, gone = await self.spill.restore(
                key, temporary, entry.minimum_reusable_offset, self._runner_call,
                self.namespaces.state_of)
        finally:
            self._restoring.discard(temporary)
        if num_bytes is None:
            self.index.forget(key)
            if gone:
                await self._reconcile()
            return None
        return temporary, num_bytes

    async def _restore_pending(self, job: SnapshotWrite) -> tuple[str, int] | None:
        """A PENDING entry rebuilt in the runner from its write's bytes (our own: a failure
        is our bug, logged; the request runs cold)."""
        temporary = f"s{next(self._ids)}"
        header = job.payload.header
        planes = {name: (data, tuple(shape), dtype)
                  for name, data, shape, dtype in job.payload.planes}
        self._restoring.add(temporary)
        try:
            num_bytes = await self._runner_call(
                temporary, str(header["extra"]["layer_kinds"]), header["offset"],
                header["minimum_reusable_offset"], planes,
                self.namespaces.state_of(job.namespace) or "")
        except Exception:
            log.exception("snapshot %s could not be restored from its pending write",
                          job.ram_key)
            return None
        finally:
            self._restoring.discard(temporary)
        return temporary, int(num_bytes)

    async def _reconcile(self) -> None:
        """A file was missing or unreadable: drop every index entry whose file vanished
        (every one, if the tier went cold: storage.health)."""
        await self._forget_gone(reconcile=True)

    async def _forget_gone(self, *, reconcile: bool = False) -> None:
        """Forget the SSD entries the tier no longer holds (evicted, vanished, cold)."""
        if self.spill is None:
            return
        live = await self.spill.live_keys(reconcile=reconcile)
        gone = [k for k in self.index.keys(Tier.SSD) if k not in live]
        for key in gone:
            self.index.forget(key)
        if self.group is not None and gone:
            await self.group.remove(gone)

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
            if job is not None and self.flush == "sync":
                on_disk = await self._write_now(job)
                job = None
            self._tokens[made.key] = tokens
            if on_disk:
                self._on_disk.add(made.key)
            if job is not None:  # queued first: over the budget at once, it is PENDING
                self._enqueue(job)
            self._publish_ram(entry)
        for _, key in plan.snapshot + plan.prompt_snapshot:
            if key not in self.index:
                self._tokens.pop(key, None)
        for payload in result.spills:
            await self._send_spill(payload)
        if self.group is not None:  # before the next step: the other ranks stage until then
            await self.group.send_orders()

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
            if key in self._pending:
                self.index.pending(key)
                self._tokens.pop(key, None)
                self._on_disk.discard(key)
                self._drop.append(key)
            elif self.through or key in self._on_disk or self.tier is None:
                self.index.forget(key)
                self._tokens.pop(key, None)
                self._on_disk.discard(key)
                self._drop.append(key)
            else:
                self._spill.append(key)

    def _enqueue(self, job: SnapshotWrite) -> None:
        """Queue `job` for the writer task (a full queue drops it, counted); its entry is
        pending until the write ends (single process: see the module doc)."""
        try:
            if self.spill is None:
                raise trio.WouldBlock
            self.spill.enqueue_nowait(job)
        except trio.WouldBlock:
            self._counts["spills_dropped"] += 1
            return
        if self.group is None:
            self._pending[job.ram_key] = job
        self._order(job)

    def _order(self, job: SnapshotWrite) -> None:
        """--distributed: every other rank is to write its shard of `job` too."""
        if self.spill is not None:
            self.spill.order(job)

    async def _write_now(self, job: SnapshotWrite) -> bool:
        """A sync flush: order the other ranks' writes, then `write`."""
        self._order(job)
        if self.spill is not None:
            await self.spill.send_orders()
        return await self.write(job)

    async def _send_spill(self, payload: SpillPayload) -> None:
        """A write-back spill: the RAM copy is gone; write it or drop it."""
        tokens = self._tokens.pop(payload.key, None)
        if self.spill is None or tokens is None or payload.key not in self.index:
            self.index.forget(payload.key)
            return
        entry = self.index.entry(payload.key)
        job = SnapshotWrite(ram_key=payload.key, namespace=entry.namespace, tokens=tokens,
                     payload=payload, minimum_reusable_offset=entry.minimum_reusable_offset)
        if self.flush == "sync":
            self.index.forget(payload.key)  # published on the SSD once durable
            await self._write_now(job)
            return
        self._enqueue(job)
        if payload.key in self._pending:
            self.index.pending(payload.key)  # matchable from its bytes until written
        else:
            self.index.forget(payload.key)

    async def write(self, job: SnapshotWrite) -> bool:
        """Write one snapshot to the SSD tier and index it there; False if it failed."""
        if self.spill is None:
            raise RuntimeError("write without an SSD tier")
        put = await self.spill.put(job, keep=lambda key: key in self.index)
        key, stored, problem = put.key, put.stored, put.problem
        if stored is None or problem is not None:
            self._end_pending(job)
            # A disk error was logged once by the tier (storage.health), not per snapshot.
            log.log(logging.DEBUG if put.disk_error else logging.WARNING,
                    "snapshot %s abandoned: %s", key, problem)
            await self._tier_shrank()  # a write may find the tier gone cold
            return False
        log.info("snapshot acknowledged %s", key)
        self._counts["spills"] += 1
        if self.index.tier(job.ram_key) in (Tier.RAM, Tier.SPILLING):
            self._on_disk.add(job.ram_key)
        superseded: list[str] = []
        if key not in self.index:
            superseded, _ = self.index.publish(PrefixEntry(
                key=key, namespace=job.namespace, tokens=job.tokens,
                minimum_reusable_offset=job.minimum_reusable_offset, trimmable=True,
                num_bytes=stored.num_bytes), Tier.SSD, self._next_tick())
        self._end_pending(job)  # with no await since the publish: always one matches
        await self._remove_files(superseded)
        await self._tier_shrank()  # the tier may have evicted files, or gone cold
        return True

    async def _tier_shrank(self) -> None:
        """After a write: the tier holds fewer entries than the index knows (it evicted
        some, or went cold): forget those."""
        if self.spill is not None and self.spill.num_entries < self.index.statistics().ssd_entries:
            await self._forget_gone()

    def _end_pending(self, job: SnapshotWrite) -> None:
        """`job`'s write ended: its PENDING entry (if its RAM copy went) leaves the index."""
        self._pending.pop(job.ram_key, None)
        if self.index.tier(job.ram_key) is Tier.PENDING:
            self.index.forget(job.ram_key)

    async def _remove_files(self, keys: list[str]) -> None:
        if self.spill is not None:
            await self.spill.remove(keys)

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
        keep = set(self.index.keys(Tier.RAM)) | set(self._drop) | self._restoring
        self._tokens = {k: v for k, v in self._tokens.items() if k in keep}
        self._on_disk &= keep
        return keep

    def statistics(self) -> PrefixCacheStatistics:
        index, spill = self.index.statistics(), self.spill
        errors = spill.error_counts() if spill is not None else {}
        return PrefixCacheStatistics(
            ram_bytes=index.ram_bytes, ram_entries=index.ram_entries,
            ssd_bytes=index.ssd_bytes, ssd_entries=index.ssd_entries,
            hits_ram=index.hits_ram, hits_ssd=index.hits_ssd, misses=index.misses,
            spills=self._counts["spills"], spills_dropped=self._counts["spills_dropped"],
            quarantined=errors.get("quarantined", 0), ssd_errors=errors.get("ssd_errors", 0),
            ssd_write_errors=errors.get("ssd_write_errors", 0),
            ssd_state=spill.tier.statistics().state if spill is not None else "off",
            writes_pending=spill.num_queued if spill is not None else 0,
            loads_pending=len(self._loading))

    async def close_writes(self) -> None:
        """No more writes: the writer task writes what is queued, then returns."""
        if self.spill is not None:
            await self.spill.close_writes()
