"""Every message type round-trips through the one msgpack codec."""

import attrs
import msgpack
import pytest

from tqserve.engine.step import TokenOut
from tqserve.actors import messages as m
from tqserve.engine.sampling import SamplingParams
from tqserve.engine.speculative.policy import SpecChoice
from tqserve.engine.structured import validate_response_format

EXAMPLES = [
    m.Submit(request_id="r1", prompt_tokens=(1, 2, 3),
             params=SamplingParams(max_tokens=5, temperature=0.5, top_p=0.9, top_k=4,
                                   min_p=0.1, repetition_penalty=1.2, seed=7, logprobs=True,
                                   top_logprobs=3, stop=("\n\n",), stop_token_ids=(5,))),
    m.Submit(request_id="r2", prompt_tokens=(4,), params=SamplingParams(),
             response_format=validate_response_format({"type": "regex", "pattern": "a|b"})),
    m.Cancel(request_id="r1"),
    m.Cancel(request_id="r1", reason="shutdown"),
    m.Cancel(request_id="r1", reason="stop", num_tokens=4),
    m.Dequeued(request_id="r1", num_prompt_tokens=3),
    m.Lease(request_id="r1", row_id=0),
    m.Release(request_id="r1", row_id=0, reason="stop"),
    m.KvUsage(kv_bytes=1024, num_rows=2),
    m.Queued(request_id="r1"),
    m.Token(request_id="r1", index=0, token_id=9, text="é", logprob=-0.5,
            top_logprobs=((9, -0.5), (3, -1.25))),
    m.Token(request_id="r1", index=1, token_id=9, text=""),
    TokenOut(request_id="r1", index=0, token_ids=(9,)),
    TokenOut(request_id="r1", index=0, token_ids=(9,),
                prompt_logprobs=((4, None, ()), (7, -1.5, ((7, -1.5), (2, -1.75))))),
    m.PromptLogprobs(request_id="r1", token_ids=(4, 7), logprobs=(None, -1.5),
                     top_logprobs=(None, ((7, -1.5), (2, -1.75)))),
    m.PromptLogprobs.of("r1", ((4, None, ()), (7, -0.5, ()))),
    m.StepTokens(rows=(
        TokenOut(request_id="r1", index=3, token_ids=(9, 4, 2), logprobs=(-0.5, -1.0, -0.25),
                    top_logprobs=(((9, -0.5),), ((4, -1.0),), ((2, -0.25),)), final=True,
                    stop_token=True),
        TokenOut(request_id="r2", index=0, token_ids=(7,), logprobs=(-2.0,)))),
    m.StepTokens(rows=()),
    m.Done(request_id="r1", finish_reason="length", prompt_tokens=3, completion_tokens=5,
           cached_tokens=0),
    m.Done(request_id="r1", finish_reason="stop", prompt_tokens=30, completion_tokens=5,
           cached_tokens=24, cached_tier="ssd"),
    m.Error(request_id=None, code="bad_frame", message="nope"),
    m.Submit(request_id="r3", prompt_tokens=(4,), params=SamplingParams(),
             speculative=SpecChoice(method="draft", num_tokens=3)),
    m.Submit(request_id="r4", prompt_tokens=(4,), params=SamplingParams(), speculative=False),
    m.Done(request_id="r1", finish_reason="stop", prompt_tokens=3, completion_tokens=9,
           speculative=(12, 7, 4)),
    m.SpecStep(step=7, opened=(m.SpecOpen(request_id="r1", choice=SpecChoice(method="mtp")),
                               m.SpecOpen(request_id="r2", choice=False),
                               m.SpecOpen(request_id="r3")),
               released=("r0",), verified=(m.RowVerified(request_id="r4", num_proposed=3,
                                                         num_accepted=2),),
               batch=("r1", "r2", "r3", "r4"), decode_seconds=0.0125, speculative=True,
               num_rows=4, num_tokens=6),
    m.SpecStep(step=8),
    m.SpecOpen(request_id="r5", choice=True),
    m.RowVerified(request_id="r5", num_proposed=1, num_accepted=0),
    m.SpecDecision(step=7, proposals=(("r1", 4), ("r2", 0))),
    m.SpecDecision(step=9, new_rows=False),
    m.StopAdmitting(),
    m.Lease(request_id="r1", row_id=3, kv_positions=512),
    m.KvUsage(kv_bytes=1024, num_rows=2, charged_bytes=4096),
    m.Done(request_id="r1", finish_reason="stop", prompt_tokens=3, completion_tokens=9,
           queue_seconds=0.25),
    m.SpillWrite(ram_key="r4", key="ab" * 32, header={"namespace": "ns", "offset": 3,
                                                      "token_ids": [1, 2, 3]},
                 planes=(("keys", b"\x01" * 64, (1, 2, 4, 8), "float16"),), order=2),
    m.SpillWrite(ram_key="p5", key="cd" * 32, header={}, planes=(), sync=True, keep=True),
    m.SpillLoad(key="ab" * 32, temporary="s0", bound=12, state="draft:x"),
    m.SpillLoad(key="r4", temporary="s1", bound=0, pending=True),
    m.SpillRemove(keys=("ab" * 32, "cd" * 32)),
    m.SpillWritten(ram_key="r4", key="ab" * 32, num_bytes=4096),
    m.SpillWritten(ram_key="r4", key="ab" * 32, problem="No space left", disk_error=True,
                   gone=("cd" * 32,)),
    m.SpillWritten(ram_key="r5", key="ef" * 32, problem="rank 1: disk full",
                   live=("ab" * 32,)),
    m.SpillLoaded(key="ab" * 32, temporary="s0", num_bytes=2048),
    m.SpillLoaded(key="ab" * 32, temporary="s0", gone=("ab" * 32,)),
]


def test_every_registered_class_has_an_example():
    covered = {type(e).__name__ for e in EXAMPLES} | {"SamplingParams", "ResponseFormat",
                                                      "SpecChoice"}
    assert covered == set(m._CLASSES)


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda e: type(e).__name__)
def test_round_trip(message):
    data = m.encode(message)
    assert isinstance(data, bytes)
    back = m.decode(data)
    assert back == message
    assert type(back) is type(message)
    assert m.encode(back) == data


def test_wire_forms_are_plain_objects():
    tok = m.Token(request_id="a", index=2, token_id=7, text="x", logprob=-0.1,
                  top_logprobs=((7, -0.1),))
    assert tok.to_wire() == {"type": "token", "id": "a", "index": 2, "token_id": 7, "text": "x",
                             "logprob": -0.1, "top_logprobs": [[7, -0.1]]}
    prompt = m.PromptLogprobs.of("a", ((4, None, ()), (7, -1.5, ((7, -1.5),))))
    assert prompt.to_wire() == {"type": "prompt_logprobs", "id": "a", "token_ids": [4, 7],
                                "logprobs": [None, -1.5], "top_logprobs": [None, [[7, -1.5]]]}
    done = m.Done(request_id="a", finish_reason="stop", prompt_tokens=1, completion_tokens=2)
    assert done.to_wire()["usage"] == {"prompt_tokens": 1, "completion_tokens": 2,
                                       "cached_tokens": 0,
                                       "cached_tokens_by_tier": {"ram": 0, "ssd": 0}}


def test_bad_bytes_raise_codec_error():
    with pytest.raises(m.CodecError):
        m.decode(b"\xc1")
    with pytest.raises(m.CodecError, match="unknown message tag"):
        m.decode(msgpack.packb({"t": "Nope"}))
    with pytest.raises(m.CodecError):
        m.decode(msgpack.packb({"t": "Cancel", "bogus": 1}))


def test_unregistered_class_is_refused():
    @attrs.frozen
    class Stray:
        x: int

    with pytest.raises(TypeError, match="not a registered"):
        m.encode(Stray(1))


def test_large_bytes_travel_out_of_band_and_come_back_as_the_same_objects():
    """A snapshot's planes cross a mailbox without a copy: with `buffers`, bytes of
    OUT_OF_BAND or more are set aside (the msgpack data holds their index); small bytes
    and the same message without `buffers` stay inline."""
    from tqserve.actors.codec import OUT_OF_BAND
    big, small = bytes(range(256)) * (OUT_OF_BAND // 256), b"\x07" * 16
    write = m.SpillWrite(ram_key="r1", key="ab" * 32, header={"offset": 2},
                         planes=(("keys", big, (1, 1, 2, 8), "uint8"),
                                 ("norms", small, (1, 1, 2, 1), "float16")))
    buffers: list[bytes] = []
    data = m.encode(write, buffers)
    assert buffers == [big] and len(data) < 1024
    back = m.decode(data, buffers)
    assert back == write and back.planes[0][1] is big
    inline = m.encode(write)
    assert len(inline) > OUT_OF_BAND and m.decode(inline) == write
    with pytest.raises(m.CodecError):
        m.decode(data)  # its buffer is missing
    with pytest.raises(m.CodecError, match="extension type"):
        m.decode(msgpack.packb(msgpack.ExtType(9, b"\x00")))
