"""open_engine(): starts the actor graph inside the caller's nursery.

    async with open_engine(Config(model=...)) as engine:
        async for event in engine.generate(GenerateRequest(prompt="def f(x):")):
            ...

The actor graph, drawn once (here; docs/design.md and DESIGN.md point to it). Every edge is a
bounded mailbox of msgpack bytes, named after the actor that reads it:

                 Submit, Cancel            Submit, Cancel
    generate() ----------------> admission ----------------> scheduler <--> runner thread
                                  |  ^  ^                     |  |  |  ^     (MLX)
                    Queued, Error |  |  +-- Dequeued (reply) -+  |  |  |
                                  v  |                           |  |  +-- SpecDecision
                                  hub  <-- StepTokens (one per --+  |  |    (reply)
                                  |  |     step), Done, Error       |  |
                                  |  +-- Cancel (reply) --> admission  |
                                  v                                 |  +-- SpecStep -->
                   per-stream channels --> generate()               |      speculation
                                                                    v
                                             Lease, Release, KvUsage --> cache_owner

    The prefix cache is part of the scheduler's task; its writer task takes snapshots
    from a bounded queue (WRITE_QUEUE, --ssd-flush async) and writes them to the SSD tier.

Edges (sender -> mailbox: messages), checked by tests/actors/test_graph.py against the
mailboxes `open_engine` creates and the messages that cross them:

    api -> admission: Submit Cancel
    admission -> scheduler: Submit Cancel
    admission -> hub: Queued Error
    scheduler -> hub: StepTokens Done Error
    scheduler -> cache_owner: Lease Release KvUsage
    scheduler -> admission_replies: Dequeued (reply edge)
    hub -> admission: Cancel (reply edge)
    scheduler -> speculation: SpecStep
    speculation -> speculation_replies: SpecDecision (reply edge)

The speculation actor and its two mailboxes exist only with speculation (--speculative or
--draft-model). Without the reply edges the graph is a DAG. The reply edges never block a
sender: admission_replies is sized for one Dequeued per queued request (send_nowait),
the hub's Cancels (a stream overflowed, or its text met a stop string) are sent by a task
of their own (`run_hub_cancels`), never by delivery; the ids waiting are at most the open
streams; speculation_replies holds one decision per SpecStep that can be answered before
the scheduler reads them all again (actors.speculation; send_nowait).

With --warmup (auto: on a GPU only) the runner first runs every decode batch size once
(engine.warmup: a private scheduler core, then a reset), before any actor starts.

The prefix cache (actors.prefix_cache) runs in the scheduler's task; with --cache-dir its
SSD tier is recovered (verified, quarantined, indexed) before the first request. The
writer task lives outside the actors' nursery: leaving `open_engine` stops the actors
first, then closes the write queue and waits until every queued snapshot is written
(drained), so a restart finds every snapshot that was queued.

Cancelling the caller's scope (or leaving the `async for` early) sends a Cancel;
the row is freed at the start of the next engine step. A stream that falls behind is cut
off by the hub, and a stream whose text meets a stop string is ended by it; either way
`run_hub_cancels` sends the Cancel into admission's mailbox at once (the reply edge), and
the row is freed within a step or two.
"""

from __future__ import annotations

import functools
import itertools
import logging
import uuid
import weakref
from collections import Counter
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Mapping

import attrs
import jinja2
import trio

from tqserve.actors.admission import SHUTTING_DOWN, AdmissionControl, run_admission
from tqserve.actors.cache_owner import RowBooks, run_cache_owner
from tqserve.actors.generation import Generation
from tqserve.actors.hub import Hub, run_hub, run_hub_cancels
from tqserve.actors.mailbox import Outbox, Recorder, open_mailbox
from tqserve.actors.messages import Cancel, Error, Event, Submit
from tqserve.actors.prefix_cache import (PrefixCache, PrefixCacheStatistics, header_validator,
                                 run_writer)
from tqserve.actors.runner_thread import RunnerThread
from tqserve.actors.scheduler import GroupFailed, run_scheduler
from tqserve.actors.shard_group import ShardGroup
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
from tqserve.engine.speculative.policy import SpecChoice, SpeculationPolicy, SpeculationStatistics
from tqserve.engine.speculative.state import PairedLayout, StateLayout
from tqserve.engine.namespaces import CacheNamespaces
from tqserve.engine.request import GenerateRequest
from tqserve.engine.runner import Runner
from tqserve.engine.scheduler import SchedulerCore
from tqserve.engine.snapshot_layout import PlaneLayout
from tqserve.engine.memory import kv_budget, kv_bytes_per_position
from tqserve.engine.structured import (BigStackExecutor, GrammarMasks, ResponseFormat,
                                       compile_format)
from tqserve.engine.warmup import wanted, warm_up
from tqserve.storage import SsdTier
from tqserve.storage.shard import ShardId

HEALTH_CHECKS = 4  # pings per --distributed-timeout: a follower waits at most 2 timeouts
log = logging.getLogger("tqserve.engine")

# Mailbox sizes. "If in doubt, use 0"; these are not 0 for the reasons given.
ADMISSION_MAILBOX = 64   # absorbs a burst of submits; a full mailbox rejects at once
SCHEDULER_MAILBOX = 64   # admitted requests and cancels waiting for the next step boundary
HUB_MAILBOX = 256        # a few steps' StepTokens (one per step) plus one finish per row
CACHE_OWNER_MAILBOX = 64  # leases/releases of one step; the owner only does bookkeeping
# Prompts of at most this many characters are tokenized on the event loop (~1 ms); longer
# ones on a worker thread, so that one large prompt never stalls every other stream.
TOKENIZE_INLINE_CHARS = 4096
SHUTDOWN_GRACE = 5.0  # seconds ended requests' consumers get to read their final Done
CLOSE_SETTLE = 5.0  # seconds at close for finished rows to release (their snapshots taken, written)
# Untrusted response_formats compile on these threads (engine.structured.worker): two, so
# that one slow grammar does not hold up every other structured request; a compile
# longer than this is refused (the formats' size limits keep real ones under ~0.2 s).
COMPILE_THREADS = 2
GRAMMAR_COMPILE_SECONDS = 10.0


@attrs.frozen(kw_only=True)
class ShutdownReport:
    num_in_flight: int  # requests running when shutdown began
    num_ended: int      # of those, ended with finish_reason "shutdown" at the timeout


@attrs.frozen(kw_only=True)
class EngineStatistics:
    rows_active: int
    rows_queued: int
    kv_bytes: int
    requests_total: int
    requests_rejected: int
    rejections: dict[str, int]  # refusals by error code (overloaded, invalid_request, ...)
    streams_open: int
    steps: int
    model: str
    dtype: str
    prefix_cache: PrefixCacheStatistics | None
    speculative: SpeculationStatistics | None = None  # with --speculative / --draft-model
    kv_budget_bytes: int = 0    # engine.kv_budget: what admitted rows may hold together
    kv_charged_bytes: int = 0   # what the running rows are charged for their whole lives
    # the bounds a client plans against: max_model_len (prompt + max_tokens), max_batch,
    # max_queued_requests, max_queued_tokens (tools/replay's load and context checks)
    limits: dict[str, int] = attrs.Factory(dict)


class Engine:
    """Handle returned by open_engine: generate, cancel, statistics."""

    def __init__(self, config: Config, loaded: LoadedModel, admission: Outbox, hub: Hub,
                 control: AdmissionControl, books: RowBooks, core: SchedulerCore,
                 prefix: PrefixCache | None = None, runner: Runner | None = None,
                 mailboxes: dict[str, int] | None = None,
                 speculation: SpeculationPolicy | None = None) -> None:
        self._live: dict[str, str] = {}  # caller's id -> internal id, while its stream is open
        self._live_changed = trio.Event()  # replaced after every stream end
        self._internal_ids = itertools.count()
        self._shutting_down = False
        self.config = config
        self.runner = runner  # its statistics and `step_hook` (fault injection in tests)
        self.model = loaded
        # --chat-template's text, else the tokenizer's own template (None: "role: content")
        self.chat_template: str | None = None
        if config.chat_template is not None:
            with open(config.chat_template, encoding="utf-8") as f:
                self.chat_template = f.read()
        self._admission = admission
        self._hub = hub
        self._control = control
        self._books = books
        self._core = core
        self.prefix = prefix
        self.mailboxes = dict(mailboxes or {})  # the graph's mailboxes: name -> size
        self.group_failed = GroupFailed()  # --distributed: set when the group failed
        self._rejections: Counter[str] = Counter()  # refused before reaching admission
        self._speculation = speculation  # the speculation actor's books (same trio thread)
        self._compiler = BigStackExecutor(COMPILE_THREADS, "tqserve-grammar-compile")
        weakref.finalize(self, self._compiler.shutdown, wait=False)

    def note_rejection(self, code: str) -> None:
        """Count a request refused outside the engine (e.g. a bad frame at the API)."""
        self._rejections[code] += 1

    async def validate(self, request: GenerateRequest) -> tuple[int, ...]:
        """Check limits, tokenize (a long prompt on a worker thread), check the tokens;
        raises ValueError naming the field."""
        limit = self.model.context_length
        request.check_limits(max_prompt_chars=self.config.max_prompt_chars,
                             max_messages=self.config.max_messages, max_prompt_tokens=limit)
        vocab = self.model.vocab_size
        bad = next((t for t in request.params.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids holds id {bad}, outside the vocabulary "
                             f"(size {vocab})")
        bad = next((t for t, _ in request.params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias holds id {bad}, outside the vocabulary (size {vocab})")
        self._core.check_speculative(request.speculative)
        try:
            if request.num_chars <= TOKENIZE_INLINE_CHARS:
                tokens = request.token_ids(self.model.tokenizer, self.chat_template)
            else:
                tokens = await trio.to_thread.run_sync(request.token_ids, self.model.tokenizer,
                                                    self.chat_template)
        except (TypeError, UnicodeError) as exc:
            raise ValueError(f"prompt cannot be tokenized: {exc}") from None
        except jinja2.TemplateError as exc:  # e.g. a template's raise_exception()
            raise ValueError(f"messages cannot be rendered by the chat template: {exc}") \
                from None
        if not tokens:
            raise ValueError("prompt encodes to zero tokens")
        bad = next((t for t in tokens if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_tokens holds id {bad}, outside the vocabulary (size {vocab})")
        self._core.check_kv_alone(len(tokens), request.params.max_tokens)
        if len(tokens) + request.params.max_tokens > limit:
            raise ValueError(
                f"prompt ({len(tokens)} tokens) plus max_tokens ({request.params.max_tokens}) "
                f"exceeds the model's context of {limit} tokens")
        if request.params.max_tokens > self.config.max_tokens_cap:
            raise ValueError(f"max_tokens must be <= {self.config.max_tokens_cap} (the "
                             f"server's --max-tokens-cap), got {request.params.max_tokens}")
        return tokens

    async def compile_constraint(self, request: GenerateRequest) -> ResponseFormat | None:
        """llguidance's compile of the request's checked response_format, on a large-stack
        worker thread, never on the event loop (a native stack overflow there killed the
        server: issue 20); ValueError naming the field, or the time limit."""
        if request.constraint is None:
            return None
        future = self._compiler.submit(compile_format, request.constraint)
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()

        def wake(_: object) -> None:
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass

        future.add_done_callback(wake)
        with trio.move_on_after(GRAMMAR_COMPILE_SECONDS):
            await done.wait()
        if not future.done():
            future.cancel()
            raise ValueError(f"response_format took more than {GRAMMAR_COMPILE_SECONDS:g} s "
                             "to compile (the server's limit)")
        return future.result()

    def generate(self, request: GenerateRequest, request_id: str | None = None) -> Generation:
        """The request's events as an async iterable: Queued, Token..., then Done or Error.

        `request_id` labels the events (default: a fresh id); the engine runs the request
        under an internal id of its own (see actors.generation). Leaving the loop early,
        or cancelling the caller's scope, cancels the request at once."""
        return Generation(self, request, request_id or uuid.uuid4().hex)

    def overloaded(self, request_id: str) -> Error | None:
        """The Error refusing a request before it is even tokenized: the admission queue is
        full (or the server is shutting down). An O(1) read of admission's books; the
        admission actor still decides every request that gets past it."""
        reason = self._control.full()
        if reason is None:
            return None
        code = "shutting_down" if reason == SHUTTING_DOWN else "overloaded"
        return Error(request_id=request_id, code=code, message=reason)

    def refusal(self, request_id: str) -> Error | None:
        """The Error refusing a new request now (id in use, shutting down), or None."""
        if request_id in self._live:
            return Error(request_id=request_id, code="invalid_request",
                         message=f"request id {request_id!r} is already in use")
        if self._shutting_down:
            return Error(request_id=request_id, code="shutting_down", message=SHUTTING_DOWN)
        return None

    def open_internal(self, request_id: str, stop: tuple[str, ...] = ()
                      ) -> tuple[str, trio.MemoryReceiveChannel[Event]]:
        """A fresh internal id for `request_id` and its hub stream (text ending at `stop`)."""
        internal = f"{request_id}#{next(self._internal_ids)}"
        self._live[request_id] = internal
        return internal, self._hub.open_stream(internal, stop, label=request_id)

    def submit_nowait(self, submit: Submit) -> None:
        """Hand a request to admission; trio.WouldBlock when its mailbox is full."""
        self._admission.send_nowait(submit)

    def close_internal(self, request_id: str, internal: str, *, cancel: bool) -> None:
        """A stream ended: forget it and, if its request may still run, cancel it now
        (synchronously: this runs from a dropped iterator's __del__ too)."""
        self._hub.close_stream(internal)
        if self._live.get(request_id) == internal:
            del self._live[request_id]
        self._live_changed.set()
        self._live_changed = trio.Event()
        if cancel:
            self._cancel_nowait(Cancel(request_id=internal))

    def stream_cut_off(self, internal: str) -> Error:
        """The error ending a stream the hub closed without a Done."""
        if self._hub.overflowed(internal):
            return Error(request_id=internal, code="slow_consumer",
                         message=f"client fell {self.config.stream_buffer} events behind")
        return Error(request_id=internal, code="engine_closed", message="engine shut down")

    def add_dequeue_listener(self, listener: Callable[[str], None]) -> None:
        """Call `listener(request_id)` (on the engine's trio thread) whenever a request
        leaves the queue for a row; the api's metrics time queue waits with it."""
        self._control.dequeue_listeners.append(listener)

    def _cancel_nowait(self, cancel: Cancel) -> None:
        try:
            self._admission.send_nowait(cancel)
        except trio.WouldBlock:  # a full mailbox: a system task waits for room
            trio.lowlevel.spawn_system_task(self._send_cancel, cancel)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    async def _send_cancel(self, cancel: Cancel) -> None:
        try:
            await self._admission.send(cancel)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    async def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        """Cancel the running request labelled `request_id` (its stream ends with
        Done(finish_reason=reason)); unknown ids are ignored."""
        internal = self._live.get(request_id)
        if internal is None:
            return
        try:
            await self._admission.send(Cancel(request_id=internal, reason=reason))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    @property
    def shutting_down(self) -> bool:
        return self._shutting_down

    def stop_admitting(self) -> None:
        """From now on every new request is refused with code `shutting_down`."""
        self._shutting_down = True
        self._control.stop_admitting()

    @property
    def num_live(self) -> int:
        """Requests whose stream is still open."""
        return len(self._live)

    async def wait_no_live(self) -> None:
        """Wait until every request's stream has ended."""
        while self._live:
            await self._live_changed.wait()

    async def shutdown(self, timeout: float, grace: float = SHUTDOWN_GRACE) -> ShutdownReport:
        """Stop admitting; give in-flight requests `timeout` seconds to finish, then end
        the rest with Done(finish_reason="shutdown") and wait (at most `grace` seconds:
        a consumer that stopped reading never takes its Done) for their streams to end."""
        self.stop_admitting()
        in_flight = len(self._live)
        with trio.move_on_after(timeout):
            await self.wait_no_live()
        ended = list(self._live)
        for request_id in ended:
            await self.cancel(request_id, reason="shutdown")
        with trio.move_on_after(grace):
            await self.wait_no_live()
        return ShutdownReport(num_in_flight=in_flight, num_ended=len(ended))

    async def wait_idle(self) -> None:
        """Wait until no row is leased and no KV bytes are resident."""
        while not self._books.idle:
            await self._books.changed.wait()

    def statistics(self) -> EngineStatistics:
        admission = self._control.statistics()
        rows = self._books.statistics()
        rejections = self._rejections.copy()
        rejections["overloaded"] += admission.requests_rejected  # admission refuses only so
        early = sum(self._rejections.values())
        return EngineStatistics(
            rows_active=rows.rows_active, rows_queued=admission.num_queued,
            kv_bytes=rows.kv_bytes, requests_total=admission.requests_total + early,
            requests_rejected=admission.requests_rejected + early,
            rejections={k: v for k, v in sorted(rejections.items()) if v},
            streams_open=self._hub.statistics().num_streams,
            steps=self._core.statistics().num_steps,
            model=self.model.path.name, dtype=self.model.dtype,
            prefix_cache=self.prefix.statistics() if self.prefix is not None else None,
            speculative=self._speculative_statistics(),
            kv_budget_bytes=self._core.kv_budget_bytes, kv_charged_bytes=self._core.kv_charge(),
            limits={"max_model_len": self.model.context_length,
                    "max_batch": self.config.max_batch,
                    "max_queued_requests": self.config.max_queued_requests,
                    "max_queued_tokens": self.config.max_queued_tokens})

    def _speculative_statistics(self) -> SpeculationStatistics | None:
        """The speculation actor's books."""
        return self._speculation.statistics() if self._speculation is not None else None


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
        if loaded is None:
            loaded = await thread.call(load_model, config.model, config.dtype,
                                     config.quantized_weights)
        channel = None
        group_failed = GroupFailed()
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
                                       config.kv_group_size)
        tokenizer = loaded.tokenizer
        draft = None
        if config.draft_model is not None:
            draft = await thread.call(load_model, config.draft_model, config.dtype,
                                    config.quantized_weights)
        speculator = await thread.call(build_speculator, config, loaded, draft)
        budget = await thread.call(functools.partial(
            kv_budget, loaded, make_cache, draft, per_position=per_position,
            budget_bytes=config.kv_budget_bytes,
            mtp=config.speculative == "mtp",
            margin=config.num_speculative_tokens + 1 if speculator is not None else 0))
        core = SchedulerCore(
            max_batch=config.max_batch, prefill_chunk=config.prefill_chunk,
            max_step_tokens=config.max_step_tokens,
            eos_token_ids=loaded.eos_token_ids,
            speculative_methods=speculator.proposers if speculator is not None else (),
            kv_budget=budget)
        masks = GrammarMasks(tokenizer, loaded.vocab_size, loaded.eos_token_ids)
        fast = fastpath.wanted(config.fast_decode, config.distributed)
        if fast:  # in place: one copy of the weights (engine.fastpath)
            await thread.call(fastpath.fuse_projections, loaded.model)
        runner = (Runner(loaded.model, make_cache, masks, speculator, fast_decode=fast)
                  if channel is None
                  else LeaderRunner(channel, config.distributed_timeout, loaded.model,
                                    make_cache, masks))
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
        books = RowBooks()
        hub = Hub(config.stream_buffer, lambda stop: TextStream(tokenizer, stop))
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
        speculation, link, spec_default = None, None, None
        if speculator is not None:
            spec_default = speculator.default
            sizes["speculation"] = SPECULATION_MAILBOX
            sizes["speculation_replies"] = reply_mailbox_size(SPECULATION_MAILBOX)
            spec_out, spec_in = open_mailbox(sizes["speculation"], "speculation", recorder)
            decisions_out, decisions_in = open_mailbox(sizes["speculation_replies"],
                                                       "speculation_replies", recorder)
            speculation = SpeculationPolicy(spec_policy(config))
            link = SpeculationLink(outbox=spec_out, replies=decisions_in, default=spec_default)
        prefix = None
        if config.prefix_cache:
            refused = await thread.call(runner.unsnapshottable_caches)
            if not refused:
                layout = await thread.call(runner.plane_layout)
                states = await thread.call(runner.state_layouts)
                prefix = _prefix_cache(config, loaded, runner, thread, layout, states,
                                       spec_default)
            else:
                log.warning("prefix cache off: this model's %s layers cannot be reused by "
                            "prefix (a sliding window overwrites positions; recurrent state "
                            "cannot be cut back to a shorter prefix)", ", ".join(refused))
        if prefix is not None:
            await prefix.recover()  # before the nursery: a bad cache-dir is a plain ValueError
        async with trio.open_nursery() as writer:
            if prefix is not None and config.ssd_flush == "async" and prefix.tier is not None:
                await writer.start(run_writer, prefix)
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(run_hub, hub, hub_in)
                    await nursery.start(run_cache_owner, books, owner_in)
                    if speculation is not None:
                        await nursery.start(run_speculation, speculation, spec_default,
                                            spec_in, decisions_out)
                    await nursery.start(
                        functools.partial(run_scheduler, group_failed=group_failed,
                                          speculation=link),
                        core, runner, thread, scheduler_in, replies_out, owner_out,
                        hub_out.clone(), prefix)
                    nursery.start_soon(run_hub_cancels, hub, admission_out.clone())
                    if isinstance(runner, LeaderRunner):
                        nursery.start_soon(run_health_check, runner, thread,
                                           config.distributed_timeout / HEALTH_CHECKS,
                                           group_failed)
                    await nursery.start(run_admission, control, admission_in, replies_in,
                                        scheduler_out, hub_out)
                    try:
                        engine = Engine(config, loaded, admission_out, hub, control, books,
                                        core, prefix, runner, sizes, speculation)
                        engine.group_failed = group_failed
                        yield engine
                        if not engine.num_live:  # rows of finished requests: release them
                            with trio.move_on_after(CLOSE_SETTLE):
                                await engine.wait_idle()
                    finally:
                        nursery.cancel_scope.cancel()
            finally:
                # The actors are gone (no more writes can be queued): drain the queue.
                if prefix is not None:
                    with trio.CancelScope(shield=True):
                        await prefix.close_writes()
    finally:
        try:
            if runner is not None:
                await thread.call(runner.close)  # shielded: MLX idle before the thread ends
        finally:
            await thread.aclose()


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


def _log_eviction(key: str) -> None:
    logging.getLogger("tqserve.prefix").info("snapshot removed %s", key)


def _prefix_cache(config: Config, loaded: LoadedModel, runner: Runner, thread: RunnerThread,
                  layout: PlaneLayout | None, states: Mapping[str, StateLayout],
                  default: SpecChoice | None) -> PrefixCache:
    """The prefix cache with its namespaces (engine.namespaces): state-free, and one per
    speculation method whose rows pair their proposer's state (`states`)."""
    namespaces = CacheNamespaces.build(loaded.fingerprint, kv_scheme(config, loaded.dtype),
                                       {m: s.identity for m, s in states.items()}, default)
    namespace = namespaces.base
    tier, group = None, None
    # --distributed: rank 0's shard in its own subdirectory (storage.shard); the other
    # ranks' shards are ordered through the group (actors.shard_group)
    shard = (ShardId(runner.channel.group.size(), 0) if isinstance(runner, LeaderRunner)
             else None)
    if config.cache_dir is not None:
        paired = {namespaces.paired[m][1]: PairedLayout(target=layout, state=s)
                  for m, s in states.items() if layout is not None}
        tier = SsdTier(shard.directory(config.cache_dir) if shard else config.cache_dir,
                       config.ssd_cache_bytes,
                       expected_fingerprints=[loaded.fingerprint], on_evict=_log_eviction,
                       validate_header=header_validator(namespace, layout, paired),
                       shard=shard)
        if isinstance(runner, LeaderRunner) and shard is not None:
            group = ShardGroup(runner, thread, tier, shard.size)

    async def restore(*args: object) -> int:
        return await thread.call(runner.restore, *args)

    return PrefixCache(
        namespace=namespace, namespaces=namespaces,
        fingerprint=loaded.fingerprint, ram_budget=config.ram_cache_bytes, tier=tier,
        flush=config.ssd_flush, write=config.ssd_write, runner_call=restore, group=group)
