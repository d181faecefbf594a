"""SlotRows: encoded KV planes of a batch of rows in preallocated row slots.

A plane is any array of shape (rows capacity, H, positions capacity, W) (codes, norms,
affine words/scales/biases, plain keys: any dtype). Batch row i lives in slot i with its
own length `lengths[i]`; its positions are LEFT-aligned at [0, lengths[i]) of every plane
(no padding). Positions beyond a row's length hold stale bytes that masks never let through.

* `append(blocks)` writes a block of L new positions of every row at [lengths[i],
  lengths[i] + L) (one scatter per plane, its index arrays built once per step for every
  layer; one slice update when all rows have the same length, e.g. a single row: the ops
  of mlx-lm's KVCache); nothing else moves. `mask` is then None for one decode position
  (every written position is seen), so attention takes its unmasked path as mlx-lm's
  single-stream decode does: on MLX-CUDA the fast decode SDPA kernel takes no array mask.
* `add_rows(rows)` writes joining rows into the free slots [n, n + m): only their bytes.
* `take(keep)` keeps rows `keep` in that order: row j takes slot j and only the rows whose
  slot changes move (with `retire_order`, one retirement moves at most one row); when at
  most a quarter of the row slots (or half the positions) is left in use the planes
  shrink (a copy of what is left), and when no row is left they are freed.
* `trim_rows(amounts)` lowers each row's length: nothing moves.
Row capacity starts at 2**k or 3 * 2**k (kv_budget.allocated_rows) and grows by
doubling, positions by STEPs; only growth copies every row, and a growth of the positions
keeps only the row slots at most twice the rows in use (kv_budget.grown: the budget's
charge follows these rules).
Lengths are host integers (whoever appends knows them), so no step reads them back.
Nothing here decodes: a row's bytes are the ones it was written with, in any batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import functools

import attrs
import mlx.core as mx
import numpy as np

from tqserve.engine.kv_budget import SLOT_STEP, ceil_step, grown, grown_rows, shrunk

STEP = SLOT_STEP  # positions added when a row outgrows the planes (as mlx-lm's KVCache.step)
STEP_ARRAYS_KEPT = 8  # recent lengths' index arrays kept: every layer of a step shares one
Planes = dict[str, mx.array]


@functools.lru_cache(maxsize=STEP_ARRAYS_KEPT)
def offsets_array(lengths: tuple[int, ...]) -> mx.array:
    return mx.array(lengths, dtype=mx.int32)


@functools.lru_cache(maxsize=STEP_ARRAYS_KEPT)
def _write_index(lengths: tuple[int, ...], length: int,
                 heads: int) -> tuple[mx.array, mx.array, mx.array]:
    """Index arrays (rows, heads, length) of the `length` new positions after `lengths`,
    for a scatter of blocks (rows, heads, length, W) as they come. Every layer of a step
    asks for the same ones: built once per step, not per layer; full uint32 indices
    leave the scatter no conversions to add (3 ops per write instead of 11)."""
    shape = (len(lengths), heads, length)
    # Built from numpy so that the cached arrays hold data, not a graph: a graph would be
    # tied to the stream of the thread that built it (a later engine's runner thread could
    # not evaluate it).
    rows = np.arange(len(lengths), dtype=np.uint32)[:, None, None]
    head = np.arange(heads, dtype=np.uint32)[None, :, None]
    pos = (np.asarray(lengths, dtype=np.uint32)[:, None, None]
           + np.arange(length, dtype=np.uint32)[None, None, :])
    return (mx.array(np.broadcast_to(rows, shape)), mx.array(np.broadcast_to(head, shape)),
            mx.array(np.broadcast_to(pos, shape)))


def row_indices(indices: Sequence[int] | mx.array) -> list[int]:
    """Batch row indices as ints, from a sequence or an mx.array (as mlx-lm passes them)."""
    return [int(i) for i in np.asarray(indices).reshape(-1)]


def retire_order(num_rows: int, gone: Sequence[int]) -> list[int]:
    """The `keep` list that retires rows `gone` by moving the last remaining rows into
    their holes (each hole costs at most one row's move)."""
    gone_set = set(gone)
    keep = [i for i in range(num_rows) if i not in gone_set]
    tail = [i for i in keep if i >= len(keep)]
    return [i if i not in gone_set else tail.pop() for i in range(len(keep))]


def slots_mask(lengths: Sequence[int], offset: mx.array, num_queries: int) -> mx.array | None:
    """`lengths_mask`, or None for one query position of rows of equal length (a single
    row, a burst of equal prompts): then every written position is seen."""
    if num_queries == 1 and min(lengths, default=0) == max(lengths, default=0):
        return None
    return lengths_mask(offset, max(lengths, default=0), num_queries)


def lengths_mask(offset: mx.array, longest: int, num_queries: int) -> mx.array:
    """(rows, 1, N, longest + N) boolean: query q of row i sees positions <= offset[i] + q
    (rows left-aligned at their lengths `offset`, N new positions each)."""
    end = longest + num_queries
    limit = offset[:, None, None, None] + mx.arange(num_queries)[None, None, :, None]
    return mx.arange(end)[None, None, None, :] <= limit


@attrs.frozen(kw_only=True)
class SlotStatistics:
    num_rows: int
    row_capacity: int
    position_capacity: int
    num_rows_moved: int  # rows copied by `take` (retirements), ever
    num_growths: int     # reallocations to hold more rows or positions, ever
    num_shrinks: int     # reallocations after retirements (see `take`), ever


class SlotRows:
    """Named planes in row slots with per-row lengths (see the module doc)."""

    def __init__(self) -> None:
        self._planes: Planes | None = None
        self.lengths: list[int] = []
        self._offset: mx.array | None = None
        self._num_rows_moved = 0
        self._num_growths = 0
        self._num_shrinks = 0

    @classmethod
    def holding(cls, planes: Mapping[str, mx.array], num_rows: int = 1) -> SlotRows:
        """Rows holding `planes` (B, H, T, W), every row written up to T; the planes are
        the allocation as they are (no copy: what a snapshot or an extracted row hands
        over). {} gives `num_rows` rows that hold no position yet."""
        rows = cls()
        if not planes:
            rows.add_rows([None] * num_rows)
            return rows
        shapes = {a.shape[:3] if a.ndim == 4 else a.shape for a in planes.values()}
        if len(shapes) != 1 or any(a.ndim != 4 for a in planes.values()):
            raise ValueError(f"planes must be (B, H, T, W) with one B, H, T: {sorted(shapes)}")
        (count, _, length), = shapes
        rows._planes = dict(planes)
        rows.set_lengths([length] * count)
        return rows

    def statistics(self) -> SlotStatistics:
        """Sizes and how many row copies the batch has cost."""
        shape = next(iter(self._planes.values())).shape if self._planes else (0, 0, 0)
        return SlotStatistics(num_rows=self.num_rows, row_capacity=shape[0],
                              position_capacity=shape[2], num_rows_moved=self._num_rows_moved,
                              num_growths=self._num_growths, num_shrinks=self._num_shrinks)

    @property
    def num_rows(self) -> int:
        """Rows in the batch (slots in use)."""
        return len(self.lengths)

    @property
    def empty(self) -> bool:
        """True until some row holds a position (the planes are allocated)."""
        return self._planes is None

    @property
    def nbytes(self) -> int:
        """Allocated bytes of every plane (free slots and slack included)."""
        return sum(a.nbytes for a in self._planes.values()) if self._planes else 0

    @property
    def offset(self) -> mx.array:
        """Per-row lengths as an int32 array (RoPE offsets of the next positions), shared
        by every layer of a step (never modify it in place)."""
        if self._offset is None:
            self._offset = offsets_array(tuple(self.lengths))
        return self._offset

    def set_lengths(self, lengths: list[int]) -> None:
        """Replace the lengths (they must describe written positions)."""
        self.lengths = lengths
        self._offset = None

    def planes(self) -> Planes:
        """The allocated planes of the rows in use (n, H, positions capacity, W)."""
        n = self.num_rows
        return {name: a[:n] for name, a in (self._planes or {}).items()}

    def fetch(self) -> Planes:
        """The planes of the rows in use up to the longest row (n, H, max length, W)."""
        n, end = self.num_rows, max(self.lengths, default=0)
        return {name: a[:n, :, :end] for name, a in (self._planes or {}).items()}

    def mask(self, num_queries: int) -> mx.array | None:
        """(n, 1, N, max length + N): query q of row i sees positions <= lengths[i] + q;
        None for one position of rows of equal length (`slots_mask`)."""
        return slots_mask(self.lengths, self.offset, num_queries)

    def _reserve(self, rows: int, positions: int, like: Mapping[str, mx.array]) -> None:
        """Make the planes hold `rows` slots of `positions`; `like` gives each plane's
        (H, W) and dtype when the planes do not exist yet. A growth is one copy of the
        rows kept into the new planes (`kv_budget.grown`: rows double; positions grow in
        STEPs, and then the row capacity halves while at most half of it is in use)."""
        if self._planes is None:
            shape = (grown_rows(0, rows), ceil_step(positions))
            self._planes = {n: mx.zeros((shape[0], a.shape[1], shape[1], a.shape[3]), a.dtype)
                            for n, a in like.items()}
            return
        self._check_fits(like)
        cap_rows, _, cap_pos, _ = next(iter(self._planes.values())).shape
        if rows > cap_rows or positions > cap_pos:
            self._num_growths += 1
            self._resize(*grown((cap_rows, cap_pos), rows, positions))

    def _resize(self, rows: int, positions: int) -> None:
        """Reallocate every plane as (rows, H, positions, W) holding the first `rows` slots'
        first `positions` positions (one copy of those; the rows in use are among them)."""
        def resized(a: mx.array) -> mx.array:
            kept = a[:rows, :, :positions]
            more = (rows - kept.shape[0], positions - kept.shape[2])
            if more == (0, 0):
                return mx.contiguous(kept)
            return mx.pad(kept, [(0, more[0]), (0, 0), (0, more[1]), (0, 0)])

        assert self._planes is not None
        self._planes = {n: resized(a) for n, a in self._planes.items()}

    def _check_fits(self, like: Mapping[str, mx.array]) -> None:
        """ValueError unless `like` has the held planes' names, heads, widths and dtypes."""
        assert self._planes is not None
        if set(like) != set(self._planes):
            raise ValueError(f"planes {sorted(like)} != held {sorted(self._planes)}")
        for name, a in like.items():
            held = self._planes[name]
            if a.ndim != 4 or (a.shape[1], a.shape[3], a.dtype) != (
                    held.shape[1], held.shape[3], held.dtype):
                raise ValueError(f"plane {name}: {a.shape} {a.dtype} does not fit "
                                 f"{held.shape} {held.dtype}")

    def append(self, blocks: Mapping[str, mx.array]) -> None:
        """Write L new positions of every row: blocks[name] is (n, H, L, W); row i's go to
        [lengths[i], lengths[i] + L)."""
        shapes = {a.shape[0] if a.ndim == 4 else -1 for a in blocks.values()}
        lengths = {a.shape[2] for a in blocks.values() if a.ndim == 4}
        if not blocks or shapes != {self.num_rows} or len(lengths) != 1:
            raise ValueError(f"blocks must be (n={self.num_rows}, H, L, W) with one L: "
                             f"{ {n: a.shape for n, a in blocks.items()} }")
        length = lengths.pop()
        n, first = self.num_rows, min(self.lengths, default=0)
        end = max(self.lengths, default=0) + length
        self._reserve(n, end, blocks)
        assert self._planes is not None
        if first == end - length:  # rows of equal length: one slice update, as KVCache's
            for name, block in blocks.items():
                self._planes[name][:n, :, first:end] = block
        else:
            for name, block in blocks.items():
                rows, head, pos = _write_index(tuple(self.lengths), length, block.shape[1])
                self._planes[name][rows, head, pos] = block
        self.set_lengths([p + length for p in self.lengths])

    def add_rows(self, rows: Sequence[Planes | None]) -> None:
        """Append rows in the free slots: each a dict of (1, H, length, W) planes, or None
        for a row holding no position yet. Only these rows' bytes are written."""
        written = [(j, r) for j, r in enumerate(rows) if r]
        n = self.num_rows
        if written:
            longest = max(next(iter(r.values())).shape[2] for _, r in written)
            self._reserve(n + len(rows), longest, written[0][1])
        elif self._planes is not None:
            self._reserve(n + len(rows), 0, self._planes)
        for _, row in written:
            self._check_fits(row)
        lengths = [0] * len(rows)
        for j, row in written:
            assert self._planes is not None
            for name, a in row.items():
                self._planes[name][n + j:n + j + 1, :, :a.shape[2]] = a
            lengths[j] = next(iter(row.values())).shape[2]
        self.set_lengths(self.lengths + lengths)

    def take(self, keep: Sequence[int]) -> None:
        """Keep rows `keep` in that order: row j takes slot j; only moved rows are copied."""
        keep = [int(i) for i in keep]
        if any(i not in range(self.num_rows) for i in keep) or len(set(keep)) != len(keep):
            raise ValueError(f"row indices {keep} are not distinct rows of 0..{self.num_rows - 1}")
        if not keep:  # no row left: the planes go (a later row allocates afresh)
            self._planes = None
        moves = [(j, src) for j, src in enumerate(keep) if j != src]
        if moves and self._planes is not None:
            # The moved rows are evaluated into their own buffers first: an update whose
            # value still reads the planes cannot write them in place (MLX would copy every
            # row, which is what the slots avoid). One sync, on retirement only.
            moved = [{n: mx.contiguous(a[s:s + 1]) for n, a in self._planes.items()}
                     for _, s in moves]
            mx.eval(moved)
            self._num_rows_moved += len(moves)
            for (j, _), row in zip(moves, moved):
                for name, a in row.items():
                    self._planes[name][j:j + 1] = a
        self.set_lengths([self.lengths[i] for i in keep])
        self._shrink()

    def _shrink(self) -> None:
        """After retirements: halve the row capacity while at most a quarter of it is in
        use, and cut the position capacity to the longest row (in STEPs) once it is more
        than twice that, so a burst of rows or one long row does not stay allocated."""
        if self._planes is None:
            return
        cap_rows, _, cap_pos, _ = next(iter(self._planes.values())).shape
        rows, positions = shrunk((cap_rows, cap_pos), max(self.num_rows, 1),
                                 max(self.lengths, default=0))
        if (rows, positions) != (cap_rows, cap_pos):
            self._resize(rows, positions)
            self._num_shrinks += 1

    def check_trim(self, amounts: Sequence[int], room: Sequence[int] | None = None) -> list[int]:
        """`amounts` as ints if 0 <= amounts[i] <= room[i] (default: the lengths) for one
        amount per row, else ValueError."""
        amounts = [int(a) for a in amounts]
        room = self.lengths if room is None else room
        if len(amounts) != self.num_rows or any(not 0 <= a <= r for a, r in zip(amounts, room)):
            raise ValueError(f"cannot trim {amounts} from rows with room {list(room)}")
        return amounts

    def trim_rows(self, amounts: Sequence[int]) -> None:
        """Drop the last amounts[i] positions of row i (0 <= amounts[i] <= lengths[i], else
        ValueError and nothing changes): lengths drop, no byte moves."""
        amounts = self.check_trim(amounts)
        self.set_lengths([p - a for p, a in zip(self.lengths, amounts)])

    def row(self, i: int) -> Planes:
        """Row i's written planes (1, H, lengths[i], W) as views ({} for an empty row)."""
        if i not in range(self.num_rows):
            raise ValueError(f"row {i} outside 0..{self.num_rows - 1}")
        length = self.lengths[i]
        if self._planes is None or length == 0:
            return {}
        return {n: a[i:i + 1, :, :length] for n, a in self._planes.items()}

    def extract(self, i: int) -> Planes:
        """Row i's written planes as fresh arrays (what a snapshot holds)."""
        return {n: mx.contiguous(a) for n, a in self.row(i).items()}
