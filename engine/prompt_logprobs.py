"""Prompt logprobs (OpenAI's `echo` with `logprobs`, vLLM's `prompt_logprobs`).

A row that asks (`SamplingParams.prompt_logprobs` = N alternatives) gets, for every
prompt position i, the log-softmax of the model's logits at position i - 1 taken at
prompt token i, and the N most likely tokens there; position 0 has no prefix and gets
None, as OpenAI and vLLM answer. The runner computes them from the logits of the row's
own prefill forwards (the row prefills alone and never reuses a prefix snapshot: every
position's logits are needed), chunk by chunk, and hands them out with the row's first
token. Rows that do not ask never evaluate their prefill logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import attrs
import mlx.core as mx
import numpy as np

from tqserve.engine.step import PromptEntry

if TYPE_CHECKING:
    from tqserve.engine.step import RowOutput

# prompt tokens a row asking for prompt logprobs may hold: its prefill keeps the logits of
# every position of a chunk, (chunk x vocabulary) floats, and the answer holds one entry
# per position
MAX_PROMPT_LOGPROBS_TOKENS = 4096



def first_entry(prompt: Sequence[int]) -> PromptEntry:
    """The first prompt position's entry: nothing precedes it."""
    return (int(prompt[0]), None, ())


def chunk_entries(logits: mx.array, targets: Sequence[int], top_n: int) -> list[PromptEntry]:
    """Entries for `targets`, the tokens that follow each position of a prefill chunk
    whose logits (1, T, V) are given (T = len(targets): the chunk's positions predict
    the prompt tokens one further on)."""
    if not targets:
        return []
    rows = logits[0, :len(targets)].astype(mx.float32)
    logprobs = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    ids = mx.array(list(targets), dtype=mx.int32)
    chosen = mx.take_along_axis(logprobs, ids[:, None], axis=-1)[:, 0]
    outputs = [chosen]
    if top_n:
        top_idx = mx.argsort(-logprobs, axis=-1)[:, :top_n]
        outputs += [top_idx, mx.take_along_axis(logprobs, top_idx, axis=-1)]
    mx.eval(*outputs)
    values = np.asarray(chosen).tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(targets)
    if top_n:
        top_ids, top_vals = np.asarray(outputs[1]), np.asarray(outputs[2])
        tops = [tuple((int(t), float(v)) for t, v in zip(ids_row, vals_row))
                for ids_row, vals_row in zip(top_ids, top_vals)]
    return [(int(t), float(v), top) for t, v, top in zip(targets, values, tops)]


class PromptLogprobsBook:
    """The runner's books of the rows asking for prompt logprobs: their entries so far,
    until they go out with the row's first token."""

    def __init__(self) -> None:
        self._rows: dict[str, tuple[int, list[PromptEntry]]] = {}

    def open(self, request_id: str, prompt: Sequence[int], top_n: int | None) -> None:
        """A new row; `top_n` None: it did not ask."""
        if top_n is not None:
            self._rows[request_id] = (top_n, [first_entry(prompt)])

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._rows

    def add(self, request_id: str, logits: mx.array, prompt: Sequence[int], start: int,
            end: int) -> None:
        """The logits (1, end - start, V) of the row's prefill chunk [start, end)."""
        book = self._rows.get(request_id)
        if book is not None:
            book[1].extend(chunk_entries(logits, prompt[start + 1:end + 1], book[0]))

    def attach(self, outputs: tuple[RowOutput, ...]) -> tuple[RowOutput, ...]:
        """`outputs` with each asking row's entries on its first token (then forgotten)."""
        if not self._rows:
            return outputs
        return tuple(attrs.evolve(out, prompt_logprobs=tuple(self._rows.pop(out.request_id)[1]))
                     if out.request_id in self._rows else out for out in outputs)

    def drop(self, request_ids: Sequence[str]) -> None:
        """Rows released before their first token."""
        for rid in request_ids:
            self._rows.pop(rid, None)

    def clear(self) -> None:
        self._rows.clear()
