"""The router's SSE hold-back rule (api.router.http): which events carry no token yet."""

import pytest

from tqserve.api.router.http import BadBackendAnswer, _Sse, is_preamble


def test_preamble_events_are_held_and_token_events_release():
    role = b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n'
    token = b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n'
    completion = b'data: {"choices": [{"text": "x"}]}\n\n'
    assert is_preamble(role) and not is_preamble(token) and not is_preamble(completion)
    for name in (b"message_start", b"content_block_start", b"ping"):
        assert is_preamble(b"event: " + name + b'\ndata: {"type": "x"}\n\n')
    assert not is_preamble(b'event: content_block_delta\ndata: {"type": "x"}\n\n')
    assert not is_preamble(b"data: [DONE]\n\n")
    assert not is_preamble(b'data: {"error": {"code": "overloaded"}}\n\n')


def test_events_are_split_whole_across_chunks():
    sse = _Sse(1 << 20)
    assert sse.feed(b"data: 1\n") == []
    assert sse.feed(b"\ndata: 2\n\nda") == [b"data: 1\n\n", b"data: 2\n\n"]
    assert sse.feed(b"ta: 3\n\n") == [b"data: 3\n\n"]


def test_an_event_with_no_end_past_the_limit_is_refused():
    sse = _Sse(16)
    assert sse.feed(b"data: 1234567890") == []  # 16 bytes held: at the limit
    with pytest.raises(BadBackendAnswer, match="--max-backend-bytes"):
        sse.feed(b"1")
