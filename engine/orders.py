"""The orders of a step that the core decides from the actors' advice (engine.step's
`StepAdvice`): which released rows and which joining prompts are snapshotted, under which
keys, whether the step's snapshots are persisted, what is spilled and dropped, and how many
tokens each decoding row proposes. Part of the sans-io core (engine.scheduler calls it for
every plan); pure, no I/O.

Snapshot keys are `r<n>` (a released row's KV, prompt and generated tokens) and `p<n>` (a
prompt's KV, snapshotted when its prefill is complete), numbered by the core; the prefix
cache books the tokens each covers when it absorbs the plan (actors.prefix_cache), and
its own temporary keys use other letters.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

from tqserve.engine.step import StepAdvice
from tqserve.engine.speculative.lookup import Draft


def snapshot_orders(advice: StepAdvice, ids: Iterator[int], release: Sequence[str],
                    release_tokens: Sequence[tuple[int, ...]], joins: Sequence[str],
                    wants_prompt_snapshot: Callable[[str], bool]) -> dict[str, Any]:
    """StepPlan's snapshot, prompt_snapshot, persist, spill and drop fields."""
    if not advice.prefix_cache:
        return {"spill": advice.spill, "drop": advice.drop}
    snapshot = tuple((rid, f"r{next(ids)}") for rid, tokens in zip(release, release_tokens)
                     if tokens)
    prompts = tuple((rid, f"p{next(ids)}") for rid in joins if wants_prompt_snapshot(rid))
    return {"snapshot": snapshot, "prompt_snapshot": prompts,
            "persist": advice.write_through and bool(snapshot or prompts),
            "spill": advice.spill, "drop": advice.drop}


def propose_sizes(advice: StepAdvice, decode: Sequence[str], joined_now: frozenset[str],
                  own_k: Callable[[str], int]) -> tuple[tuple[str, int], ...]:
    """(row, k) for the decoding rows that propose this step: a row the speculation
    actor's decision knows takes its k; one joining in this very plan proposes its own k
    when the decision allows new rows, so that a short request speculates from its first
    decode step."""
    if not advice.speculation:
        return ()
    known = dict(advice.proposals)
    out = []
    for rid in decode:
        if rid in joined_now:
            k = own_k(rid) if advice.new_rows_propose else 0
        else:
            k = known.get(rid, 0)
        if k > 0:
            out.append((rid, k))
    return tuple(out)


def proposal_drafts(advice: StepAdvice, propose: tuple[tuple[str, int], ...]
                    ) -> tuple[Draft, ...]:
    """The speculation actor's lookup proposals (advice.drafts) of the rows that propose
    this step."""
    proposing = {rid for rid, _ in propose}
    return tuple(d for d in advice.drafts if d[0] in proposing)
