"""The KV byte budget: how many bytes of KV the rows admitted so far may come to hold.

Sans-io (no MLX): the scheduler core asks it before a queued row starts, so the engine's
KV never grows past the budget (issue 20: 70 long rows took a process from 0.6 to 8 GB
and on, until the OS would kill it). A row is charged for its whole life at once: its
prompt plus max_tokens (plus a speculative verify block's margin), capped at the
model's context. The decode batch keeps rows in slots (engine.kv.slot_rows): each of its
row slots holds as many positions as the longest row, in SLOT_STEP positions, and its row
capacity doubles when rows join, so the rows admitted are charged

    rows_bound(capacity, n) * max(position capacity, ceil_step(max final length)) * bpp

where `capacity` is the batch's allocation now (the runner reports it every step) and
`rows_bound` the most the doubling can reach for n rows (< 2n), plus each prefill group's
own batch cache while it prefills (a padded width per row). A row that does not fit waits
in the queue (first come, first served); a row that could not fit even alone is refused
when it is submitted. Rows are never preempted: what was admitted can always finish.

With `preempt` (`--kv-admission preempt`, as vLLM admits) a row is charged the positions
it holds now plus one SLOT_STEP of growth instead (`row_length`), so rows that end before
max_tokens leave room for more. Before each step the core (engine.scheduler) checks that
the running rows' next positions fit, beside the slot store as it will be once this
step's released rows left it (`shrunk`: the store's own rule); while they do not, the
longest decoding row is preempted (every slot is as long as the longest row, so it is the
one that makes the store grow): it is released with its tokens, so the prefix cache
snapshots its KV into the RAM tier (and the SSD tier, as for any snapshot), and it waits
at the queue's head as prompt + output so far. It resumes from that snapshot once it is
looked up and fits again (`NewRow.resumed`: its sampler, grammar and proposer continue
where they stopped, so its greedy and seeded tokens are those of a run without
preemption; without a snapshot it prefills its tokens again, so `check_alone` refuses a
request that could not do that alone). The last running row is never preempted.
"""

from __future__ import annotations

from typing import Sequence

import attrs

SLOT_STEP = 256  # positions are allocated in these (engine.kv.slot_rows.STEP)


def ceil_step(n: int) -> int:
    """`n` positions rounded up to whole SLOT_STEPs (at least one)."""
    return SLOT_STEP * max(1, -(-n // SLOT_STEP))


def grown_rows(capacity: int, rows: int) -> int:
    """The slot store's row capacity after it must hold `rows` (doubling; slot_rows)."""
    if capacity == 0:
        return max(rows, 1)
    return capacity if rows <= capacity else max(rows, 2 * capacity)


def shrunk(capacity: tuple[int, int], rows: int, longest: int) -> tuple[int, int]:
    """The slot store's (rows, positions) capacity once rows left it, `rows` staying, the
    longest of `longest` positions: the row capacity halves while at most a quarter of it
    is in use; the positions are cut to the longest row (in SLOT_STEPs) once they are more
    than twice that (engine.kv.slot_rows applies this rule)."""
    cap_rows, cap_pos = capacity
    if rows == 0:
        return 0, 0
    while cap_rows > 1 and rows <= cap_rows // 4:
        cap_rows //= 2
    need = ceil_step(longest)
    return cap_rows, need if cap_pos > 2 * need else cap_pos


def rows_bound(capacity: int, rows: int) -> int:
    """The largest row capacity `rows` rows can leave, joining in any number of steps,
    from `capacity` now: a growth happens only for r > c rows and gives max(r, 2c), less
    than 2r, so never more than max(rows, 2 * rows - 2)."""
    return capacity if rows <= capacity else max(rows, 2 * rows - 2)


@attrs.frozen(kw_only=True)
class KvBudget:
    """`budget_bytes` of KV for rows costing `bytes_per_position` per position (every
    layer, target and proposer); a row's positions are capped at `context` + `margin`
    (a speculative verify block's extra positions)."""

    budget_bytes: int = attrs.field(validator=attrs.validators.ge(1))
    bytes_per_position: int = attrs.field(validator=attrs.validators.ge(1))
    context: int = attrs.field(default=1 << 30, validator=attrs.validators.ge(1))
    margin: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    preempt: bool = False  # charge rows for now and preempt under pressure (module doc)

    def row_positions(self, prompt_tokens: int, max_tokens: int) -> int:
        """Positions a row may come to hold."""
        return min(prompt_tokens, self.context) + min(max_tokens, self.context) + self.margin

    def row_length(self, prompt_tokens: int, max_tokens: int, positions: int,
                   growth: int = SLOT_STEP) -> int:
        """Positions a row is charged for: its whole life, or with `preempt` the
        `positions` it holds now plus `growth` (never past its whole life)."""
        life = self.row_positions(prompt_tokens, max_tokens)
        return min(life, positions + growth + self.margin) if self.preempt else life

    def charge(self, final_lengths: Sequence[int], group_widths: Sequence[int] = (), *,
               capacity: tuple[int, int] = (0, 0)) -> int:
        """Bytes charged for rows of these final lengths (decoding or to decode) beside a
        batch allocated `capacity` = (rows, positions) now, plus one prefill group width
        per row prefilling in a group."""
        if not final_lengths:
            return 0
        positions = max(capacity[1], ceil_step(max(final_lengths)))
        slots = rows_bound(capacity[0], len(final_lengths)) * positions
        return (slots + sum(ceil_step(w) for w in group_widths)) * self.bytes_per_position

    def check_alone(self, prompt_tokens: int, max_tokens: int) -> None:
        """ValueError naming the sizes if one such row could never fit (with `preempt`:
        could not resume alone by prefilling all it holds again, should its snapshot be
        gone: its whole life twice)."""
        life = self.row_positions(prompt_tokens, max_tokens)
        need = self.charge([life], [life if self.preempt else prompt_tokens])
        if need > self.budget_bytes:
            raise ValueError(
                f"prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) needs "
                f"{need / 2**20:.1f} MiB of KV cache, more than the server's KV budget of "
                f"{self.budget_bytes / 2**20:.1f} MiB (--kv-budget-bytes)")
