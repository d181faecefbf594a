"""api.protocol without a server: decode_frame, parse_command, encode_frame."""

from __future__ import annotations

import json
from contextlib import contextmanager

import msgpack
import pytest

from tqserve.actors.messages import Done, Error, Queued, Token
from tqserve.api.protocol import (CancelCommand, GenerateCommand, ProtocolError, decode_frame,
                                  encode_frame, parse_command)
from tqserve.engine.sampling import SamplingParams
from tqserve.ids import MAX_ID_LENGTH

LIMIT = 1 << 20
DEFAULT_MAX_TOKENS = 7


@contextmanager
def refused(code: str, *needles: str):
    """Expect a ProtocolError with `code` whose message holds every needle."""
    with pytest.raises(ProtocolError) as info:
        yield info
    assert info.value.code == code, (info.value.code, info.value.message)
    assert all(n in info.value.message for n in needles), info.value.message


def gen(**fields):
    return {"type": "generate", "id": "r", "prompt": "x", **fields}


# decode_frame

def test_decode_json_and_msgpack():
    obj = {"type": "generate", "id": "r", "prompt": "é", "stop": ["\n"]}
    assert decode_frame(json.dumps(obj, ensure_ascii=False), LIMIT) == obj
    assert decode_frame(msgpack.packb(obj), LIMIT) == obj


def test_size_limit_is_in_bytes():
    text = json.dumps(gen(prompt="a" * 100))
    assert decode_frame(text, len(text)) == json.loads(text)  # exactly at the limit
    with refused("message_too_large", str(len(text) + 1), str(len(text))):
        decode_frame(text + " ", len(text))
    data = msgpack.packb(gen(prompt="a" * 100))
    with refused("message_too_large"):
        decode_frame(data, len(data) - 1)
    wide = json.dumps(gen(prompt="\u00e9" * 100), ensure_ascii=False)
    n_bytes = len(wide.encode("utf-8"))
    assert len(wide) < n_bytes
    with refused("message_too_large", str(n_bytes)):
        decode_frame(wide, len(wide))


@pytest.mark.parametrize("data, kind", [
    ('{"type": ', "JSON"), ("", "JSON"), ("[" * 100_000, "JSON"),
    ("[" * 100_000 + "]" * 100_000, "JSON"),
    ('{"id": "\\ud800"}', "JSON"), ('{"\\udfff": 1}', "JSON"),
    (b"\xc1", "msgpack"), (b"\x92\x01", "msgpack"), (b"\x80\x80", "msgpack"),
    (b"", "msgpack"), (b"\xa2\xff\xfe", "msgpack"), (b"\x81\x91\x01\x02", "msgpack"),
    (b"\x81\x80\x01", "msgpack"), (b"\x91" * 100_000 + b"\x90", "msgpack"),
])
def test_undecodable_frames(data, kind):
    with refused("bad_frame", kind):
        decode_frame(data, LIMIT)


def test_paired_surrogate_escapes_are_fine():
    assert decode_frame('{"prompt": "\\ud83d\\ude00"}', LIMIT) == {"prompt": "\U0001F600"}


@pytest.mark.parametrize("data", ["[1]", '"x"', "3", "null", "true", msgpack.packb([1]),
                                  msgpack.packb("x"), msgpack.packb(None)])
def test_frames_that_are_not_objects(data):
    with refused("bad_frame", "object"):
        decode_frame(data, LIMIT)


# parse_command: accepted

def test_generate_defaults_and_fields():
    command = parse_command(gen(), DEFAULT_MAX_TOKENS)
    assert isinstance(command, GenerateCommand) and command.request_id == "r"
    assert command.request.prompt == "x"
    assert command.request.params == SamplingParams(max_tokens=DEFAULT_MAX_TOKENS)
    full = gen(max_tokens=5, temperature=0.5, top_p=0.9, top_k=4, min_p=0.1,
               repetition_penalty=1.2, seed=3, logprobs=True, top_logprobs=2, stop=["\n"],
               stop_token_ids=[0])
    params = parse_command(full, DEFAULT_MAX_TOKENS).request.params
    assert params == SamplingParams(max_tokens=5, temperature=0.5, top_p=0.9, top_k=4,
                                    min_p=0.1, repetition_penalty=1.2, seed=3, logprobs=True,
                                    top_logprobs=2, stop=("\n",), stop_token_ids=(0,))


def test_null_fields_take_their_defaults():
    command = parse_command(gen(temperature=None, seed=None, stop=None, messages=None),
                            DEFAULT_MAX_TOKENS)
    assert command.request.params == SamplingParams(max_tokens=DEFAULT_MAX_TOKENS)


def test_prompt_forms():
    tokens = parse_command({"type": "generate", "id": "t", "prompt_tokens": [1, 2]}, 1)
    assert tokens.request.prompt_tokens == (1, 2) and tokens.request.prompt is None
    chat = [{"role": "user", "content": "hi"}]
    messages = parse_command({"type": "generate", "id": "m", "messages": chat}, 1)
    assert messages.request.messages == tuple(chat)


def test_cancel():
    assert parse_command({"type": "cancel", "id": "r"}, 1) == CancelCommand(request_id="r")


def test_id_length_bound():
    assert parse_command(gen(id="x" * MAX_ID_LENGTH), 1).request_id == "x" * MAX_ID_LENGTH
    with refused("invalid_request", "id", str(MAX_ID_LENGTH)):
        parse_command(gen(id="x" * (MAX_ID_LENGTH + 1)), 1)


# parse_command: refused

@pytest.mark.parametrize("obj, needle", [
    ({"id": "r"}, "None"), ({"type": "fly", "id": "r"}, "'fly'"),
    ({"type": None, "id": "r"}, "None"), ({"type": ["generate"], "id": "r"}, "type"),
])
def test_unknown_type(obj, needle):
    with refused("unknown_type", "type", needle) as info:
        parse_command(obj, 1)
    assert info.value.request_id == "r"


def test_unknown_type_with_a_bad_id_names_no_request():
    with refused("unknown_type") as info:
        parse_command({"type": "x", "id": 5}, 1)
    assert info.value.request_id is None


@pytest.mark.parametrize("obj", [
    gen(id=None), {"type": "generate", "prompt": "x"}, gen(id=5), gen(id=""), gen(id=["r"]),
    {"type": "cancel"}, {"type": "cancel", "id": 1},
])
def test_bad_id(obj):
    with refused("invalid_request", "id") as info:
        parse_command(obj, 1)
    assert info.value.request_id is None


@pytest.mark.parametrize("obj, needle", [
    (gen(temprature=1), "'temprature'"), (gen(**{"1": 2}), "'1'"),
    ({**gen(), 1: 2, "zz": 3}, "unknown field"),
    ({"type": "cancel", "id": "r", "force": True}, "'force'"),
    ({"type": "cancel", "id": "r", 1: 2, "zz": 3}, "unknown field"),
])
def test_unknown_fields(obj, needle):
    with refused("invalid_request", needle) as info:
        parse_command(obj, 1)
    assert info.value.request_id == "r"


@pytest.mark.parametrize("field, value", [
    ("temperature", "hot"), ("temperature", -0.5), ("temperature", float("nan")),
    ("temperature", 101), ("max_tokens", 1.5), ("max_tokens", 0), ("max_tokens", True),
    ("max_tokens", 2**64), ("top_k", -1), ("top_p", 0), ("top_p", 1.5),
    ("top_p", float("nan")), ("min_p", 2), ("min_p", -0.1), ("repetition_penalty", 0),
    ("seed", -1), ("seed", "x"), ("seed", 2**63), ("seed", True), ("logprobs", "yes"),
    ("logprobs", 1), ("top_logprobs", 21), ("top_logprobs", -1), ("stop", "abc"),
    ("stop", [1]), ("stop", [""]), ("stop", ["s"] * 17), ("stop_token_ids", [-1]),
    ("stop_token_ids", "5"), ("stop_token_ids", [True]), ("prompt", 5), ("prompt", ""),
    ("prompt", b"x"), ("prompt_tokens", "1 2"), ("messages", "hi"),
])
def test_bad_field(field, value):
    with refused("invalid_request", field) as info:
        parse_command(gen(**{field: value}), 1)
    assert info.value.request_id == "r"


@pytest.mark.parametrize("fields, needle", [
    (dict(prompt_tokens=[1]), "prompt_tokens"), (dict(prompt=None), "messages"),
    (dict(prompt=None, prompt_tokens=[]), "prompt_tokens"),
    (dict(prompt=None, prompt_tokens=[1, -2]), "prompt_tokens"),
    (dict(prompt=None, prompt_tokens=[1.0]), "prompt_tokens"),
    (dict(prompt=None, messages=[]), "messages"),
    (dict(prompt=None, messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    (dict(prompt=None, messages=[{"role": "user"}]), "messages[0].content"),
    (dict(prompt=None, messages=[{"role": "user", "content": "x", "extra": 1}]), "messages[0]"),
    (dict(prompt=None, messages=["hi"]), "messages[0]"),
])
def test_bad_prompt(fields, needle):
    with refused("invalid_request", needle):
        parse_command(gen(**fields), 1)


# encode_frame

EVENTS = [
    Queued(request_id="r"),
    Token(request_id="r", index=0, token_id=9, text="é\n", logprob=-0.1234567890123,
          top_logprobs=((9, -0.1234567890123), (3, -2.5))),
    Token(request_id="r", index=1, token_id=0, text=""),
    Done(request_id="r", finish_reason="stop", prompt_tokens=3, completion_tokens=2),
    Error(request_id=None, code="bad_frame", message="nope"),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
def test_encode_frame_round_trip(event, binary):
    wire = event.to_wire()
    frame = encode_frame(wire, binary)
    assert isinstance(frame, bytes if binary else str)
    assert decode_frame(frame, LIMIT) == wire
    raw = msgpack.unpackb(frame) if binary else json.loads(frame)
    assert raw == wire


def test_json_frames_keep_unicode_unescaped():
    assert "é" in encode_frame(EVENTS[1].to_wire(), binary=False)
