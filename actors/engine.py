"""open_engine(): starts the actor graph inside the caller's nursery.

    async with open_engine(Config(model=...)) as engine:
        async for event in engine.generate(GenerateRequest(prompt="def f(x):")):
            ...

The actor graph, drawn once (here; docs/design.md and DESIGN.md point to it). Every edge is a
bounded mailbox of msgpack bytes, named after the actor that reads it:

    generate() --Submit, Cancel, StopAdmitting--> admission --Submit, Cancel--> scheduler
        ^                                          |  ^                             |  ^
        |                            Queued, Error |  +-- Dequeued (reply) ---------+  |
        |                                          v                                |  |
        +-- per-stream channels ----------------- hub --- Cancel (reply) -----------|--+
                                                   ^                                |
                                                   +-- StepTokens, Done, Error -----+

    scheduler <--> runner thread (all MLX work, one thread; the spill actor's loads
                   rebuild their snapshots there too, between steps)
    scheduler --SpecStep--> speculation --SpecDecision (reply)--> scheduler
    scheduler --SpillWrite, SpillLoad, SpillRemove--> spill
        spill --SpillWritten, SpillLoaded (reply)--> scheduler
    scheduler --Lease, Release, KvUsage--> cache_owner

    Every actor posts its statistics to the board (actors.board), the one snapshot the
    facade reads; the hub hands each stream's channel to its consumer (the facade's one
    other door: tests/actors/test_doors.py).

Edges (sender -> mailbox: messages), checked by tests/actors/test_graph.py against the
mailboxes `open_engine` creates and the messages that cross them:

    api -> admission: Submit Cancel StopAdmitting
    admission -> scheduler: Submit Cancel
    admission -> hub: Queued Error
    scheduler -> hub: StepTokens Done Error
    scheduler -> cache_owner: Lease Release KvUsage
    scheduler -> admission_replies: Dequeued (reply edge)
    hub -> scheduler: Cancel (reply edge)
    scheduler -> speculation: SpecStep
    speculation -> speculation_replies: SpecDecision (reply edge)
    scheduler -> spill: SpillWrite SpillLoad SpillRemove
    spill -> spill_replies: SpillWritten SpillLoaded (reply edge)

The speculation actor and its two mailboxes exist only with speculation (--speculative or
a draft model), the spill actor and its two only with a cache dir (--cache-dir). Without
the reply edges the graph is a DAG. The reply edges never block a sender:
admission_replies is sized for one Dequeued per queued request (send_nowait), the hub's
Cancels (a stream overflowed, or its text met a stop string) are sent by a task of their
own (`run_hub_cancels`) straight into the scheduler's mailbox, never by delivery; the ids
waiting are at most the open streams;
speculation_replies holds one decision per SpecStep that can be answered before the
scheduler reads them all again (actors.speculation; send_nowait); spill_replies one answer
per order in flight (actors.spill; send_nowait).

With --warmup (auto: on a GPU only) the runner first runs every decode batch size once
(engine.warmup: a private scheduler core, then a reset), before any actor starts.

The prefix cache (actors.prefix_cache: the index and the RAM tier) runs in the scheduler's
task; with --cache-dir its SSD tier is recovered (verified, quarantined, indexed) before the
first request, and every file operation after that is an order to the spill actor
(actors.spill), the tier's only owner. The spill actor outlives the others: leaving
`open_engine` stops the actors first; once the scheduler has closed the spill mailbox, the
spill actor writes every queued snapshot (at most WRITE_QUEUE) and ends, and open_engine
waits for it, so a restart finds every snapshot that was queued.

Cancelling the caller's scope (or leaving the `async for` early) sends a Cancel;
the row is freed at the start of the next engine step. A stream that falls behind is cut
off by the hub, and a stream whose text meets a stop string is ended by it; either way
`run_hub_cancels` sends the Cancel into the scheduler's mailbox at once (the reply edge), and
the row is freed within a step or two.
"""

from __future__ import annotations

import functools
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Mapping

import trio

from tqserve.actors.admission import AdmissionControl, run_admission
from tqserve.actors.board import Board
from tqserve.actors.cache_owner import KvLedger, run_cache_owner
from tqserve.actors.facade import Engine
from tqserve.actors.hub import Hub, run_hub, run_hub_cancels
from tqserve.actors.mailbox import Inbox, Outbox, Recorder, open_mailbox
from tqserve.actors.prefix_cache import PrefixCache
from tqserve.actors.runner_thread import RunnerThread
from tqserve.actors.scheduler import GroupFailed, run_scheduler
from tqserve.actors.shard_group import ShardGroup, ShardOrders
from tqserve.actors.spill import (SPILL_MAILBOX, Evictions, Spill, header_validator, run_spill)
from tqserve.actors.spill import reply_mailbox_size as spill_replies_size
from tqserve.actors.speculation import (SPECULATION_MAILBOX, SpeculationLink, reply_mailbox_size,
                                        run_speculation)
from tqserve.engine import fastpath
from tqserve.engine.config import Config
from tqserve.engine.detokenize import TextStream
from tqserve.engine.distributed import GroupFailure, LeaderRunner, init_group, shard_model
from tqserve.engine.kv.factory import cache_factory_for
from tqserve.engine.codec.turboquant import DEFAULT_ROTATION
from tqserve.engine.model import LoadedModel, load_model
from tqserve.engine.plan_channel import PlanChannel
from tqserve.engine.speculative.factory import build_speculator, spec_policy
from tqserve.engine.speculative.lookup import LookupBook
from tqserve.engine.speculative.policy import SpecChoice, SpeculationPolicy
from tqserve.engine.speculative.state import PairedLayout, StateLayout
from tqserve.engine.namespaces import CacheNamespaces
from tqserve.engine.runner import Runner
from tqserve.engine.scheduler import SchedulerCore
from tqserve.engine.snapshot_layout import PlaneLayout
from tqserve.engine.kv_budget import KvBudget
from tqserve.engine.memory import kv_budget, kv_bytes_per_position
from tqserve.engine.structured import (GrammarMasks)
from tqserve.engine.warmup import wanted, warm_up
from tqserve.storage import SsdTier
from tqserve.storage.shard import ShardId

HEALTH_CHECKS = 4  # pings per --distributed-timeout: a follower waits at most 2 timeouts
SpillEnds = tuple[Spill, Inbox, Outbox]  # the spill actor's Spill, inbox, reply send end
log = logging.getLogger("tqserve.engine")

# Mailbox sizes. "If in doubt, use 0"; these are not 0 for the reasons given.
ADMISSION_MAILBOX = 64   # absorbs a burst of submits; a full mailbox rejects at once
SCHEDULER_MAILBOX = 64   # admitted requests and cancels waiting for the next step boundary
HUB_MAILBOX = 256        # a few steps' StepTokens (one per step) plus one finish per row
CACHE_OWNER_MAILBOX = 64  # leases/releases of one step; the owner only does bookkeeping
CLOSE_SETTLE = 5.0  # seconds at close for finished rows to release (their snapshots taken, written)


@asynccontextmanager
async def open_engine(config: Config, *, loaded: LoadedModel | None = None,
                      recorder: Recorder | None = None) -> AsyncIterator[Engine]:
    """Load the model (unless given) and run the actor graph until the block exits. When
    no stream is open at exit, the rows of finished requests are released first (at most
    CLOSE_SETTLE seconds), so their prefix-cache snapshots are taken and written: a
    restart reuses the last turn of a conversation too."""
    thread = RunnerThread()
    runner: Runner | None = None
    try:
        loaded, runner, core, budget, speculator = await _build(config, loaded, thread)
        tokenizer = loaded.tokenizer
        group_failed = GroupFailed()
        if isinstance(runner, LeaderRunner):
            await thread.call(runner.join)  # every rank has its shard
        if await thread.call(wanted, config.warmup):
            # (a LeaderRunner broadcasts the warm-up's steps and reset like any others)
            await thread.call(functools.partial(
                warm_up, runner, max_batch=config.max_batch,
                prefill_chunk=config.prefill_chunk, max_step_tokens=config.max_step_tokens,
                vocab_size=loaded.vocab_size, progress=logging.getLogger("tqserve.warmup").info))
        control = AdmissionControl(max_queued_requests=config.max_queued_requests,
                                   max_queued_tokens=config.max_queued_tokens)
        board = Board()
        ledger = KvLedger(budget_bytes=budget.budget_bytes)
        hub = Hub(config.stream_buffer, lambda stop: TextStream(tokenizer, stop), board)
        sizes = {"admission": ADMISSION_MAILBOX, "scheduler": SCHEDULER_MAILBOX,
                 "hub": HUB_MAILBOX, "cache_owner": CACHE_OWNER_MAILBOX,
                 # Reply edge: one Dequeued per queued request, so this size can never fill.
                 "admission_replies": config.max_queued_requests + SCHEDULER_MAILBOX}
        admission_out, admission_in = open_mailbox(sizes["admission"], "admission", recorder)
        scheduler_out, scheduler_in = open_mailbox(sizes["scheduler"], "scheduler", recorder)
        hub_out, hub_in = open_mailbox(sizes["hub"], "hub", recorder)
        owner_out, owner_in = open_mailbox(sizes["cache_owner"], "cache_owner", recorder)
        replies_out, replies_in = open_mailbox(sizes["admission_replies"],
                                               "admission_replies", recorder)
        speculation, link = _speculation(config, speculator, sizes, recorder)
        spec_default = speculator.default if speculator is not None else None
        prefix, spill = None, None
        if config.prefix_cache:
            refused = await thread.call(runner.snapshots.unsnapshottable_caches)
            if not refused:
                layout = await thread.call(runner.plane_layout)
                states = await thread.call(runner.snapshots.state_layouts)
                prefix, spill = _prefix_cache(config, loaded, runner, thread, layout, states,
                                              spec_default, sizes, recorder)
            else:
                log.warning("prefix cache off: this model's %s layers cannot be reused by "
                            "prefix (a sliding window overwrites positions; recurrent state "
                            "cannot be cut back to a shorter prefix)", ", ".join(refused))
        if prefix is not None:
            board.kv_events = prefix.index.events
        if spill is not None and prefix is not None:  # before the actors: a bad cache dir
            entries = await spill[0].recover(prefix.namespace, prefix.namespaces.all())
            await spill[0].remove(prefix.recovered(entries))  # is a plain ValueError

        async def restore(*args: object) -> int:
            return await thread.call(runner.restore, *args)

        # The spill actor outlives the others: once the scheduler closed its mailbox, it
        # writes what is queued (at most WRITE_QUEUE) and ends; open_engine waits for it.
        async with trio.open_nursery() as disk:
            if spill is not None:
                await disk.start(run_spill, *spill, board, restore)
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(run_hub, hub, hub_in)
                    await nursery.start(run_cache_owner, ledger, owner_in, board)
                    if speculation is not None:
                        await nursery.start(speculation, board)
                    await nursery.start(
                        functools.partial(run_scheduler, board=board, prefix=prefix,
                                          group_failed=group_failed, speculation=link),
                        core, runner, thread, scheduler_in, replies_out, owner_out,
                        hub_out.clone())
                    nursery.start_soon(run_hub_cancels, hub, scheduler_out.clone())
                    if isinstance(runner, LeaderRunner):
                        nursery.start_soon(run_health_check, runner, thread,
                                           config.distributed_timeout / HEALTH_CHECKS,
                                           group_failed)
                    await nursery.start(run_admission, control, admission_in, replies_in,
                                        scheduler_out, hub_out, board)
                    try:
                        engine = Engine(
                            config, loaded, admission_out, hub, board, kv_budget=budget,
                            speculative_methods=frozenset(
                                speculator.proposers if speculator is not None else ()),
                            runner=runner, mailboxes=sizes)
                        engine.group_failed = group_failed
                        yield engine
                        if not engine.num_live:  # rows of finished requests: release them
                            with trio.move_on_after(CLOSE_SETTLE):
                                await engine.wait_idle()
                    finally:
                        nursery.cancel_scope.cancel()
            finally:
                if prefix is not None and prefix.ssd.outbox is not None:
                    prefix.ssd.outbox.close()  # the spill actor drains its queue, then ends
    finally:
        try:
            if runner is not None:
                await thread.call(runner.close)  # shielded: MLX idle before the thread ends
        finally:
            await thread.aclose()


def _speculation(config: Config, speculator: Any, sizes: dict[str, int], recorder: Any
                 ) -> tuple[Callable[..., Any] | None, SpeculationLink | None]:
    """The speculation actor's task (to start with the board) and the scheduler's end of
    its two edges; (None, None) without speculation. With lookup served, the actor keeps
    the lookup rows' indexes (a LookupBook)."""
    if speculator is None:
        return None, None
    sizes["speculation"] = SPECULATION_MAILBOX
    sizes["speculation_replies"] = reply_mailbox_size(SPECULATION_MAILBOX)
    spec_out, spec_in = open_mailbox(sizes["speculation"], "speculation", recorder)
    decisions_out, decisions_in = open_mailbox(sizes["speculation_replies"],
                                               "speculation_replies", recorder)
    lookup = speculator.proposers.get("lookup")
    book = LookupBook(lookup.settings) if lookup is not None else None
    task = functools.partial(run_speculation, SpeculationPolicy(spec_policy(config)),
                             speculator.default, spec_in, decisions_out, book=book)
    return task, SpeculationLink(outbox=spec_out, replies=decisions_in,
                                 lookup=book is not None, default=speculator.default)


async def _build(config: Config, loaded: LoadedModel | None, thread: RunnerThread
                 ) -> tuple[LoadedModel, Runner, SchedulerCore, KvBudget, Any]:
    """The parts the runner thread builds before the graph starts: the model (loaded unless
    given; sharded under --distributed), the runner, the scheduler core with the KV budget,
    and the speculator (None without speculation)."""
    if loaded is None:
        loaded = await thread.call(load_model, config.model, config.dtype,
                                   config.quantized_weights)
    channel = None
    # a row's KV size per position, probed with one forward: under --distributed before
    # the model is sharded (a forward of rank 0 alone would hang the group), with plain
    # caches and all heads (an over-estimate by the group's size)
    per_position = (await thread.call(kv_bytes_per_position, loaded.model, None)
                    if config.distributed else None)
    if config.distributed:  # rank 0 of `serve --distributed` (engine.distributed)
        channel = PlanChannel(init_group())
        await thread.call(shard_model, loaded.model, channel.group)
    make_cache = await thread.call(cache_factory_for, loaded.model, config.turboquant,
                                   config.quantized_kv_start, config.kv_quant,
                                   config.kv_group_size, config.turboquant_decode)
    draft = None
    if config.draft_model is not None:
        draft = await thread.call(load_model, config.draft_model, config.dtype,
                                  config.quantized_weights)
    speculator = await thread.call(build_speculator, config, loaded, draft)
    budget = await thread.call(functools.partial(
        kv_budget, loaded, make_cache, draft, per_position=per_position,
        budget_bytes=config.kv_budget_bytes, mtp=config.speculative == "mtp",
        margin=config.num_speculative_tokens + 1 if speculator is not None else 0,
        preempt=config.kv_admission == "preempt"))
    core = SchedulerCore(
        max_batch=config.max_batch, prefill_chunk=config.prefill_chunk,
        max_step_tokens=config.max_step_tokens, eos_token_ids=loaded.eos_token_ids,
        speculative_methods=speculator.proposers if speculator is not None else (),
        kv_budget=budget, speculative_default=getattr(speculator, "default", None))
    masks = GrammarMasks(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
    fast = fastpath.wanted(config.fast_decode, config.distributed)
    if fast:  # in place: one copy of the weights (engine.fastpath)
        await thread.call(fastpath.fuse_projections, loaded.model)
    runner = (Runner(loaded.model, make_cache, masks, speculator, fast_decode=fast)
              if channel is None
              else LeaderRunner(channel, config.distributed_timeout, loaded.model,
                                make_cache, masks))
    return loaded, runner, core, budget, speculator


async def run_health_check(runner: LeaderRunner, thread: RunnerThread, interval: float,
                           group_failed: GroupFailed) -> None:
    """--distributed: ping the group (between steps, on the runner thread) every `interval`
    seconds; a ping is skipped when a step broadcast went out meanwhile. A failed ping
    fails the group as a failed step does (the server shuts down, exit 1)."""
    while group_failed.error is None:
        await trio.sleep(interval)
        try:
            await thread.call(runner.ping, interval)
        except GroupFailure as exc:
            log.error("tensor-parallel group failed: %s", exc)
            group_failed.set(exc)


def kv_scheme(config: Config, dtype: str) -> str:
    """The KV scheme part of the prefix-cache namespace."""
    if config.turboquant is not None:
        return (f"turboquant:{config.turboquant}:rotation={DEFAULT_ROTATION}:seed=0:"
                f"start={config.quantized_kv_start}")
    if config.kv_quant is not None:
        return f"affine:bits={config.kv_quant}:group={config.kv_group_size}"
    return f"plain:{dtype}"


def _prefix_cache(config: Config, loaded: LoadedModel, runner: Runner, thread: RunnerThread,
                  layout: PlaneLayout | None, states: Mapping[str, StateLayout],
                  default: SpecChoice | None, sizes: dict[str, int],
                  recorder: Recorder | None) -> tuple[PrefixCache, SpillEnds | None]:
    """The prefix cache with its namespaces (engine.namespaces): state-free, and one per
    speculation method whose rows pair their proposer's state (`states`); with a cache
    dir, the spill actor's Spill, its inbox and its reply edge's send end (the mailboxes
    are added to `sizes`; the prefix cache holds the other ends)."""
    namespaces = CacheNamespaces.build(loaded.fingerprint, kv_scheme(config, loaded.dtype),
                                       {m: s.identity for m, s in states.items()}, default)
    namespace = namespaces.base
    cache = functools.partial(
        PrefixCache, namespace=namespace, namespaces=namespaces, fingerprint=loaded.fingerprint,
        ram_budget=config.ram_cache_bytes, flush=config.ssd_flush, write=config.ssd_write)
    if config.cache_dir is None:
        return cache(), None
    # --distributed: rank 0's shard in its own subdirectory (storage.shard); the other
    # ranks' shards are ordered through the group (actors.shard_group)
    shard = (ShardId(runner.channel.group.size(), 0) if isinstance(runner, LeaderRunner)
             else None)
    paired = {namespaces.paired[m][1]: PairedLayout(target=layout, state=s)
              for m, s in states.items() if layout is not None}
    evictions = Evictions()
    tier = SsdTier(shard.directory(config.cache_dir) if shard else config.cache_dir,
                   config.ssd_cache_bytes, expected_fingerprints=[loaded.fingerprint],
                   on_evict=evictions, validate_header=header_validator(namespace, layout, paired),
                   shard=shard)
    group, orders = None, None
    if isinstance(runner, LeaderRunner) and shard is not None:
        group = ShardGroup(runner, thread, tier, shard.size)
        orders = ShardOrders(runner, thread)
    sizes["spill"] = SPILL_MAILBOX
    sizes["spill_replies"] = spill_replies_size(config.max_queued_requests)
    spill_out, spill_in = open_mailbox(sizes["spill"], "spill", recorder)
    answers_out, answers_in = open_mailbox(sizes["spill_replies"], "spill_replies", recorder)
    return (cache(spill=spill_out, replies=answers_in, orders=orders),
            (Spill(tier, evictions=evictions, group=group), spill_in, answers_out))
