"""The replay driver: sends trace requests to a target and times every event.

Open loop (`concurrency=None`): request i is sent at arrival_s * time_scale after the
start, whatever is still running. Closed loop: `concurrency` workers each send the next
request as soon as their previous one ends (arrival times ignored). `restart_at=N`: once
N requests are sent, wait for every one in flight to end, restart the target (same cache
dir), then go on; open-loop times resume from there (the restart's own time is not part
of any request's latency). Times are seconds since the run began (trio's clock).

`RunBooks` keeps what a run has measured as it goes (ended requests, and the tokens so far
of those in flight), so that a run cancelled by a signal or --timeout still reports: the
cut-off requests become `interrupted` results, the unsent ones are counted.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs
import numpy as np
import trio

from tqserve.tools.replay.metrics import INTERRUPTED, RequestResult
from tqserve.tools.replay.targets import request_fields
from tqserve.tools.replay.traces import FIRST_TOKEN, TraceRequest
from tqserve.client import ClientError, DoneEvent, ErrorEvent, TokenEvent

PROBE_REQUESTS = 4        # concurrent requests of the capacity probe
PROBE_PROMPT = 128        # prompt tokens of each probe request
PROBE_OUTPUT = 32         # output tokens of each probe request


@attrs.define
class _Live:
    req: TraceRequest
    send_s: float
    times: list[float] = attrs.Factory(list)
    tokens: list[int] = attrs.Factory(list)


@attrs.define
class RunBooks:
    """A run's results so far and its requests in flight (see the module docstring)."""

    results: list[RequestResult] = attrs.Factory(list)
    live: dict[int, _Live] = attrs.Factory(dict)

    def cut_off(self, now: float, why: str) -> list[RequestResult]:
        """The requests in flight as `interrupted` results, with the tokens they had."""
        return [RequestResult(index=i, send_s=x.send_s, prompt_tokens=len(x.req.prompt_tokens),
                              token_times=tuple(x.times), output_tokens=tuple(x.tokens),
                              error=INTERRUPTED, end_s=now,
                              error_message=f"the replay was interrupted ({why}) before "
                                            "this request ended")
                for i, x in sorted(self.live.items())]


async def _one(target: Any, req: TraceRequest, rid: str, t0: float,
               books: RunBooks) -> RequestResult:
    live = books.live[req.index] = _Live(req=req, send_s=trio.current_time() - t0)
    send, times, tokens = live.send_s, live.times, live.tokens
    message = None
    try:
        async for ev in target.generate(req, rid):
            now = trio.current_time() - t0
            if isinstance(ev, TokenEvent):
                times.append(now)
                tokens.append(ev.token_id)
            elif isinstance(ev, DoneEvent):
                tier = next((k for k, v in ev.cached_tokens_by_tier.items() if v), None)
                return RequestResult(  # prompt tokens as the server counted them
                    index=req.index, send_s=send, prompt_tokens=ev.prompt_tokens,
                    token_times=tuple(times), done_s=now,
                    completion_tokens=ev.completion_tokens, cached_tokens=ev.cached_tokens,
                    cached_tier=tier, output_tokens=tuple(tokens),
                    finish_reason=ev.finish_reason, speculative=ev.speculative)
            elif isinstance(ev, ErrorEvent):
                return RequestResult(index=req.index, send_s=send,
                                     prompt_tokens=len(req.prompt_tokens),
                                     token_times=tuple(times), error=ev.code,
                                     error_message=ev.message, end_s=now,
                                     output_tokens=tuple(tokens))
        error = "no_done"
        message = "the stream ended without a done or error frame"
    except ClientError as exc:
        error, message = type(exc).__name__, str(exc)
    return RequestResult(index=req.index, send_s=send, prompt_tokens=len(req.prompt_tokens),
                         token_times=tuple(times), error=error, error_message=message,
                         end_s=trio.current_time() - t0, output_tokens=tuple(tokens))


async def _phase(target: Any, reqs: Sequence[TraceRequest], t0: float, offset: float,
                 time_scale: float, concurrency: int | None, tag: str,
                 on_done: Callable[[RequestResult], None], books: RunBooks) -> None:
    async def send(req: TraceRequest) -> None:
        result = await _one(target, req, f"{tag}{req.index}", t0, books)
        del books.live[req.index]
        on_done(result)

    async with trio.open_nursery() as nursery:
        if concurrency is None:
            base = reqs[0].arrival_s if reqs else 0.0
            for req in reqs:
                await trio.sleep_until(t0 + offset + (req.arrival_s - base) * time_scale)
                nursery.start_soon(send, req)
        else:
            queue = iter(reqs)

            async def worker() -> None:
                for req in queue:
                    await send(req)

            for _ in range(concurrency):
                nursery.start_soon(worker)


async def replay(target: Any, reqs: Sequence[TraceRequest], *, time_scale: float = 1.0,
                 concurrency: int | None = None, restart_at: int | None = None,
                 tag: str = "r", on_done: Callable[[RequestResult], None] | None = None,
                 books: RunBooks | None = None, t0: float | None = None
                 ) -> list[RequestResult]:
    """Replay `reqs` (sorted by arrival) on `target`; results in trace order. `books`
    (a fresh RunBooks by default) sees every result as it ends; `t0` is the run's start
    (trio's clock; default now)."""
    books = RunBooks() if books is None else books

    def done(r: RequestResult) -> None:
        books.results.append(r)
        if on_done is not None:
            on_done(r)

    t0 = trio.current_time() if t0 is None else t0
    cut = len(reqs) if restart_at is None else max(0, min(restart_at, len(reqs)))
    await _phase(target, reqs[:cut], t0, 0.0, time_scale, concurrency, tag, done, books)
    if cut < len(reqs):
        await target.restart()
        offset = trio.current_time() - t0
        await _phase(target, reqs[cut:], t0, offset, time_scale, concurrency, tag, done,
                     books)
    return sorted(books.results, key=lambda r: r.index)


async def measure_capacity(target: Any, vocab_size: int) -> float:
    """Tokens/s (prompt + output) the target sustains on a small concurrent burst: a quick
    estimate, not a benchmark (a full batch is usually faster)."""
    rng = np.random.default_rng(0x9E3779B9)
    probes = [TraceRequest(index=i, arrival_s=0.0, family=f"probe{i}",
                           prompt_tokens=tuple(int(t) for t in rng.integers(
                               FIRST_TOKEN, vocab_size, PROBE_PROMPT)),
                           max_tokens=PROBE_OUTPUT, implied_input_tokens=PROBE_PROMPT,
                           params={"temperature": 0.0})
              for i in range(PROBE_REQUESTS)]
    t0 = trio.current_time()
    results = await replay(target, probes, concurrency=PROBE_REQUESTS, tag="probe")
    elapsed = max(trio.current_time() - t0, 1e-9)
    tokens = sum(r.prompt_tokens + r.completion_tokens for r in results if r.ok)
    return tokens / elapsed


def expected_fields(req: TraceRequest) -> dict[str, Any]:
    """What a reproduction needs to resend the request: its generate fields."""
    return {"prompt_tokens": list(req.prompt_tokens), **request_fields(req)}
