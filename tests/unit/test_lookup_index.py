"""The speculation actor's lookup index (engine.speculative.lookup): the same proposal as
the definition (`lookup_tokens` over the whole context) after every step's tokens, for
random contexts, n-gram settings and small vocabularies (many matches) or large (few)."""

from __future__ import annotations

import random

import pytest

from tqserve.engine.speculative.lookup import (LookupBook, LookupIndex, LookupSettings,
                                               lookup_tokens)


@pytest.mark.parametrize("max_ngram,min_ngram,vocab", [(3, 1, 5), (3, 1, 50), (1, 1, 3),
                                                       (4, 2, 8), (16, 1, 4), (2, 2, 6),
                                                       (3, 1, 200)])
def test_index_proposes_what_the_definition_proposes_after_every_step(max_ngram, min_ngram,
                                                                       vocab):
    settings = LookupSettings(max_ngram=max_ngram, min_ngram=min_ngram)
    rng = random.Random(max_ngram * 1000 + vocab)
    checked = matched = 0
    for _ in range(60):
        context = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        index = LookupIndex(context, settings)
        for _ in range(rng.randrange(1, 12)):
            step = [rng.randrange(vocab) for _ in range(rng.randrange(0, 5))]
            context += step
            index.extend(step)
            assert index.tokens == context
            for k in (0, 1, 3, 7):
                want = lookup_tokens(context, k, settings)
                assert index.propose(k) == want, (context, k)
                checked += 1
                matched += bool(want)
    assert checked > 1000 and 0 < matched < checked  # both outcomes were exercised


def test_book_drafts_name_the_context_length_they_answer():
    book = LookupBook(LookupSettings(max_ngram=3))
    book.open("a", [1, 2, 3, 4, 1, 2])
    book.open("b", [7, 8, 9])
    book.extend("a", [3])
    book.extend("nobody", [5])  # a row that does not look up: ignored
    assert "a" in book and "nobody" not in book
    assert book.drafts([("a", 2), ("b", 4), ("c", 3), ("a", 0)]) == (
        ("a", 7, (4, 1)), ("b", 3, ()))
    book.close("a")
    assert book.drafts([("a", 2)]) == ()
