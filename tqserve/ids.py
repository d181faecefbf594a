"""The request id rule, one for every door: the WebSocket protocol (api/protocol.py), the
router's WebSocket front (api/router/ws.py) and the embedded API (`Engine.generate`).

A client's request id is a label: a non-empty string of printable characters, at most
`MAX_ID_LENGTH` of them. The engine runs each request under an internal id of its own
and puts the label back on the events at the edge. No MLX here: the router imports it.
"""

from __future__ import annotations

MAX_ID_LENGTH = 128


def id_problem(rid: object) -> str | None:
    """What is wrong with `rid` as a request id (a sentence naming the rule), or None."""
    if not isinstance(rid, str) or not rid:
        return "id must be a non-empty string"
    if len(rid) > MAX_ID_LENGTH:
        return f"id must be at most {MAX_ID_LENGTH} characters"
    if not rid.isprintable():
        return "id must be printable text (no control or separator characters)"
    return None
