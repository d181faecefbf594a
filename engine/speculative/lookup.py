"""Prompt lookup: the n-gram match that proposes a row's next tokens, two ways.

`lookup_tokens(context, k)` answers from the whole context in one numpy pass per n-gram
size: the definition, and what the runner computes for a row the speculation actor has
no fresh proposal for (a row's first decode step).

`LookupIndex` keeps one row's context with, per n-gram size, the latest start of every
n-gram that some token follows; a step's new tokens add their own n-grams, so a proposal
costs O(max_ngram) dictionary look-ups instead of a pass over the context (the proposal
is the same: tests/unit/test_lookup_index.py). `LookupBook` holds the indexes of the
speculation actor's lookup rows (actors.speculation): it proposes for step N+1 from the
tokens step N emitted, before the scheduler plans N+1, off the runner thread.

No MLX here: the speculation actor imports this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
import numpy as np

Draft = tuple[str, int, tuple[int, ...]]  # (request id, context length it answers, tokens)


@attrs.frozen(kw_only=True)
class LookupSettings:
    """Prompt lookup: match the last `max_ngram` .. `min_ngram` tokens of the context at
    an earlier place (most recent first) and propose what followed it."""

    max_ngram: int = 3
    min_ngram: int = 1

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram <= 16:
            raise ValueError("lookup n-gram sizes must satisfy 1 <= min <= max <= 16, got "
                             f"{self.min_ngram}..{self.max_ngram}")


def lookup_tokens(context: Sequence[int], k: int, settings: LookupSettings) -> tuple[int, ...]:
    """Up to k tokens following the most recent earlier match of the context's tail: the
    longest n-gram first (max_ngram .. min_ngram), the latest start before the tail's own.

    One vectorized pass per n over the whole context (numpy compares every candidate
    start at once; a scan in Python cost about 20x this). The definition, and the
    runner's answer for a row whose proposal the speculation actor did not make."""
    n_ctx = len(context)
    ctx = np.asarray(context, dtype=np.int64)
    for n in range(min(settings.max_ngram, n_ctx - 1), settings.min_ngram - 1, -1):
        starts = n_ctx - n  # the candidates: 0 .. n_ctx - n - 1 (the tail starts at n_ctx - n)
        hit = ctx[:starts] == ctx[starts]
        for i in range(1, n):
            hit &= ctx[i:starts + i] == ctx[starts + i]
        found = np.flatnonzero(hit)
        if found.size:
            start = int(found[-1])
            return tuple(int(t) for t in ctx[start + n:start + n + k])
    return ()


class LookupIndex:
    """One row's context and its n-grams' latest starts (module doc)."""

    def __init__(self, context: Iterable[int], settings: LookupSettings) -> None:
        self.settings = settings
        self.tokens: list[int] = []
        self._latest: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(settings.min_ngram, settings.max_ngram + 1)}
        self.extend(context)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens; the n-grams they give a follower to are indexed (a later start
        replaces an earlier one: the latest wins, as in `lookup_tokens`)."""
        old = len(self.tokens)
        self.tokens.extend(int(t) for t in tokens)
        ctx, end = self.tokens, len(self.tokens)
        for n, latest in self._latest.items():
            first, last = max(0, old - n), end - n - 1  # starts that gained a follower
            if last >= first:
                grams = zip(*(ctx[first + i:last + 1 + i] for i in range(n)))
                latest.update(zip(grams, range(first, last + 1)))

    def propose(self, k: int) -> tuple[int, ...]:
        """`lookup_tokens(self.tokens, k, settings)`, from the index."""
        ctx, end = self.tokens, len(self.tokens)
        for n in range(min(self.settings.max_ngram, end - 1), self.settings.min_ngram - 1, -1):
            start = self._latest[n].get(tuple(ctx[end - n:]))
            if start is not None:
                return tuple(ctx[start + n:start + n + k])
        return ()


class LookupBook:
    """The speculation actor's lookup rows: one index per open row that looks up."""

    def __init__(self, settings: LookupSettings) -> None:
        self.settings = settings
        self._rows: dict[str, LookupIndex] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._rows

    def open(self, request_id: str, context: Sequence[int]) -> None:
        self._rows[request_id] = LookupIndex(context, self.settings)

    def close(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def extend(self, request_id: str, tokens: Sequence[int]) -> None:
        """A row's tokens of one step (ignored for rows that do not look up)."""
        if (index := self._rows.get(request_id)) is not None:
            index.extend(tokens)

    def drafts(self, proposals: Iterable[tuple[str, int]]) -> tuple[Draft, ...]:
        """For each (row, k) of a lookup row: its proposal now, and the context length it
        answers (the runner takes it only for a row whose context is that long)."""
        return tuple((rid, len(index.tokens), index.propose(k)) for rid, k in proposals
                     if k > 0 and (index := self._rows.get(rid)) is not None)
