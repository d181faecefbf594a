"""open_engine(): starts the actor graph inside the caller's nursery.

    async with open_engine(Config(model=...)) as engine:
        async for event in engine.generate(GenerateRequest(prompt="def f(x):")):
            ...

The graph (every edge a bounded msgpack mailbox):

    generate() -> admission -> scheduler -> hub -> generate()
                      ^            |  \\
                      +-Dequeued---+   -> cache_owner
                                   \\-> writer task (--ssd-flush async; WRITE_QUEUE)

The prefix cache (actors.prefix_cache) runs in the scheduler's task; with --cache-dir its
SSD tier is recovered (verified, quarantined, indexed) before the first request. The
writer task lives outside the actors' nursery: leaving `open_engine` stops the actors
first, then closes the write queue and waits until every queued snapshot is written
(drained), so a restart finds every snapshot that was queued.

Cancelling the caller's scope (or leaving the `async for` early) sends a Cancel;
the row is freed at the start of the next engine step. A stream that falls behind is cut
off by the hub, whose `run_overflow_cancels` task sends the Cancel into admission's
mailbox at once (a reply edge: hub delivery never waits on it).
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

import attrs
import trio

from actors.admission import AdmissionControl, run_admission
from actors.cache_owner import RowBooks, run_cache_owner
from actors.hub import Hub, run_hub, run_overflow_cancels
from actors.mailbox import Outbox, Recorder, open_mailbox
from actors.messages import Cancel, Done, Error, Event, Submit
from actors.prefix_cache import (PrefixCache, PrefixCacheStatistics, header_validator,
                                 run_writer)
from actors.runner_thread import RunnerThread
from actors.scheduler import run_scheduler
from engine.config import Config
from engine.detokenize import TextStream
from engine.kv.factory import cache_factory_for
from engine.codec.turboquant import DEFAULT_ROTATION
from engine.model import LoadedModel, load_model
from engine.prefix import cache_namespace
from engine.request import GenerateRequest
from engine.runner import Runner
from engine.scheduler import SchedulerCore
from engine.snapshot import PlaneLayout
from engine.structured import GrammarMasks
from storage import SsdTier

log = logging.getLogger("tqserve.engine")

# Mailbox sizes. "If in doubt, use 0"; these are not 0 for the reasons given.
ADMISSION_MAILBOX = 64   # absorbs a burst of submits; a full mailbox rejects at once
SCHEDULER_MAILBOX = 64   # admitted requests and cancels waiting for the next step boundary
HUB_MAILBOX = 256        # one step's events for a full batch (max rows) plus finishes
CACHE_OWNER_MAILBOX = 64  # leases/releases of one step; the owner only does bookkeeping
# Prompts of at most this many characters are tokenized on the event loop (~1 ms); longer
# ones on a worker thread, so that one large prompt never stalls every other stream.
TOKENIZE_INLINE_CHARS = 4096


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


class Engine:
    """Handle returned by open_engine: generate, cancel, statistics."""

    def __init__(self, config: Config, loaded: LoadedModel, admission: Outbox, hub: Hub,
                 control: AdmissionControl, books: RowBooks, core: SchedulerCore,
                 prefix: PrefixCache | None = None, runner: Runner | None = None) -> None:
        self.config = config
        self.runner = runner  # its statistics and `step_hook` (fault injection in tests)
        self.model = loaded
        self._admission = admission
        self._hub = hub
        self._control = control
        self._books = books
        self._core = core
        self.prefix = prefix
        self._rejections: Counter[str] = Counter()  # refused before reaching admission

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
        try:
            if request.num_chars <= TOKENIZE_INLINE_CHARS:
                tokens = request.token_ids(self.model.tokenizer)
            else:
                tokens = await trio.to_thread.run_sync(request.token_ids, self.model.tokenizer)
        except (TypeError, UnicodeError) as exc:
            raise ValueError(f"prompt cannot be tokenized: {exc}") from None
        if not tokens:
            raise ValueError("prompt encodes to zero tokens")
        bad = next((t for t in tokens if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_tokens holds id {bad}, outside the vocabulary (size {vocab})")
        if len(tokens) + request.params.max_tokens > limit:
            raise ValueError(
                f"prompt ({len(tokens)} tokens) plus max_tokens ({request.params.max_tokens}) "
                f"exceeds the model's context of {limit} tokens")
        if request.params.max_tokens > self.config.max_tokens_cap:
            raise ValueError(f"max_tokens must be <= {self.config.max_tokens_cap}, "
                             f"got {request.params.max_tokens}")
        return tokens

    async def generate(self, request: GenerateRequest,
                       request_id: str | None = None) -> AsyncIterator[Event]:
        """Submit a request and yield its events: Queued, Token..., then Done or Error."""
        rid = request_id or uuid.uuid4().hex
        try:
            if not rid.isprintable() or len(rid.encode("utf-8", "strict")) > 512:
                raise ValueError("request id must be printable text of at most 512 bytes")
            tokens = await self.validate(request)
            stream = self._hub.open_stream(rid)
        except (ValueError, UnicodeError) as exc:
            self._rejections["invalid_request"] += 1
            yield Error(request_id=rid if rid.isprintable() else None, code="invalid_request",
                        message=str(exc))
            return
        finished = False
        try:
            try:
                self._admission.send_nowait(
                    Submit(request_id=rid, prompt_tokens=tokens, params=request.params,
                           response_format=request.constraint))
            except trio.WouldBlock:
                finished = True
                self._rejections["overloaded"] += 1
                yield Error(request_id=rid, code="overloaded", message="admission mailbox full")
                return
            except (OverflowError, TypeError, ValueError) as exc:  # our bug: validation missed it
                log.exception("request %s cannot be encoded", rid)
                finished = True
                self._rejections["internal_error"] += 1
                yield Error(request_id=rid, code="internal_error",
                            message=f"request cannot be encoded: {type(exc).__name__}: {exc}")
                return
            async for event in stream:
                if isinstance(event, (Done, Error)):
                    finished = True
                yield event
                if finished:
                    return
            if self._hub.overflowed(rid):
                yield Error(request_id=rid, code="slow_consumer",
                            message=f"client fell {self.config.stream_buffer} events behind")
            else:
                yield Error(request_id=rid, code="engine_closed", message="engine shut down")
        finally:
            self._hub.close_stream(rid)
            if not finished:
                with trio.CancelScope(shield=True):
                    await self.cancel(rid)

    def add_dequeue_listener(self, listener: Callable[[str], None]) -> None:
        """Call `listener(request_id)` (on the engine's trio thread) whenever a request
        leaves the queue for a row; the api's metrics time queue waits with it."""
        self._control.dequeue_listeners.append(listener)

    async def cancel(self, request_id: str) -> None:
        """Cancel a request by id; unknown ids are ignored."""
        try:
            await self._admission.send(Cancel(request_id=request_id))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

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
            prefix_cache=self.prefix.statistics() if self.prefix is not None else None)


@asynccontextmanager
async def open_engine(config: Config, *, loaded: LoadedModel | None = None,
                      recorder: Recorder | None = None) -> AsyncIterator[Engine]:
    """Load the model (unless given) and run the actor graph until the block exits."""
    thread = RunnerThread()
    try:
        if loaded is None:
            loaded = await thread.call(load_model, config.model, config.dtype)
        make_cache = await thread.call(cache_factory_for, loaded.model, config.turboquant,
                                       config.quantized_kv_start, config.kv_quant,
                                       config.kv_group_size)
        tokenizer = loaded.tokenizer
        core = SchedulerCore(
            max_batch=config.max_batch, prefill_chunk=config.prefill_chunk,
            eos_token_ids=loaded.eos_token_ids,
            make_text_stream=lambda stop: TextStream(tokenizer, stop))
        runner = Runner(loaded.model, make_cache,
                        GrammarMasks(tokenizer, loaded.vocab_size, loaded.eos_token_ids))
        control = AdmissionControl(max_queued_requests=config.max_queued_requests,
                                   max_queued_tokens=config.max_queued_tokens)
        books = RowBooks()
        hub = Hub(config.stream_buffer)
        admission_out, admission_in = open_mailbox(ADMISSION_MAILBOX, "admission", recorder)
        scheduler_out, scheduler_in = open_mailbox(SCHEDULER_MAILBOX, "scheduler", recorder)
        hub_out, hub_in = open_mailbox(HUB_MAILBOX, "hub", recorder)
        owner_out, owner_in = open_mailbox(CACHE_OWNER_MAILBOX, "cache_owner", recorder)
        # Reply edge: one Dequeued per queued request, so this size can never fill.
        replies_out, replies_in = open_mailbox(config.max_queued_requests + SCHEDULER_MAILBOX,
                                               "admission_replies", recorder)
        prefix = None
        if config.prefix_cache:
            if await thread.call(runner.can_snapshot):
                layout = await thread.call(runner.plane_layout)
                prefix = _prefix_cache(config, loaded, runner, thread, layout)
            else:
                log.warning("prefix cache off: this model has caches that cannot be reused "
                            "by prefix (sliding-window layers)")
        if prefix is not None:
            await prefix.recover()  # before the nursery: a bad cache-dir is a plain ValueError
        async with trio.open_nursery() as writer:
            if prefix is not None and config.ssd_flush == "async" and prefix.tier is not None:
                await writer.start(run_writer, prefix)
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(run_hub, hub, hub_in)
                    await nursery.start(run_cache_owner, books, owner_in)
                    await nursery.start(run_scheduler, core, runner, thread, scheduler_in,
                                        replies_out, owner_out, hub_out.clone(), prefix)
                    await nursery.start(run_admission, control, admission_in, replies_in,
                                        scheduler_out, hub_out)
                    try:
                        yield Engine(config, loaded, admission_out, hub, control, books, core,
                                     prefix, runner)
                    finally:
                        nursery.cancel_scope.cancel()
            finally:
                # The actors are gone (no more writes can be queued): drain the queue.
                if prefix is not None:
                    with trio.CancelScope(shield=True):
                        await prefix.close_writes()
    finally:
        await thread.aclose()


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


def _prefix_cache(config: Config, loaded: LoadedModel, runner: Runner,
                  thread: RunnerThread, layout: PlaneLayout | None) -> PrefixCache:
    namespace = cache_namespace(loaded.fingerprint, kv_scheme(config, loaded.dtype))
    tier = None
    if config.cache_dir is not None:
        tier = SsdTier(config.cache_dir, config.ssd_cache_bytes,
                       expected_fingerprints=[loaded.fingerprint], on_evict=_log_eviction,
                       validate_header=header_validator(namespace, layout))

    async def restore(*args: object) -> int:
        return await thread.call(runner.restore, *args)

    return PrefixCache(
        namespace=namespace,
        fingerprint=loaded.fingerprint, ram_budget=config.ram_cache_bytes, tier=tier,
        flush=config.ssd_flush, write=config.ssd_write, runner_call=restore)
