"""Prefill planning in the sans-io core (engine.scheduler): the books of the prefill groups
and each step's prefill chunks under the step's token budget. The runner executes the plan
(engine.prefill); no I/O, no MLX.

The rows that start prefilling from scratch in one `schedule` call form a prefill group.
The group is as wide as its longest prompt and its rows are prefilled together,
`columns` positions of every row per step in ONE forward (the runner keeps the group in
one slot batch per layer), so all of them finish in the same step and join together. A
row's chunk is its prompt's positions under those columns: a shorter row runs out
first, and the columns past its end are padding that the runner trims away. A row that
reuses a prefix snapshot prefills alone (its group holds only it); a row with nothing to
prefill gets no group and joins at once. Each step processes at most `max_step_tokens`
tokens: the rows decoding when the step is planned take one each, and the prefill groups
share the rest oldest first, a group costing `columns` times its number of rows (padding
included), at most `prefill_chunk` columns per step. `max_step_tokens >= max_batch`
guarantees the oldest group at least one column per step; the rows joining in a step
decode their first token in that same step, on top of the budget.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from tqserve.engine.kv_budget import allocated_rows, halved_rows
from tqserve.engine.rows import Group, Row
from tqserve.engine.step import PrefillChunk


class PrefillPlanner:
    """The prefilling groups and the prefill tokens planned so far (module doc)."""

    def __init__(self, *, prefill_chunk: int, max_step_tokens: int) -> None:
        self._prefill_chunk = prefill_chunk
        self._max_step_tokens = max_step_tokens
        self._groups: dict[int, Group] = {}
        self._next_group = 0
        self.num_prefill_tokens = 0  # padding included: what the prefill forwards processed

    @staticmethod
    def _grouped(started: Sequence[Row]) -> list[list[Row]]:
        """The groups rows starting together form: one of the rows starting from scratch,
        one per row reusing a prefix with more to prefill (rows with nothing get none)."""
        fresh = [row for row in started if row.cached == 0 and len(row.prompt) > 1]
        alone = [[row] for row in started if row.cached > 0 and len(row.prompt) - 1 > row.cached]
        return ([fresh] if fresh else []) + alone

    @staticmethod
    def _width(rows: Sequence[Row]) -> int:
        return max(len(row.prompt) - 1 - row.cached for row in rows)

    def form(self, started: Sequence[Row]) -> None:
        """The groups of the rows started (`_grouped`); sets each row's group."""
        for rows in self._grouped(started):
            self._next_group += 1
            for row in rows:
                row.group = self._next_group
            self._groups[self._next_group] = Group(
                group_id=self._next_group, rows=[row.request_id for row in rows],
                width=self._width(rows), slots=allocated_rows(len(rows)))

    def plan(self, rows: Mapping[str, Row], prefilling: Sequence[str],
             num_decoding: int) -> tuple[list[PrefillChunk], list[str]]:
        """This step's chunks, oldest group first, and the prefilling rows that join the
        decode batch (no group, or their group complete), in join order. Advances each
        row's `num_prefilled`; the caller moves the joining rows."""
        budget = self._max_step_tokens - num_decoding
        chunks: list[PrefillChunk] = []
        joins = [rid for rid in prefilling if rows[rid].group == 0]
        for group in list(self._groups.values()):
            columns = min(self._prefill_chunk, group.width - group.done,
                          budget // len(group.rows))
            if columns <= 0:
                continue
            end_col = group.done + columns
            for rid in group.rows:
                row = rows[rid]
                own = len(row.prompt) - 1 - row.cached
                start = row.cached + min(group.done, own)
                end = row.cached + min(end_col, own)
                chunks.append(PrefillChunk(request_id=rid, start=start, end=end,
                                           group=group.group_id, columns=columns))
                row.num_prefilled = end
            group.done = end_col
            budget -= columns * len(group.rows)
            self.num_prefill_tokens += columns * len(group.rows)
            if group.done == group.width:
                del self._groups[group.group_id]
                joins += group.rows
        return chunks, joins

    def drop(self, row: Row) -> None:
        """A prefilling row finished: it leaves its group (an emptied group is forgotten).
        The group's store keeps its slots as the runner's does: allocated for the rows
        left until the first chunk, then halved only while at most a quarter is in use."""
        group = self._groups.get(row.group)
        if group is not None:
            group.rows.remove(row.request_id)
            if not group.rows:
                del self._groups[row.group]
            else:
                group.slots = (halved_rows(group.slots, len(group.rows), 4) if group.done
                               else allocated_rows(len(group.rows)))

    def stores(self, starting: Sequence[Row] = ()) -> list[tuple[int, int]]:
        """Each prefilling group's store as (row slots, width) (engine.kv_budget), and the
        stores of the groups rows `starting` now would form."""
        return [(g.slots, g.width) for g in self._groups.values()] + [
            (allocated_rows(len(rows)), self._width(rows)) for rows in self._grouped(starting)]

    @property
    def num_groups(self) -> int:
        return len(self._groups)
