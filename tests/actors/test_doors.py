"""The engine facade's doors into actor state, all of them (issue 21).

The actors talk only through their mailboxes (tests/actors/test_graph.py checks that the
drawn mailboxes are the ones built and that only the drawn messages cross them). The
facade (`Engine` in actors/facade.py) also holds a few actors' books: every attribute it
reads or calls on them is listed here with the reason it is not a message. A new door
fails this test until it is listed (and so argued for); a door that went away must be
struck off. The goal of issue 21 is a facade that only sends and reads one statistics
snapshot; DOORS is what stands between today's code and that goal.
"""

import ast
from pathlib import Path

import tqserve.actors.facade as facade_module

# The facade's fields that are actors' state, and the actor that owns each.
STATE = {"_hub": "hub", "_control": "admission", "_books": "cache_owner",
         "_core": "scheduler", "prefix": "scheduler (prefix cache)",
         "_speculation": "speculation"}

DOORS = {
    ("_hub", "open_stream"): "a stream's channel is a trio object, not a msgpack message",
    ("_hub", "close_stream"): "called from a dropped iterator's __del__: no await there",
    ("_hub", "overflowed"): "why the hub cut a stream, read when its channel ended",
    ("_control", "full"): "the O(1) overload gate before tokenizing (issue 20)",
    ("_control", "room"): "the acceptor process's O(1) gate: the queue's free slots",
    ("_control", "dequeue_listeners"): "metrics time queue waits on the engine's thread",
    ("_control", "stop_admitting"): "shutdown refuses new requests at once",
    ("_books", "idle"): "wait_idle: no row leased, no KV resident",
    ("_books", "changed"): "wait_idle's wake-up",
    ("_core", "check_speculative"): "validation needs the proposers the core was built with",
    ("_core", "check_kv_alone"): "validation: a request larger than the KV budget alone",
    ("_core", "kv_budget_bytes"): "statistics",
    ("_core", "kv_charge"): "statistics",
    ("_hub", "statistics"): "statistics",
    ("_control", "statistics"): "statistics",
    ("_books", "statistics"): "statistics",
    ("_core", "statistics"): "statistics",
    ("prefix", "statistics"): "statistics",
    ("prefix", "index"): "kv_events: a pure read of the index's KV event log (issue 26)",
    ("_speculation", "statistics"): "statistics",
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
