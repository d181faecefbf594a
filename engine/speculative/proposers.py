"""Proposers: what a speculating row guesses its next tokens to be.

Every proposer is deterministic given a row's context (prompt + output so far): `lookup`
matches n-grams, `draft` takes the draft model's argmax, `mtp` the MTP head's argmax. So
the proposal distribution q is a point mass, and exact rejection sampling reduces to:
accept proposal x_j with probability p_j(x_j), otherwise draw from p_j with x_j removed.
The verifier (engine.speculative.verify) does exactly that by drawing the target's own
token at every verified position with the row's per-position seeded key and accepting
while it equals the proposal: the output is the target's distribution, token for token
the same as without speculation for the same seed.

A proposer holds per-row state (`open_row` / `close_row`), proposes on the runner thread
(`propose`), and learns what the target kept (`verified`) so it can roll back its own
caches. All of them see `context`, whose last token is the one the target is fed next.
A stateful proposer (draft, MTP) also has an `identity` (what its state depends on: the
prefix cache's namespace for its rows) and gives or takes its state at a snapshot's
boundary (`state_at`, `restore`, `state_layout`: engine.speculative.state).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import attrs
import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from tqserve.engine.arrays import item_int
from tqserve.engine.speculative.lookup import LookupSettings, lookup_tokens
from tqserve.engine.speculative.state import ProposerState, StateLayout

class Proposer(Protocol):
    """What the verifier needs of a proposal method."""

    def open_row(self, request_id: str) -> None: ...

    def close_row(self, request_id: str) -> None: ...

    def propose(self, rows: Sequence[tuple[str, Sequence[int], int]]) -> list[tuple[int, ...]]:
        """For each (request id, context, k): at most k proposed tokens."""
        ...


class LookupProposer:
    """N-gram lookup over prompt + output so far; holds no per-row state."""

    def __init__(self, settings: LookupSettings | None = None) -> None:
        self.settings = settings if settings is not None else LookupSettings()

    def open_row(self, request_id: str) -> None:
        pass

    def close_row(self, request_id: str) -> None:
        pass

    def propose(self, rows: Sequence[tuple[str, Sequence[int], int]]) -> list[tuple[int, ...]]:
        return [lookup_tokens(ctx, k, self.settings) if k > 0 else () for _, ctx, k in rows]


@attrs.define
class _DraftRow:
    cache: list[Any]
    tokens: list[int] = attrs.Factory(list)  # what the draft cache holds, in order


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftProposer:
    """A second, smaller model with the same tokenizer, one plain KV cache per row.

    Before proposing, the row's draft cache is rolled back to the longest prefix it shares
    with the context (rejected proposals go) and fed the rest of the context in one forward
    (the whole prompt on a row's first proposal); then k-1 more greedy steps. The k
    forwards are built lazily and evaluated once per call.

    Paired snapshots: `state_at` catches the row's cache up to a snapshot's tokens and
    hands out slices of it; `restore` starts a row from such a state. `identity` is ""
    (no paired state) when the draft model's caches are not plain KV caches."""

    def __init__(self, model: Any, identity: str = "") -> None:
        self.model = model
        self._rows: dict[str, _DraftRow] = {}
        plain = all(type(c) is KVCache for c in make_prompt_cache(model))
        self.identity = identity if plain else ""
        self._layout: StateLayout | None = None

    def open_row(self, request_id: str) -> None:
        self._rows[request_id] = _DraftRow(cache=make_prompt_cache(self.model))

    def close_row(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def _catch_up(self, row: _DraftRow, context: Sequence[int]) -> mx.array:
        keep = _common_prefix(row.tokens, context[:-1])
        drop = len(row.tokens) - keep
        if drop:
            for c in row.cache:
                c.trim(drop)
            del row.tokens[keep:]
        feed = list(context[keep:])
        logits = self.model(mx.array(feed)[None], cache=row.cache)[:, -1, :]
        row.tokens.extend(feed)
        return mx.argmax(logits, axis=-1)

    def propose(self, rows: Sequence[tuple[str, Sequence[int], int]]) -> list[tuple[int, ...]]:
        drafts: list[list[mx.array]] = []
        for rid, context, k in rows:
            if k <= 0:
                drafts.append([])
                continue
            row = self._rows[rid]
            toks = [self._catch_up(row, context)]
            for _ in range(k - 1):
                logits = self.model(toks[-1][None], cache=row.cache)[:, -1, :]
                toks.append(mx.argmax(logits, axis=-1))
            drafts.append(toks)
        flat = [t for d in drafts for t in d]
        if flat:
            mx.eval(flat)
        out = []
        for (rid, _, _), d in zip(rows, drafts):
            tokens = tuple(item_int(t) for t in d)
            if d:
                self._rows[rid].tokens.extend(tokens[:-1])
            out.append(tokens)
        return out

    def state_layout(self) -> StateLayout | None:
        """The planes of this draft model's state (probed once: a one-token forward)."""
        if self._layout is None and self.identity:
            cache = make_prompt_cache(self.model)
            self.model(mx.array([[0]]), cache=cache)
            self._layout = StateLayout.probe(self.identity, "draft",
                                             [(c.keys[..., :1, :], c.values[..., :1, :])
                                              for c in cache], None)
        return self._layout

    def state_at(self, request_id: str, tokens: Sequence[int]) -> ProposerState | None:
        """The row's draft KV for exactly `tokens` (a prefix of its context): entries that
        disagree with them go, missing ones are computed (one forward), then sliced."""
        row = self._rows.get(request_id)
        if row is None or not tokens or not self.identity:
            return None
        keep = _common_prefix(row.tokens, tokens)
        if keep < len(tokens):
            if len(row.tokens) > keep:
                for c in row.cache:
                    c.trim(len(row.tokens) - keep)
                del row.tokens[keep:]
            self.model(mx.array(list(tokens[keep:]))[None], cache=row.cache)
            row.tokens.extend(tokens[keep:])
        n = len(tokens)
        layers = tuple((c.keys[..., :n, :], c.values[..., :n, :]) for c in row.cache)
        mx.eval([a for pair in layers for a in pair])
        return ProposerState(identity=self.identity, prefix="draft", layers=layers,
                             hidden=None, offset=n)

    def restore(self, request_id: str, state: ProposerState, tokens: Sequence[int]) -> None:
        """Start an open row's draft cache from `state`, which holds `tokens`."""
        row = self._rows[request_id]
        row.cache = []
        for keys, values in state.layers:
            cache = KVCache()
            cache.keys, cache.values, cache.offset = keys, values, int(keys.shape[2])
            row.cache.append(cache)
        row.tokens = list(tokens)
