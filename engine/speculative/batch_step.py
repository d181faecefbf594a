"""The decode batch's verify step: how far each row proposes, and the step's outputs.

A step in which some row proposes runs as one verify step of the whole batch
(Speculator.step: proposals, one forward of [last token + proposal] per row, acceptance,
per-row rollback); each row then outputs 1..k+1 tokens, and its host history (generated
tokens, last token, grammar) advances by them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tqserve.engine.decode_batch import RowState
from tqserve.engine.speculative.lookup import Draft
from tqserve.engine.speculative.speculator import SpecRow, Speculator
from tqserve.engine.step import RowOutput


def proposal_sizes(speculator: Speculator | None, rows: Sequence[tuple[str, RowState]],
                   propose: tuple[tuple[str, int], ...]) -> list[int]:
    """Tokens each batch row proposes this step (the plan's sizes, cut to what the row
    may still emit: a verify step emits up to k + 1); [] or all 0: a plain step."""
    wanted = dict(propose)
    if speculator is None or not wanted:
        return []
    sizes = []
    for rid, row in rows:
        k = wanted.get(rid, 0) if speculator.choice(rid) is not None else 0
        left = row.sampler.params.max_tokens - row.sampler.num_sampled - 1
        sizes.append(max(0, min(k, left)))
    return sizes


def verify_step(speculator: Speculator, model: Any, cache: list[Any],
                rows: Sequence[tuple[str, RowState]], masks: np.ndarray | None,
                ks: list[int], drafts: Sequence[Draft] = ()
                ) -> tuple[tuple[RowOutput, ...], int]:
    """One verify step of the batch `rows` (in the batch's order; `drafts`: the
    speculation actor's lookup proposals): each row's output and the number of positions
    the forward ran."""
    spec_rows = [SpecRow(request_id=rid, context=(*r.prompt, *r.generated),
                         sampler=r.sampler, grammar=r.grammar) for rid, r in rows]
    results = speculator.step(model, cache, spec_rows, [r.last_token for _, r in rows],
                              masks, ks, drafts)
    outputs, positions = [], 0
    for (rid, row), res in zip(rows, results):
        positions += 1 + res.num_proposed
        row.generated.extend(res.tokens)
        row.last_token = res.tokens[-1]
        if row.grammar is not None:
            row.grammar.advance_many(res.tokens)
        wants = row.sampler.params
        outputs.append(RowOutput(
            request_id=rid, tokens=res.tokens,
            logprobs=res.asked_logprobs() if wants.logprobs or wants.top_logprobs else None,
            top_logprobs=res.asked_top_logprobs() if wants.top_logprobs else None,
            num_proposed=res.num_proposed, num_accepted=res.num_accepted,
            grammar_done=row.grammar is not None and row.grammar.stopped,
            error=row.grammar.error if row.grammar is not None else None))
    return tuple(outputs), positions
