"""The engine facade's doors into actor state, all of them (issue 21).

The actors talk only through their mailboxes (tests/actors/test_graph.py checks that the
drawn mailboxes are the ones built and that only the drawn messages cross them). The
facade (`Engine` in actors/facade.py) only sends into admission's mailbox and reads the
board, the one statistics snapshot the actors post to (actors.board); the hub's stream
hand-over is the one door into an actor, since a trio channel is not a message. Every
attribute the facade reads or calls on either is listed here with its reason: a new door
fails this test until it is listed (and so argued for); a door that went away must be
struck off.
"""

import ast
from pathlib import Path

import tqserve.actors.facade as facade_module

# The facade's fields that are actors' state (or the board they post to), and whose.
STATE = {"_hub": "hub", "_board": "the board (every actor posts its statistics there)"}

DOORS = {
    ("_hub", "open_stream"): "a stream's channel is a trio object, not a msgpack message",
    ("_hub", "close_stream"): "called from a dropped iterator's __del__: no await there",
    ("_hub", "overflowed"): "why the hub cut a stream, read when its channel ended",
    ("_board", "snapshot"): "the one statistics snapshot (statistics, the overload gate)",
    ("_board", "wait_until"): "wait_idle: wakes when a post makes the ledger idle",
    ("_board", "kv_events"): "the prefix cache's append-only KV event log, read by page",
}


def _doors() -> set[tuple[str, str]]:
    tree = ast.parse(Path(facade_module.__file__).read_text())
    facade = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    found = set()
    for node in ast.walk(facade):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"
                and node.value.attr in STATE):
            found.add((node.value.attr, node.attr))
    return found


def test_every_door_into_actor_state_is_listed_with_its_reason():
    found = _doors()
    assert found - DOORS.keys() == set(), "unlisted doors into actor state"
    assert DOORS.keys() - found == set(), "listed doors that no longer exist: strike them"


def test_nothing_outside_the_facade_reaches_actor_state():
    """api/, tools/ and tqserve/ read the facade's own fields, never its actors' books."""
    root = Path(facade_module.__file__).resolve().parents[1]
    private = [name for name in STATE if name.startswith("_")] + ["prefix"]
    offenders = []
    for folder in ("api", "tools", "tqserve"):
        for path in (root / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Attribute) and node.attr in private
                        and isinstance(node.value, ast.Name) and node.value.id == "engine"):
                    offenders.append(f"{path.relative_to(root)}:{node.lineno} engine.{node.attr}")
    assert offenders == []
