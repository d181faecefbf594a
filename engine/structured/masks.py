"""Per-row grammar matchers and their next-token masks, computed off the runner's path.

`GrammarMasks` owns the llguidance tokenizer (built once, on first use, from the model's
Hugging Face tokenizer: byte-level BPE works as it is) and ONE worker thread, which does
only llguidance work (pure CPU, no MLX; llguidance drops the GIL while it computes a
mask). A constrained row's `RowGrammar` goes through:

    open_row   (row created)   worker: build the matcher (a resumed row's: having
                               consumed its output so far), compute the first mask
                               -- overlaps the row's prefill
    mask()     (sampling)      runner: take the mask; waits only if the worker is late
    advance(t) (token read)    runner: consume the sampled token (microseconds), so a
                               finished grammar stops the row at once; then the worker
                               computes the next mask while the forward just launched
                               runs and the actors do their round trip

The worker's queue is bounded by the rows: a row asks for its next mask only after the
runner took its last one, so at most one job per constrained row (max_batch) is queued.

A mask is a bitmask of `num_words` int32 words, bit t of word t // 32 set when token t is
allowed; EOS is allowed only where the grammar accepts. A matcher that fails (a grammar
llguidance cannot build for this tokenizer, or one that hits its parser limits) sets
`error`; the runner then finishes the row with that message.
"""

from __future__ import annotations

import logging
import time
import weakref
from concurrent.futures import Future
from functools import partial
from typing import Any, Callable, Iterable, Sequence

import attrs
import llguidance
import numpy as np

from tqserve.engine.structured.formats import ResponseFormat
from tqserve.engine.structured.worker import BigStackExecutor

log = logging.getLogger("tqserve.grammar")


class GrammarFailure(RuntimeError):
    """A matcher could not be built or went into llguidance's error state."""


@attrs.frozen(kw_only=True)
class GrammarStatistics:
    num_rows: int          # constrained rows opened
    num_masks: int         # masks computed by the worker
    mask_seconds: float    # worker time spent computing masks (first masks include the build)
    wait_seconds: float    # runner time spent waiting for a mask the worker had not finished
    consume_seconds: float  # runner time spent consuming sampled tokens


@attrs.define
class _Counters:
    num_rows: int = 0
    num_masks: int = 0
    mask_seconds: float = 0.0
    wait_seconds: float = 0.0
    consume_seconds: float = 0.0


class GrammarMasks:
    """Matchers for constrained rows, one worker thread computing their masks."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int], *,
                 inline: bool = False) -> None:
        """`inline=True` computes masks on the calling (runner) thread instead: only for
        measuring what the worker thread saves (tools/bench_grammar)."""
        self.inline = inline
        self._hf_tokenizer = getattr(tokenizer, "_tokenizer", tokenizer)
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self._eos = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        # llguidance compiles each row's grammar here again: a large stack (worker.py)
        self._pool = BigStackExecutor(1, "tqserve-grammar")
        weakref.finalize(self, self._pool.shutdown, wait=False)
        self.counters = _Counters()

    def tokenizer(self) -> llguidance.LLTokenizer:
        """The llguidance tokenizer (built on first call; worker thread only)."""
        if self._tokenizer is None:
            try:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos)
            except Exception as exc:  # an unsupported tokenizer: every constrained row says so
                raise GrammarFailure(
                    f"this model's tokenizer cannot drive structured output: {exc}") from exc
        return self._tokenizer

    def submit(self, fn: Callable[[], None]) -> Future[None]:
        """Run `fn` on the worker thread (or now, inline)."""
        if not self.inline:
            return self._pool.submit(fn)
        future: Future[None] = Future()
        try:
            fn()
            future.set_result(None)
        except Exception as exc:
            future.set_exception(exc)
        return future

    def open_row(self, fmt: ResponseFormat, consumed: Sequence[int] = ()) -> RowGrammar:
        """Start a row's matcher on the worker thread, having consumed `consumed` (a
        preempted row's output so far); its first mask follows."""
        self.counters.num_rows += 1
        return RowGrammar(self, fmt, consumed)

    def batch_masks(self, grammars: Sequence[RowGrammar | None]) -> np.ndarray | None:
        """The rows' next masks (all ones for an unconstrained row, whose tokens are then
        unchanged), or None if no row is constrained."""
        if not any(grammars):
            return None
        out = np.full((len(grammars), self.num_words), -1, dtype=np.int32)
        for i, grammar in enumerate(grammars):
            bits = grammar.mask() if grammar is not None else None
            if bits is not None:
                out[i] = bits
        return out

    def statistics(self) -> GrammarStatistics:
        c = self.counters
        return GrammarStatistics(num_rows=c.num_rows, num_masks=c.num_masks,
                                 mask_seconds=c.mask_seconds, wait_seconds=c.wait_seconds,
                                 consume_seconds=c.consume_seconds)


class RowGrammar:
    """One row's matcher and its next mask (see the module docstring for the timeline)."""

    def __init__(self, owner: GrammarMasks, fmt: ResponseFormat,
                 consumed: Sequence[int] = ()) -> None:
        self._owner = owner
        self._grammar = fmt.grammar
        self._matcher: llguidance.LLMatcher | None = None
        self._bits = np.zeros(owner.num_words, dtype=np.int32)
        self.error: str | None = None
        self.stopped = False
        self._future = owner.submit(partial(self._start, tuple(consumed)))

    def _start(self, consumed: tuple[int, ...]) -> None:  # worker thread
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(self._owner.tokenizer(), self._grammar, log_level=0)
        if matcher.is_error():
            raise GrammarFailure(matcher.get_error())
        for token in consumed:  # where a preempted row's grammar stopped
            if not matcher.consume_token(token) or matcher.is_error() or matcher.is_stopped():
                raise GrammarFailure(f"its own output so far, token {token}, does not fit: "
                                     f"{matcher.get_error()}")
        self._matcher = matcher
        self._owner.counters.mask_seconds += time.perf_counter() - started
        self._fill()

    def _fill(self) -> None:  # worker thread
        matcher = self._matcher
        if matcher is None:
            raise GrammarFailure("matcher missing")
        started = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        counters = self._owner.counters
        counters.mask_seconds += time.perf_counter() - started
        counters.num_masks += 1
        if matcher.is_error():
            raise GrammarFailure(matcher.get_error())

    def mask(self) -> np.ndarray | None:
        """The allowed-token bitmask for the next sample, or None once the row failed."""
        if self.error is not None:
            return None
        if not self._future.done():
            started = time.perf_counter()
            self._future.exception()
            self._owner.counters.wait_seconds += time.perf_counter() - started
        exc = self._future.exception()
        if exc is not None:
            self.error = f"response_format cannot be followed: {exc}"
            log.warning("%s", self.error)
            return None
        return self._bits

    def check_proposal(self, proposal: Sequence[int]) -> tuple[int, list[np.ndarray]]:
        """Speculation: how many leading tokens of `proposal` the grammar accepts, and the
        masks for the positions after each of them (computed here, on the caller's
        thread, once `mask()` has returned; the matcher is rolled back afterwards)."""
        matcher = self._matcher
        if self.error is not None or matcher is None or self.stopped or not proposal:
            return 0, []
        num = int(matcher.validate_tokens(list(proposal)))
        masks: list[np.ndarray] = []
        for token in proposal[:num]:
            if not matcher.consume_token(token) or matcher.is_stopped():
                matcher.rollback(len(masks) + 1)
                return len(masks), masks  # cut before a token that ends or breaks it
            bits = np.zeros_like(self._bits)
            matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
            masks.append(bits)
        matcher.rollback(num)
        return num, masks

    def advance_many(self, tokens: Sequence[int]) -> None:
        """Consume several tokens (a verify step's output), then compute the next mask."""
        for token in tokens[:-1]:
            matcher = self._matcher
            if self.error is not None or matcher is None or self.stopped:
                return
            if not matcher.consume_token(token) or matcher.is_error():
                self.error = f"response_format matcher refused token {token}: " \
                             f"{matcher.get_error()}"
                log.error("%s", self.error)
                return
            if matcher.is_stopped():
                self.stopped = True
                return
        self.advance(tokens[-1])

    def advance(self, token: int) -> None:
        """Consume the row's sampled token; then the worker computes the next mask."""
        matcher = self._matcher
        if self.error is not None or matcher is None:
            return
        started = time.perf_counter()
        ok = matcher.consume_token(token)
        self._owner.counters.consume_seconds += time.perf_counter() - started
        if not ok:  # the mask forbade it: our bug, said loudly
            self.error = f"response_format matcher refused token {token}: {matcher.get_error()}"
            log.error("%s", self.error)
            return
        if matcher.is_error():  # e.g. the grammar outgrew llguidance's parser limits
            self.error = f"response_format cannot be followed: {matcher.get_error()}"
            log.warning("%s", self.error)
            return
        if matcher.is_stopped():
            self.stopped = True
            return
        self._future = self._owner.submit(self._fill)
