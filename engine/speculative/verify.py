"""Verification of every speculating row, next to plain decode rows, in ONE target forward.

Layout: row i is fed [last token, proposal_i...] right-padded to L = 1 + max_i k_i with
copies of its last token (plain rows have k_i = 0). The batch cache's causal mask already
hides a row's padding from its real positions (they come after them), so the padding only
costs compute; it is rolled back with the rejected positions.

Acceptance (greedy and sampled alike): at each verified position j of row i the target's
token y_j is drawn exactly as plain decoding would draw it (engine.sampling: the row's
processing, and its seeded key for output index num_sampled + j), and the row keeps
proposals while y_j equals them. It emits y_0 .. y_a (a accepted proposals plus the
target's own next token), so one verify step emits 1..k_i+1 tokens, their logprobs are the
target's, and a seeded row gives the same tokens with or without speculation, alone or
batched. For a point-mass proposal this is exact rejection sampling (proposers.py).

Rollback: row i keeps a_i + 1 of its L new positions; `trim_rows` drops the rest per row.
"""

from __future__ import annotations

from typing import Any, Sequence, cast

import attrs
import mlx.core as mx
import numpy as np

from tqserve.engine.sampling import RowSampler, build_sample, finalize_sample
from tqserve.engine.speculative.rollback import trim_batch_rows


@attrs.frozen(kw_only=True)
class VerifyRow:
    """One batch row in a verify step."""

    last_token: int
    proposal: tuple[int, ...]
    sampler: RowSampler
    masks: tuple[np.ndarray, ...] = ()  # grammar rows: the masks after proposal[:j], j >= 1


@attrs.frozen(kw_only=True)
class Verified:
    """What one row emits: tokens with the target's logprobs, and its acceptance."""

    tokens: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...] | None, ...]
    num_proposed: int
    num_accepted: int

    # A row that asked for logprobs (top logprobs) has them at every position: the position
    # samplers carry its params, so finalize_sample fills each one.
    def asked_logprobs(self) -> tuple[float, ...]:
        """The logprobs of a row that asked for them."""
        return cast(tuple[float, ...], self.logprobs)

    def asked_top_logprobs(self) -> tuple[tuple[tuple[int, float], ...], ...]:
        """The top logprobs of a row that asked for them."""
        return cast(tuple[tuple[tuple[int, float], ...], ...], self.top_logprobs)


def _position_sampler(sampler: RowSampler, proposal: tuple[int, ...], j: int) -> RowSampler:
    """The row's sampler as it would be after emitting proposal[:j] (a copy)."""
    return sampler.advanced(proposal[:j])


def verify_step(model: Any, cache: list[Any], rows: Sequence[VerifyRow],
                masks: np.ndarray | None = None,
                forward: Any = None) -> tuple[list[Verified], mx.array | None]:
    """Feed every row its block, sample every verified position, accept, roll back.

    `masks` (B, W) are the rows' grammar masks for their first position (a grammar row's
    later positions use its VerifyRow.masks).
    `forward(inputs, cache)`, when given, replaces `model(inputs, cache=cache)` and
    returns (logits, hidden) (the MTP proposer needs the hidden state). Returns the rows'
    results and those hidden states (B, L, D), or None without `forward`."""
    length = 1 + max(len(r.proposal) for r in rows)
    inputs = [[r.last_token, *r.proposal] + [r.last_token] * (length - 1 - len(r.proposal))
              for r in rows]
    batch = mx.array(inputs, dtype=mx.uint32)
    hidden = None
    if forward is None:
        logits = model(batch, cache=cache)
    else:
        logits, hidden = forward(batch, cache)
    flat_index, samplers, owner = [], [], []
    for i, r in enumerate(rows):
        for j in range(len(r.proposal) + 1):
            flat_index.append(i * length + j)
            samplers.append(_position_sampler(r.sampler, r.proposal, j))
            owner.append(i)
    flat = logits.reshape(len(rows) * length, -1)[mx.array(flat_index)]
    flat_masks = None
    if masks is not None:
        flat_masks = masks[np.array(owner)]
        pos = 0
        for r in rows:
            for j, bits in enumerate(r.masks):
                flat_masks[pos + 1 + j] = bits
            pos += len(r.proposal) + 1
    sampled = finalize_sample(build_sample(flat, samplers, flat_masks), samplers)
    results, trims, pos = [], [], 0
    for r in rows:
        ys = sampled.tokens[pos:pos + len(r.proposal) + 1]
        accepted = 0
        while accepted < len(r.proposal) and ys[accepted] == r.proposal[accepted]:
            accepted += 1
        keep = slice(pos, pos + accepted + 1)
        tops = sampled.top_logprobs[keep]
        results.append(Verified(
            tokens=tuple(ys[:accepted + 1]), logprobs=tuple(sampled.logprobs[keep]),
            top_logprobs=tuple(tuple((int(t), float(v)) for t, v in top) if top else None
                               for top in tops),
            num_proposed=len(r.proposal), num_accepted=accepted))
        for token in ys[:accepted + 1]:
            r.sampler.record(token)
        trims.append(length - accepted - 1)
        pos += len(r.proposal) + 1
    trim_batch_rows(cache, trims)
    return results, hidden
