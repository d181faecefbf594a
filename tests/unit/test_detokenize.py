"""Incremental detokenization: whole characters only, exact concatenation, stop strings."""

import pytest

from engine.detokenize import TextStream

TEXTS = [
    "def f(x):\n    return x + 1\n",
    "s = 'héllo wörld ✓ 日本語'  # 😀 emoji and CJK\n",
    "naïve café — ünïcödé\t\ttabs\n\n\nblank lines",
]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_decode(draft_model, text):
    tok = draft_model.tokenizer
    ids = tok.encode(text)
    stream = TextStream(tok)
    deltas = [stream.add(t) for t in ids]
    deltas.append(stream.flush())
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_ends_before_it_and_holds_back_prefixes(draft_model):
    tok = draft_model.tokenizer
    ids = tok.encode("value = compute()\n\nnext_thing()")
    stream = TextStream(tok, stop=("\n\n",))
    out = []
    for t in ids:
        out.append(stream.add(t))
        assert "\n\n" not in "".join(out)
        if stream.stopped:
            break
    assert stream.stopped
    assert "".join(out) == "value = compute()"
    assert stream.flush() == ""
    with pytest.raises(ValueError):
        stream.add(ids[0])


def test_flush_releases_held_back_text_when_no_stop_completes(draft_model):
    tok = draft_model.tokenizer
    ids = tok.encode("abc\n")
    stream = TextStream(tok, stop=("\n\nEND",))
    out = "".join(stream.add(t) for t in ids) + stream.flush()
    assert out == "abc\n" and not stream.stopped
