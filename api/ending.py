"""How a run ended, for the HTTP APIs: complete, or cut short (and how).

An output is complete only when the engine's `Done` says "stop" (end-of-text token, a
stop token id, a stop string, the grammar's end) or "length" (max_tokens). Every other
end is a cut: the server's shutdown at --shutdown-timeout (Done "shutdown"), a cancel
(Done "cancelled"), or an `Error` after the request was queued (a slow consumer cut
off, an internal error, a grammar failing mid-way, the engine closing). `complete` raises
for a cut the `ApiError` that says so: a non-streamed answer raises it (its HTTP status),
a stream sends it as its API's error event in place of the final chunk, so the official
clients raise instead of handing over a truncated text as a finished one.
docs/http-apis.md has the table.
"""

from __future__ import annotations

from tqserve.actors.messages import Done
from tqserve.api.httpcommon import ApiError, Outcome

COMPLETE = ("stop", "length")  # the engine finish reasons of a complete output
# Done.finish_reason of a cut -> HTTP status, what happened
_CUTS = {"shutdown": (503, "the server shut down before the output was complete"),
         "cancelled": (500, "the request was cancelled before the output was complete")}


def complete(outcome: Outcome) -> Done:
    """The Done of a run whose output is complete; an ApiError saying how it was cut
    short otherwise (`code`: the engine's finish reason or error code)."""
    if outcome.error is not None:
        raise ApiError.from_event(outcome.error)
    done = outcome.done
    if done is None:  # the events ended without an end: the engine went away
        raise ApiError(503, "engine shut down", code="engine_closed")
    if done.finish_reason in COMPLETE:
        return done
    status, what = _CUTS.get(done.finish_reason,
                             (500, f"generation ended with {done.finish_reason!r}"))
    raise ApiError(status, f"{what} ({done.completion_tokens} tokens generated)",
                   code=done.finish_reason)
