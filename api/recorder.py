"""`tqserve serve --record FILE`: every admitted request and its output, off the step path.

The engine's mailbox hook (`open_engine(recorder=...)`) is a plain function called where a
message is sent. It only puts (time, mailbox, bytes) on a bounded channel
(RECORD_QUEUE) with `send_nowait`; a writer task decodes the messages, assembles one record
per request (Submit -> Queued -> Token... -> Done) and writes it to the file from a worker
thread. Serving never waits for the recorder: when the channel is full the message is
dropped, and every request in flight at that moment is left out of the recording (they are
counted, and logged when the recording closes). Requests refused by admission or ending in
an error are not recorded; cancelled ones are, with finish_reason "cancelled".
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import attrs
import trio

from tqserve.actors.messages import Done, Error, Queued, StepTokens, Submit, Token, decode
from tqserve.storage.recording import RecordingWriter

log = logging.getLogger("tqserve.record")
RECORD_QUEUE = 8192  # mailbox messages (a token each, mostly) the writer may lag behind
_MAILBOXES = frozenset(("admission", "hub"))  # Submit in; Queued/Token/Done/Error out


@attrs.define
class _Pending:
    arrival_s: float
    submit: Submit
    epoch: int  # drops counted when its Submit was queued
    admitted: bool = False
    tokens: list[int] = attrs.Factory(list)


@attrs.frozen(kw_only=True)
class RecorderStatistics:
    num_recorded: int
    num_dropped_messages: int
    num_incomplete: int  # requests left out because a message of theirs was dropped


class _Recorder:
    def __init__(self, send: trio.MemorySendChannel[tuple[float, str, bytes, int]]) -> None:
        self._send = send
        self._t0 = trio.current_time()
        self.num_dropped = 0

    def __call__(self, mailbox: str, data: bytes) -> None:
        if mailbox not in _MAILBOXES:
            return
        try:
            self._send.send_nowait((trio.current_time() - self._t0, mailbox, data,
                                    self.num_dropped))
        except trio.WouldBlock:
            self.num_dropped += 1
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass


async def _write_records(receive: trio.MemoryReceiveChannel[tuple[float, str, bytes, int]],
                         writer: RecordingWriter, stats: dict[str, int]) -> None:
    # Shielded: a cancelled server still writes every request that finished (the loop ends
    # when open_recorder closes the send end, after at most RECORD_QUEUE queued messages).
    with trio.CancelScope(shield=True):
        await _write_all(receive, writer, stats)


async def _write_all(receive: trio.MemoryReceiveChannel[tuple[float, str, bytes, int]],
                     writer: RecordingWriter, stats: dict[str, int]) -> None:
    pending: dict[str, _Pending] = {}
    epoch = 0
    async for t, _, data, drops in receive:
        if drops != epoch:  # messages were dropped just before this one: whatever was in
            epoch = drops   # flight then may miss one, so it is left out
            torn = [rid for rid, p in pending.items() if p.epoch < epoch]
            stats["incomplete"] += len(torn)
            for rid in torn:
                del pending[rid]
        msg = decode(data)
        match msg:
            case Submit():
                pending[msg.request_id] = _Pending(arrival_s=t, submit=msg, epoch=epoch)
            case Queued() if msg.request_id in pending:
                pending[msg.request_id].admitted = True
            case Token() if msg.request_id in pending:
                pending[msg.request_id].tokens.append(msg.token_id)
            case StepTokens():
                for row in msg.rows:
                    if row.request_id in pending:
                        pending[row.request_id].tokens += row.token_ids
            case Error():
                pending.pop(msg.request_id or "", None)
            case Done() if msg.request_id in pending:
                p = pending.pop(msg.request_id)
                del p.tokens[msg.completion_tokens:]  # tokens sampled past a stop string
                if p.admitted:
                    record = {"request_id": msg.request_id, "arrival_s": p.arrival_s,
                              "prompt_tokens": list(p.submit.prompt_tokens),
                              "params": _params(p.submit), "output_tokens": p.tokens,
                              "finish_reason": msg.finish_reason,
                              "cached_tokens": msg.cached_tokens}
                    await trio.to_thread.run_sync(writer.write, record)


def _params(submit: Submit) -> dict[str, Any]:
    params = attrs.asdict(submit.params)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}


@asynccontextmanager
async def open_recorder(path: str | Path, header: dict[str, Any]
                        ) -> AsyncIterator[tuple[Callable[[str, bytes], None],
                                                 Callable[[], RecorderStatistics]]]:
    """(hook for open_engine(recorder=...), statistics) while the block runs; the file is
    complete (every finished request written) when the block exits."""
    writer = await trio.to_thread.run_sync(RecordingWriter, path, header)
    send, receive = trio.open_memory_channel[tuple[float, str, bytes, int]](RECORD_QUEUE)
    recorder = _Recorder(send)
    stats = {"incomplete": 0}

    def statistics() -> RecorderStatistics:
        return RecorderStatistics(num_recorded=writer.num_records,
                                  num_dropped_messages=recorder.num_dropped,
                                  num_incomplete=stats["incomplete"])

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_write_records, receive, writer, stats)
            try:
                yield recorder, statistics
            finally:
                send.close()  # the writer drains what is queued, then ends
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(writer.close)
        s = statistics()
        log.warning("recording %s: %d requests recorded, %d messages dropped (queue full), "
                    "%d requests left out", path, s.num_recorded, s.num_dropped_messages,
                    s.num_incomplete)
