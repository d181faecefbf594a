"""The engine facade: the handle `open_engine` yields (generate, cancel, shutdown,
statistics). It validates and tokenizes a request, opens its hub stream, and hands it to
admission's mailbox; cancels and the shutdown's StopAdmitting go the same way. It reads
the engine's state only from the board's one statistics snapshot (actors.board); the
one other door, the hub's stream hand-over (a trio channel no message can carry), is
listed with its reason in tests/actors/test_doors.py.
"""

from __future__ import annotations

import itertools
import uuid
import weakref
from collections import Counter

import attrs
import jinja2
import trio

from tqserve.actors.admission import SHUTTING_DOWN, queue_full
from tqserve.actors.board import Board, BoardSnapshot
from tqserve.actors.generation import Generation
from tqserve.actors.hub import Hub
from tqserve.actors.mailbox import Outbox
from tqserve.actors.messages import Cancel, Error, Event, StopAdmitting, Submit
from tqserve.actors.prefix_cache import PrefixCacheStatistics
from tqserve.actors.scheduler import GroupFailed
from tqserve.engine.config import Config
from tqserve.engine.kv_budget import KvBudget
from tqserve.engine.kvevents import KvEventPage
from tqserve.engine.model import LoadedModel
from tqserve.engine.prompt_logprobs import MAX_PROMPT_LOGPROBS_TOKENS
from tqserve.engine.request import GenerateRequest
from tqserve.engine.runner import Runner
from tqserve.engine.speculative.policy import check_speculative
from tqserve.engine.speculative.policy import SpeculationStatistics
from tqserve.engine.structured import BigStackExecutor, ResponseFormat, compile_format

# Prompts of at most this many characters are tokenized on the event loop (~1 ms); longer
# ones on a worker thread, so that one large prompt never stalls every other stream.
TOKENIZE_INLINE_CHARS = 4096
SHUTDOWN_GRACE = 5.0  # seconds ended requests' consumers get to read their final Done
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
    rows_active: int  # rows leased (prefilling or decoding)
    rows_queued: int  # admitted and waiting for a row, preempted rows included
    kv_bytes: int
    requests_total: int
    requests_rejected: int
    rejections: dict[str, int]  # refusals by error code (overloaded, invalid_request, ...)
    streams_open: int
    steps: int
    model: str
    dtype: str
    prefix_cache: PrefixCacheStatistics | None
    speculative: SpeculationStatistics | None = None  # with --speculative or a draft model
    kv_budget_bytes: int = 0    # engine.kv_budget: what admitted rows may hold together
    kv_charged_bytes: int = 0   # what the running rows are charged (engine.kv_budget)
    kv_preemptions: int = 0     # rows preempted to the prefix cache (--kv-admission preempt)
    # the bounds a client plans against: max_model_len (prompt + max_tokens), max_batch,
    # max_queued_requests, max_queued_tokens (tools/replay's load and context checks)
    limits: dict[str, int] = attrs.Factory(dict)


class Engine:
    """Handle returned by open_engine: generate, cancel, statistics."""

    def __init__(self, config: Config, loaded: LoadedModel, admission: Outbox, hub: Hub,
                 board: Board, *, kv_budget: KvBudget | None = None,
                 speculative_methods: frozenset[str] = frozenset(),
                 runner: Runner | None = None,
                 mailboxes: dict[str, int] | None = None) -> None:
        """`kv_budget` and `speculative_methods` are values (what validation checks a
        request against), `board` the statistics snapshot; nothing else of the actors."""
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
        self._board = board
        self._kv_budget = kv_budget
        self._speculative_methods = speculative_methods
        self.mailboxes = dict(mailboxes or {})  # the graph's mailboxes: name -> size
        self.group_failed = GroupFailed()  # --distributed: set when the group failed
        self._rejections: Counter[str] = Counter()  # refused before reaching admission
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
        check_speculative(self._speculative_methods, request.speculative)
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
        if (request.params.prompt_logprobs is not None
                and len(tokens) > MAX_PROMPT_LOGPROBS_TOKENS):
            raise ValueError(f"prompt holds {len(tokens)} tokens, more than the limit of "
                             f"{MAX_PROMPT_LOGPROBS_TOKENS} with prompt_logprobs (echo with "
                             f"logprobs)")
        if self._kv_budget is not None:
            self._kv_budget.check_alone(len(tokens), request.params.max_tokens)
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
        return Generation(self, request, uuid.uuid4().hex if request_id is None else request_id)

    def _num_queued(self) -> int:
        """Requests admission holds queued, as its last posted record says."""
        admission = self._board.snapshot.admission
        return admission.num_queued if admission is not None else 0

    def overloaded(self, request_id: str) -> Error | None:
        """The Error refusing a request before it is even tokenized: the admission queue is
        full (or the server is shutting down). An O(1) read of admission's posted record;
        the admission actor still decides every request that gets past it."""
        if self._shutting_down:
            return Error(request_id=request_id, code="shutting_down", message=SHUTTING_DOWN)
        queued, limit = self._num_queued(), self.config.max_queued_requests
        if queued < limit:
            return None
        return Error(request_id=request_id, code="overloaded", message=queue_full(queued, limit))

    def admission_room(self) -> tuple[int, str]:
        """About how many requests arriving now would not be refused as overload (the
        queue's free slots and the rows free to drain it; at least 1 while the queue has
        room, 0 once full), and the overload message (-1 while shutting down): the
        acceptor process's gate (api.handover). O(1)."""
        if self._shutting_down:
            return -1, SHUTTING_DOWN
        limit = self.config.max_queued_requests
        message = queue_full(limit, limit)
        if self._num_queued() >= limit:
            return 0, message
        return max(1, limit + self.config.max_batch - len(self._live)), message

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

    def _cancel_nowait(self, cancel: Cancel | StopAdmitting) -> None:
        try:
            self._admission.send_nowait(cancel)
        except trio.WouldBlock:  # a full mailbox: a system task waits for room
            trio.lowlevel.spawn_system_task(self._send_cancel, cancel)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    async def _send_cancel(self, cancel: Cancel | StopAdmitting) -> None:
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
        """From now on every new request is refused with code `shutting_down` (here at
        once; by admission for whatever reaches its mailbox after StopAdmitting)."""
        if not self._shutting_down:
            self._shutting_down = True
            self._cancel_nowait(StopAdmitting())

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
        """Wait until no row is leased and no KV bytes are resident or charged."""
        await self._board.wait_until(
            lambda snap: snap.cache_owner is not None and snap.cache_owner.idle)

    def statistics(self) -> EngineStatistics:
        """The engine's statistics, from the board's one snapshot (actors.board)."""
        snap = self._board.snapshot
        admission, owner, hub = snap.admission, snap.cache_owner, snap.hub
        if admission is None or owner is None or hub is None or snap.scheduler is None:
            raise RuntimeError("statistics before the actors started")
        rejections = self._rejections.copy()
        rejections["overloaded"] += admission.requests_rejected  # admission refuses only so
        early = sum(self._rejections.values())
        return EngineStatistics(
            rows_active=owner.rows_active,
            rows_queued=admission.num_queued + snap.scheduler.num_preempted_queued,
            kv_bytes=owner.kv_bytes, requests_total=admission.requests_total + early,
            requests_rejected=admission.requests_rejected + early,
            rejections={k: v for k, v in sorted(rejections.items()) if v},
            streams_open=hub.num_streams, steps=snap.scheduler.num_steps,
            model=self.model.path.name, dtype=self.model.dtype,
            prefix_cache=_prefix_statistics(snap), speculative=snap.speculation,
            kv_budget_bytes=owner.kv_budget_bytes, kv_charged_bytes=owner.kv_charged_bytes,
            kv_preemptions=owner.releases_by_reason.get("preempted", 0),
            limits={"max_model_len": self.model.context_length,
                    "max_batch": self.config.max_batch,
                    "max_queued_requests": self.config.max_queued_requests,
                    "max_queued_tokens": self.config.max_queued_tokens})

    def kv_events(self, since: int = 0) -> KvEventPage | None:
        """The prefix cache's KV events after batch `since` (engine.kvevents), or None when
        the prefix cache is off: a page of the append-only log the board publishes;
        ValueError if `since` < 0."""
        log = self._board.kv_events
        return log.since(since) if log is not None else None


def _prefix_statistics(snap: BoardSnapshot) -> PrefixCacheStatistics | None:
    """Both tiers' statistics: the index's record and the spill actor's."""
    if snap.prefix_cache is None:
        return None
    return PrefixCacheStatistics.of(snap.prefix_cache, snap.spill)
