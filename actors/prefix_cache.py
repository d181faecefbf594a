"""Prefix cache: the RAM and SSD tiers around the sans-io PrefixIndex, and the spill task.

Owns: the PrefixIndex (books of both tiers), the SsdTier (files), the spill queue.
The snapshots' arrays live in the Runner (runner thread), keyed by the RAM keys here;
only keys, token ids and numbers cross into this module, plus plane bytes on their way
to disk (produced on the runner thread, never tensors).

Used by the scheduler actor, in its task (no mailbox of its own):
  * `lookup` on Submit: a RAM hit pins the donor; an SSD hit reads the file on a worker
    thread (`get_async`) and has the runner rebuild it under a temporary key.
  * `finished` on each Finished event, `decorate(plan)` before each step (snapshot,
    spill and drop orders), `absorb(plan, result)` after it (index new snapshots, write
    spills: sync flush awaits the write here; async flush hands it to `run_spiller`).

Edges: scheduler -> spill task, a trio channel of SPILL_QUEUE items (bulk bytes, so not
a msgpack mailbox); `send_nowait`, and a full queue drops the spill (counted), so decoding
never waits for the disk. The spill task updates the index directly (same trio thread,
sync calls, no await in between), so there is no edge back and the graph stays a DAG.

Acknowledgement: a snapshot is acknowledged when SsdTier.put returned (temp file, fsync,
rename, directory fsync); then "snapshot acknowledged <key>" is logged on tqserve.prefix.
Files dropped later (superseded, evicted) log "snapshot removed <key>" before the unlink
(evictions inside SsdTier through its `on_evict` hook), so an acknowledged file that is gone
after a crash was always announced.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import attrs
import trio

from engine.prefix import PrefixEntry, PrefixIndex, Tier
from engine.scheduler import Finished, SpillPayload, StepPlan, StepResult
from storage import SnapshotError, SsdTier, snapshot_key

log = logging.getLogger("tqserve.prefix")
SPILL_QUEUE = 8  # snapshots waiting for the disk in async mode; beyond it spills drop


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


@attrs.frozen(kw_only=True)
class Reuse:
    """What a request reuses: `cached` tokens of runner snapshot `key`, from `tier`."""

    key: str
    cached: int
    tier: str


class PrefixCache:
    """The tiers' policy, run by the scheduler actor (see the module doc)."""

    def __init__(self, *, namespace: str, fingerprint: str, ram_budget: int,
                 tier: SsdTier | None, flush: str,
                 runner_call: Callable[..., Any]) -> None:
        self.namespace = namespace
        self.fingerprint = fingerprint
        self.index = PrefixIndex(ram_budget)
        self.tier = tier
        self.flush = flush
        self._runner_call = runner_call  # awaitable: run a function on the runner thread
        self._ids = itertools.count()
        self._tick = 0
        self._pinned: dict[str, str] = {}          # request id -> pinned RAM key
        self._temporary: dict[str, str] = {}       # request id -> SSD restore key
        self._finished: dict[str, tuple[str, tuple[int, ...]]] = {}  # rid -> (key, tokens)
        self._tokens: dict[str, tuple[int, ...]] = {}  # RAM key -> covered tokens
        self._spill: list[str] = []
        self._drop: list[str] = []
        self._counts = {"spills": 0, "spills_dropped": 0, "quarantined": 0}
        self._queue: trio.MemorySendChannel[SpillPayload] | None = None

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    async def recover(self) -> None:
        """Index the SSD tier's verified files of this namespace (after SsdTier.recover)."""
        if self.tier is None:
            return
        try:
            report = await self.tier.recover_async()
        except OSError as exc:  # the user's directory: say which and why, no traceback
            raise ValueError(f"--cache-dir {str(self.tier.directory)!r} cannot be used: "
                             f"{exc.strerror or exc}") from exc
        self._counts["quarantined"] += report.num_quarantined
        for entry in self.tier.entries():
            header = entry.header
            if header.namespace != self.namespace or entry.key in self.index:
                continue
            superseded, _ = self.index.publish(PrefixEntry(
                key=entry.key, namespace=header.namespace, tokens=header.token_ids,
                minimum_reusable_offset=header.minimum_reusable_offset, trimmable=True,
                num_bytes=entry.num_bytes), Tier.SSD, self._next_tick())
            await self._remove_files(superseded)

    async def lookup(self, request_id: str, prompt: tuple[int, ...]) -> Reuse | None:
        """The reuse for a new request, ready in the runner; None on a miss."""
        match = self.index.lookup(self.namespace, prompt, self._next_tick())
        if match is None:
            return None
        if match.tier is Tier.RAM:
            self.index.pin(match.key)
            self._pinned[request_id] = match.key
            return Reuse(key=match.key, cached=match.length, tier="ram")
        restored = await self._restore(match.key)
        if restored is None:
            return None
        self._temporary[request_id] = restored
        return Reuse(key=restored, cached=match.length, tier="ssd")

    async def _restore(self, key: str) -> str | None:
        if self.tier is None:
            return None
        try:
            found = await self.tier.get_async(key)
        except SnapshotError as exc:
            log.warning("snapshot %s failed verification on read: %s", key, exc.reason)
            self._counts["quarantined"] += 1
            found = None
        except OSError as exc:
            log.warning("snapshot %s unreadable: %s", key, exc)
            found = None
        if found is None:
            self.index.forget(key)
            return None
        header, planes = found
        temporary = f"s{next(self._ids)}"
        kinds = str(header.extra.get("layer_kinds", ""))
        arrays = {name: (p.data, p.shape, p.dtype) for name, p in planes.items()}
        try:
            await self._runner_call(temporary, kinds, header.offset,
                                    header.minimum_reusable_offset, arrays)
        except ValueError as exc:
            log.warning("snapshot %s does not fit this engine: %s", key, exc)
            self.index.forget(key)
            return None
        return temporary

    def release_reuse(self, request_id: str) -> None:
        """The request's row is built (or it will never be): unpin, drop temporaries."""
        key = self._pinned.pop(request_id, None)
        if key is not None:
            self._spill += self.index.unpin(key)
        temporary = self._temporary.pop(request_id, None)
        if temporary is not None:
            self._drop.append(temporary)

    def finished(self, event: Finished) -> None:
        """Note a finished row's tokens so that its release snapshots it."""
        if event.was_queued or event.row_id is None:
            self.release_reuse(event.request_id)
            return
        if event.finish_reason in ("stop", "length") and event.completion_tokens > 0:
            self._finished[event.request_id] = (f"r{next(self._ids)}", event.tokens)

    def has_orders(self) -> bool:
        """Whether spill or drop orders wait for a step (the scheduler then runs one)."""
        return bool(self._spill or self._drop)

    def decorate(self, plan: StepPlan) -> StepPlan:
        """Add this step's snapshot, spill and drop orders to the core's plan."""
        orders = []
        for rid in plan.release:
            found = self._finished.pop(rid, None)
            if found is not None:
                orders.append((rid, found[0]))
                self._tokens[found[0]] = found[1]
        plan = attrs.evolve(plan, snapshot=tuple(orders), spill=tuple(self._spill),
                            drop=tuple(self._drop))
        self._spill, self._drop = [], []
        return plan

    async def absorb(self, plan: StepPlan, result: StepResult) -> None:
        """Index the step's snapshots, write its spills, release built rows' reuses."""
        for new in plan.new_rows:
            self.release_reuse(new.request_id)
        for made in result.snapshots:
            tokens = self._tokens.pop(made.key, ())[:made.offset]
            if len(tokens) != made.offset or self.index.has_tokens(self.namespace, tokens):
                self._drop.append(made.key)
                continue
            superseded, spill = self.index.publish(PrefixEntry(
                key=made.key, namespace=self.namespace, tokens=tokens,
                minimum_reusable_offset=made.minimum_reusable_offset, trimmable=True,
                num_bytes=made.num_bytes), Tier.RAM, self._next_tick())
            self._tokens[made.key] = tokens
            for key in superseded:
                self._tokens.pop(key, None)
            self._drop += superseded
            self._spill += spill
        for _, key in plan.snapshot:
            if key not in self.index:
                self._tokens.pop(key, None)
        for payload in result.spills:
            await self._send_spill(payload)

    async def _send_spill(self, payload: SpillPayload) -> None:
        if self.tier is None:
            self._forget_ram(payload.key)
            return
        if self.flush == "sync" or self._queue is None:
            await self.write(payload)
            return
        try:
            self._queue.send_nowait(payload)
        except trio.WouldBlock:
            self._counts["spills_dropped"] += 1
            self._forget_ram(payload.key)

    def _forget_ram(self, key: str) -> None:
        self.index.spilled(key, None)
        self._tokens.pop(key, None)

    async def write(self, payload: SpillPayload) -> None:
        """Write one spilled snapshot to the SSD tier and re-index it there."""
        if self.tier is None:
            raise RuntimeError("write without an SSD tier")
        entry = self.index.entry(payload.key) if payload.key in self.index else None
        tokens = self._tokens.pop(payload.key, None)
        if entry is None or tokens is None:
            return
        key = snapshot_key(self.namespace, tokens)
        fields = {**payload.header, "model_fingerprint": self.fingerprint,
                  "namespace": self.namespace, "token_ids": tokens,
                  "created_ns": time.time_ns()}
        try:
            stored = await self.tier.put_async(key, fields, payload.planes)
        except (OSError, ValueError) as exc:
            log.warning("snapshot %s abandoned: %s", key, exc)
            self.index.spilled(payload.key, None)
            return
        log.info("snapshot acknowledged %s", key)
        self._counts["spills"] += 1
        self.index.spilled(payload.key, None)
        if key in self.index:
            return
        superseded, _ = self.index.publish(attrs.evolve(
            entry, key=key, num_bytes=stored.num_bytes), Tier.SSD, self._next_tick())
        await self._remove_files(superseded)
        live = {e.key for e in self.tier.entries()}
        for gone in [k for k in self.index.keys(Tier.SSD) if k not in live]:
            self.index.forget(gone)
            log.info("snapshot removed %s", gone)

    async def _remove_files(self, keys: list[str]) -> None:
        for key in keys:
            if self.tier is not None:
                # Logged before the unlink: a kill in between leaves a file that is merely
                # not required, never an acknowledged file gone without a word.
                log.info("snapshot removed %s", key)
                await trio.to_thread.run_sync(functools.partial(self.tier.remove, key))

    def statistics(self) -> PrefixCacheStatistics:
        index = self.index.statistics()
        tier = self.tier.statistics() if self.tier is not None else None
        return PrefixCacheStatistics(
            ram_bytes=index.ram_bytes, ram_entries=index.ram_entries,
            ssd_bytes=index.ssd_bytes, ssd_entries=index.ssd_entries,
            hits_ram=index.hits_ram, hits_ssd=index.hits_ssd, misses=index.misses,
            spills=self._counts["spills"], spills_dropped=self._counts["spills_dropped"],
            quarantined=self._counts["quarantined"],
            ssd_write_errors=tier.num_write_errors if tier is not None else 0)


async def run_spiller(prefix: PrefixCache,
                      task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """The async-flush spill task: writes queued snapshots one at a time."""
    send, receive = trio.open_memory_channel[SpillPayload](SPILL_QUEUE)
    prefix._queue = send
    task_status.started()
    async with receive:
        async for payload in receive:
            await prefix.write(payload)
