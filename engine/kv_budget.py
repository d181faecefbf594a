"""The KV byte budget: how many bytes of KV the rows admitted so far may come to hold.

Sans-io (no MLX): the scheduler core asks it before a queued row starts, so the engine's
KV never grows past the budget (issue 20: 70 long rows took a process from 0.6 to 8 GB
and on, until the OS would kill it). A row is charged for its whole life at once: its
prompt plus max_tokens (plus a speculative verify block's margin), capped at the
model's context. The decode batch keeps rows in slots (engine.kv.slot_rows): each of its
row slots holds as many positions as the longest row, in SLOT_STEP positions; its row
capacity doubles when rows join and, when the positions grow (a copy of every row), halves
while at most half of it is in use (`grown`). So the rows admitted are charged

    max(rows_bound(capacity, n) * position capacity,
        rows_bound(halved_rows(capacity, n, 2), n) * ceil_step(max final length)) * bpp

(the second term when the final length is past the position capacity), where `capacity`
is the batch's allocation now (the runner reports it every step) and `rows_bound` the most
the doubling can reach for n rows (< 2n), plus each prefill group's own batch cache while
it prefills (the `allocated_rows` slots of its rows, of the group's width, halving as the
store does when rows cancelled mid-prefill leave it: engine.prefill_plan). A row that does not
fit waits in the queue (first come, first served); a row that could not fit even alone is
refused when it is submitted. Rows are never preempted: what was admitted can always finish.

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


def allocated_rows(rows: int) -> int:
    """A new slot store's row capacity for `rows` rows: the least 2**k or 3 * 2**k that
    holds them (at most a third more). Doubling and halving keep a capacity in its family,
    so halvings reach 1 or 3, never an odd capacity they cannot halve (`rows_bound`)."""
    pow2 = 1 << max(rows - 1, 0).bit_length()
    return 3 * pow2 // 4 if rows <= 3 * pow2 // 4 else pow2


def grown_rows(capacity: int, rows: int) -> int:
    """The slot store's row capacity after it must hold `rows`: a first allocation holds
    them (`allocated_rows`), a full store doubles (capacity * 2**k, the least that holds
    them), so every capacity a store reaches stays on the sequence of its first."""
    if capacity == 0:
        return allocated_rows(max(rows, 1))
    while capacity < rows:
        capacity *= 2
    return capacity


def halved_rows(capacity: int, rows: int, share: int) -> int:
    """`capacity` halved while `rows` use at most 1/`share` of it (and it halves evenly,
    so doubling can reach it again: `rows_bound`)."""
    while capacity % 2 == 0 and capacity > 0 and rows * share <= capacity:
        capacity //= 2
    return capacity


def shrunk(capacity: tuple[int, int], rows: int, longest: int) -> tuple[int, int]:
    """The slot store's (rows, positions) capacity once rows left it, `rows` staying, the
    longest of `longest` positions: the row capacity halves while at most a quarter of it
    is in use; the positions are cut to the longest row (in SLOT_STEPs) once they are more
    than twice that (engine.kv.slot_rows applies this rule)."""
    cap_rows, cap_pos = capacity
    if rows == 0:
        return 0, 0
    need = ceil_step(longest)
    return halved_rows(cap_rows, rows, 4), need if cap_pos > 2 * need else cap_pos


def grown(capacity: tuple[int, int], rows: int, positions: int) -> tuple[int, int]:
    """The slot store's (rows, positions) capacity once it must hold `rows` rows of up to
    `positions`: rows double (`grown_rows`); positions grow in SLOT_STEPs, and as that
    copies every row anyway, the row capacity then halves while at most half of it is in
    use (so rows that left earlier do not carry their empty slots into the larger store)."""
    cap_rows, cap_pos = capacity
    if positions > cap_pos:
        cap_pos = ceil_step(positions)
        if rows <= cap_rows:
            return halved_rows(cap_rows, rows, 2), cap_pos
    return grown_rows(cap_rows, rows), cap_pos


def rows_bound(capacity: int, rows: int) -> int:
    """The largest row capacity `rows` rows can reach from `capacity` now, joining in any
    number of steps: the least capacity * 2**k that holds them (halvings, `halved_rows`,
    stay on that sequence, so they never make it larger). From an empty store the first
    group to join picks the sequence (`allocated_rows`): the larger of the least 2**k and
    the least 3 * 2**k that hold them (less than 2 * rows)."""
    if capacity:
        return grown_rows(capacity, rows)
    threes = grown_rows(3, rows) if rows >= 3 else 0
    return max(grown_rows(1, rows), threes)


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

    def charge(self, final_lengths: Sequence[int], groups: Sequence[tuple[int, int]] = (), *,
               capacity: tuple[int, int] = (0, 0)) -> int:
        """Bytes charged for rows of these final lengths (decoding or to decode) beside a
        batch allocated `capacity` = (rows, positions) now, plus each prefill group's own
        store: `groups` as (row slots, width)."""
        if not final_lengths:
            return 0
        (cap_rows, cap_pos), n = capacity, len(final_lengths)
        slots = rows_bound(cap_rows, n) * cap_pos
        if (positions := ceil_step(max(final_lengths))) > cap_pos:  # rows halve: `grown`
            slots = max(slots, rows_bound(halved_rows(cap_rows, n, 2), n) * positions)
        slots += sum(rows * ceil_step(width) for rows, width in groups)
        return slots * self.bytes_per_position

    def check_alone(self, prompt_tokens: int, max_tokens: int) -> None:
        """ValueError naming the sizes if one such row could never fit (with `preempt`:
        could not resume alone by prefilling all it holds again, should its snapshot be
        gone: its whole life twice)."""
        life = self.row_positions(prompt_tokens, max_tokens)
        need = self.charge([life], [(1, life if self.preempt else prompt_tokens)])
        if need > self.budget_bytes:
            raise ValueError(
                f"prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) needs "
                f"{need / 2**20:.1f} MiB of KV cache, more than the server's KV budget of "
                f"{self.budget_bytes / 2**20:.1f} MiB (--kv-budget-bytes)")
