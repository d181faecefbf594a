"""Incremental detokenization: whole characters only, exact concatenation, stop strings."""

import pytest

from tqserve.engine.detokenize import TextStream

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


def released_by_spec(tok, ids, stops):
    """docs/protocol.md's rule, from whole decodes: after token i the released text is
    decode(ids[:i+1]) minus the longest suffix that is a proper prefix of a stop string;
    a token whose text ends in an incomplete character releases nothing new; a stop
    string ends the output before it."""
    released = []
    for i in range(len(ids)):
        text = tok.decode(ids[: i + 1])
        if text.endswith("\ufffd"):
            released.append(released[-1] if released else "")
            continue
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            released.append(text[: min(hits)])
            break
        hold = max((n for s in stops for n in range(1, len(s))
                    if text.endswith(s[:n])), default=0)
        released.append(text[: len(text) - hold])
    return released


STOP_SETS = [("\n\n",), ("return",), ("xyz", "+ 2"), ("ö", "日本語x"), ("\t\tq", "blank")]


@pytest.mark.parametrize("stops", STOP_SETS)
@pytest.mark.parametrize("text", TEXTS)
def test_each_delta_is_its_own_tokens_text_unless_held(draft_model, text, stops):
    tok = draft_model.tokenizer
    ids = tok.encode(text)
    stream = TextStream(tok, stop=stops)
    deltas = []
    for t in ids:
        deltas.append(stream.add(t))
        if stream.stopped:
            break
    if not stream.stopped:
        deltas[-1] += stream.flush()
    spec = released_by_spec(tok, ids, stops)
    final = spec[-1] if stream.stopped else tok.decode(ids)
    assert "".join(deltas) == final
    for i, delta in enumerate(deltas[:-1]):
        assert "".join(deltas[: i + 1]) == spec[i], (i, deltas[: i + 1])
        own = tok.decode(ids[: i + 1]).removeprefix(tok.decode(ids[:i]))
        held_before = len(spec[i - 1]) if i else 0
        if held_before == len(tok.decode(ids[:i])) and spec[i] == tok.decode(ids[: i + 1]):
            assert delta == own == tok.decode([ids[i]]), (i, delta, own)  # nothing held


def test_stop_prefix_text_is_released_with_the_token_that_rules_it_out(draft_model):
    tok = draft_model.tokenizer
    stream = TextStream(tok, stop=("\n\n",))
    a, newline, b = tok.encode("x")[0], tok.encode("\n")[0], tok.encode("y")[0]
    assert stream.add(a) == "x"
    assert stream.add(newline) == ""      # "\n" could start "\n\n": held
    assert stream.add(b) == "\ny"         # ruled out: released with the token after it
    assert stream.add(newline) == ""
    assert stream.add(newline) == "" and stream.stopped


class _DecodeOnly:
    """The tokenizer seen through `decode` alone (no fast backend to find)."""

    def __init__(self, tok):
        self.decode = tok.decode


def test_fast_decoder_gives_the_tokenizers_text(draft_model):
    import random

    from tqserve.engine.detokenize import fast_decoder

    tok = draft_model.tokenizer
    fast = fast_decoder(tok)
    assert fast is not tok.decode  # the bundled model's tokenizer has a Rust backend
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(draft_model.vocab_size) for _ in range(rng.randrange(1, 6))]
        assert fast(ids) == tok.decode(ids)
    ids = tok.encode("".join(TEXTS))
    stops = ("\n\n", "wör")
    a, b = TextStream(tok, stops), TextStream(_DecodeOnly(tok), stops)
    out_a, out_b = [], []
    for t in ids:
        out_a.append(a.add(t))
        out_b.append(b.add(t))
        if a.stopped or b.stopped:
            break
    assert out_a == out_b and a.stopped and b.stopped and len(out_a) > 5
