"""The replay driver: sends trace requests to a target and times every event.

Open loop (`concurrency=None`): request i is sent at arrival_s * time_scale after the
start, whatever is still running. Closed loop: `concurrency` workers each send the next
request as soon as their previous one ends (arrival times ignored). `restart_at=N`: once
N requests are sent, wait for every one in flight to end, restart the target (same cache
dir), then go on; open-loop times resume from there (the restart's own time is not part
of any request's latency). Times are seconds since the run began (trio's clock).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np
import trio

from tqserve.tools.replay.metrics import RequestResult
from tqserve.tools.replay.targets import request_fields
from tqserve.tools.replay.traces import FIRST_TOKEN, TraceRequest
from tqserve.client import ClientError, DoneEvent, ErrorEvent, TokenEvent

PROBE_REQUESTS = 4        # concurrent requests of the capacity probe
PROBE_PROMPT = 128        # prompt tokens of each probe request
PROBE_OUTPUT = 32         # output tokens of each probe request


async def _one(target: Any, req: TraceRequest, rid: str, t0: float) -> RequestResult:
    send = trio.current_time() - t0
    times: list[float] = []
    tokens: list[int] = []
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
                    finish_reason=ev.finish_reason)
            elif isinstance(ev, ErrorEvent):
                return RequestResult(index=req.index, send_s=send,
                                     prompt_tokens=len(req.prompt_tokens),
                                     token_times=tuple(times), error=ev.code,
                                     output_tokens=tuple(tokens))
        error = "no_done"
    except ClientError as exc:
        error = type(exc).__name__
    return RequestResult(index=req.index, send_s=send, prompt_tokens=len(req.prompt_tokens),
                         token_times=tuple(times), error=error, output_tokens=tuple(tokens))


async def _phase(target: Any, reqs: Sequence[TraceRequest], t0: float, offset: float,
                 time_scale: float, concurrency: int | None, tag: str,
                 on_done: Callable[[RequestResult], None]) -> None:
    async def send(req: TraceRequest) -> None:
        on_done(await _one(target, req, f"{tag}{req.index}", t0))

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
                 tag: str = "r", on_done: Callable[[RequestResult], None] | None = None
                 ) -> list[RequestResult]:
    """Replay `reqs` (sorted by arrival) on `target`; results in trace order."""
    results: list[RequestResult] = []

    def done(r: RequestResult) -> None:
        results.append(r)
        if on_done is not None:
            on_done(r)

    t0 = trio.current_time()
    cut = len(reqs) if restart_at is None else max(0, min(restart_at, len(reqs)))
    await _phase(target, reqs[:cut], t0, 0.0, time_scale, concurrency, tag, done)
    if cut < len(reqs):
        await target.restart()
        offset = trio.current_time() - t0
        await _phase(target, reqs[cut:], t0, offset, time_scale, concurrency, tag, done)
    return sorted(results, key=lambda r: r.index)


def offered_load(reqs: Sequence[TraceRequest], time_scale: float) -> dict[str, float]:
    """Tokens per second the trace asks for at this time scale (prompt + max output)."""
    span = (reqs[-1].arrival_s - reqs[0].arrival_s) * time_scale if reqs else 0.0
    tokens = sum(len(r.prompt_tokens) + r.max_tokens for r in reqs)
    return {"span_s": span, "tokens": tokens,
            "tokens_per_s": tokens / span if span > 0 else math.inf}


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
