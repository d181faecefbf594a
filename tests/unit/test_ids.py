"""One request id rule at every door: the server's WebSocket protocol and the router's
front refuse the same ids with the same message (the embedded API: tests/actors)."""

import json

import pytest

from tqserve.api.protocol import ProtocolError, parse_command
from tqserve.api.router.ws import FrameError, decode
from tqserve.ids import MAX_ID_LENGTH, id_problem

BAD = ["", "x" * (MAX_ID_LENGTH + 1), "tab\there", "new\nline", "a\u2028b", "nul\x00", 7, None]
GOOD = ["r1", "x" * MAX_ID_LENGTH, "é-λ-日本", "with space", "r" * 64 + "é" * 64]


@pytest.mark.parametrize("rid", BAD)
def test_a_bad_id_is_refused_alike_by_the_server_and_the_router(rid):
    problem = id_problem(rid)
    assert problem is not None and problem.startswith("id must")
    frame = {"type": "generate", "id": rid, "prompt": "x"}
    with pytest.raises(ProtocolError) as server:
        parse_command(frame, 1)
    with pytest.raises(FrameError) as router:
        decode(json.dumps(frame), 1 << 20)
    assert server.value.code == router.value.code == "invalid_request"
    assert str(server.value.message) == str(router.value.message) == problem


@pytest.mark.parametrize("rid", GOOD)
def test_a_good_id_passes_both(rid):
    assert id_problem(rid) is None
    frame = {"type": "generate", "id": rid, "prompt": "x"}
    assert parse_command(frame, 1).request_id == rid
    assert decode(json.dumps(frame), 1 << 20)["id"] == rid
