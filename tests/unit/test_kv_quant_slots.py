"""Affine, TurboQuant and delayed TurboQuant KV in per-row slots: every row attends as it
does alone through joins, retirements and per-row trims; joins write only the joining
rows, a retirement moves at most one row; extraction and `state` keep the encoded bytes.
`Mirror` and `run_batch_scenario` (serial rows == slot batch rows, byte for byte) serve the
per-kind tests too (test_kv_turboquant.py, test_kv_affine.py, test_kv_delayed.py)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import base

from tqserve.engine.kv.affine import AffineKVCache
from tqserve.engine.attention.sdpa import MixedRowsKV, RotatedKV, install_attention
from tqserve.engine.kv.delayed import DelayedTurboQuantKVCache
from tqserve.engine.kv.slot_rows import SlotRows
from tqserve.engine.kv.slots import is_slot_batch, retire_order, slot_batch, slot_batch_of
from tqserve.engine.kv.turboquant import TurboQuantKVCache

H, QH, D = 2, 4, 64
START = 6  # quantized_kv_start of the delayed kinds
KINDS = {
    "tq-k4v4-fused": lambda: TurboQuantKVCache(4, 4, D, decode="auto"),
    "tq-k8v3-plain": lambda: TurboQuantKVCache(8, 3, D, decode="unfused"),
    "affine-8-64": lambda: AffineKVCache(8, 64),
    "affine-4-32": lambda: AffineKVCache(4, 32),
    "delayed-k4v4-fused": lambda: DelayedTurboQuantKVCache(START, 4, 4, D, decode="auto"),
    "delayed-k8v3-plain": lambda: DelayedTurboQuantKVCache(START, 8, 3, D, decode="unfused"),
}


def _planes(cache):
    """A single row's encoded planes by name (the bytes a snapshot holds)."""
    if isinstance(cache, DelayedTurboQuantKVCache):
        if cache.converted:
            return {"converted": mx.array(1), **cache.quantized.written()}
        return {"keys": cache.plain.keys[..., :cache.offset, :],
                "values": cache.plain.values[..., :cache.offset, :]}
    return cache.written()


def _attend(q, cache, k, v):
    """What a model layer does: mask, append, attention through mlx-lm's dispatch."""
    mask = cache.make_mask(k.shape[2])
    keys, values = cache.update_and_fetch(k, v)
    # (mlx-lm's quantized attention scales its queries in place: give it its own)
    return base.scaled_dot_product_attention(q * 1, keys, values, cache=cache, scale=0.125,
                                             mask=mask), keys


class Twin:
    """A slot batch and the same rows alone, stepped with the same inputs."""

    def __init__(self, make, lengths):
        self.make = make
        self.alone = [self._row(n, seed) for seed, n in enumerate(lengths)]
        self.batch = slot_batch(self.alone[0])
        self.batch.extend(self.alone[1])  # a single row joins as it is
        rest = self.alone[2:]
        if rest:
            self.batch.extend(slot_batch_of(rest))  # a batch (prefill group) joins
        self.seed = 100

    def _row(self, n, seed):
        row = self.make()
        if n:
            k = mx.random.normal((1, H, n, D), key=mx.random.key(seed))
            row.update_and_fetch(k, k * 0.5 + 1)
        return row

    def join(self, n):
        self.alone.append(self._row(n, len(self.alone)))
        self.batch.extend(self.alone[-1])

    def retire(self, gone):
        keep = retire_order(len(self.alone), gone)
        self.batch.filter(keep)
        self.alone = [self.alone[i] for i in keep]

    def step(self, length):
        self.seed += 1
        n = len(self.alone)
        k, v, q = (mx.random.normal(s, key=mx.random.key(self.seed * 3 + j)) for j, s in
                   enumerate([(n, H, length, D), (n, H, length, D), (n, QH, length, D)]))
        got, fetched = _attend(q, self.batch, k, v)
        want = [_attend(q[i:i + 1], c, k[i:i + 1], v[i:i + 1])[0]
                for i, c in enumerate(self.alone)]
        assert np.max(np.abs(np.array(got) - np.array(mx.concatenate(want)))) < 1e-5
        assert self.batch.lengths == [int(c.offset) for c in self.alone]
        return fetched

    def check_bytes(self):
        for i, row in enumerate(self.alone):
            want, got = _planes(row), _planes(self.batch.extract(i))
            assert set(got) == set(want)
            for name in want:
                assert mx.array_equal(got[name], want[name]), (i, name)


Planes = dict[str, np.ndarray]


class Mirror:
    """Single rows cached alone next to one slot batch of their twins, fed the same K/V
    (values of varied scales); `check` compares each row's bytes (`planes` of a single row)
    alone and extracted from the batch."""

    def __init__(self, make, planes, seed=0):
        self.make, self.planes = make, planes
        self.rng = np.random.default_rng(seed)
        self.serial = {}
        self.order = []
        self.batch = None

    def kv(self, num_rows, length):
        shape = (num_rows, H, length, D)
        scale = self.rng.uniform(0.1, 30.0, (num_rows, H, length, 1))
        k, v = (self.rng.standard_normal(shape) * scale for _ in range(2))
        return mx.array(k.astype(np.float32)), mx.array(v.astype(np.float32))

    def prefill(self, name, chunks):
        """A serial row and its twin (returned, for the batch), fed the same chunks."""
        serial, twin = self.make(), self.make()
        for length in chunks:
            k, v = self.kv(1, length)
            serial.update_and_fetch(k, v)
            twin.update_and_fetch(k, v)
        self.serial[name] = serial
        return twin

    def join(self, rows):
        """Put single rows (twins or extracted rows) in one slot batch (a prefill group's),
        which joins the batch."""
        group = slot_batch_of(list(rows.values()))
        if self.batch is None:
            self.batch = group
        else:
            self.batch.extend(group)
        self.order += list(rows)

    def step(self, length=1):
        k, v = self.kv(len(self.order), length)
        self.batch.update_and_fetch(k, v)
        for i, name in enumerate(self.order):
            self.serial[name].update_and_fetch(k[i : i + 1], v[i : i + 1])

    def filter(self, keep):
        self.batch.filter(keep)
        self.order = [self.order[i] for i in keep]

    def trim(self, n):
        trimmed = self.batch.trim(n)
        assert [self.serial[name].trim(trimmed) for name in self.order] == [trimmed] * len(
            self.order)
        return trimmed

    def check(self):
        """Every batch row holds the serial row's bytes, at the serial row's offset."""
        assert self.batch.offset.tolist() == [self.serial[n].offset for n in self.order]
        for i, name in enumerate(self.order):
            want, got = self.planes(self.serial[name]), self.planes(self.batch.extract(i))
            if self.serial[name].offset == 0:  # a slot row of no position extracts empty
                assert got == {} and all(a.shape[2] == 0 for a in want.values()), name
                continue
            assert set(want) == set(got), name
            for plane in want:
                assert want[plane].dtype == got[plane].dtype, (name, plane)
                np.testing.assert_array_equal(got[plane], want[plane], err_msg=f"{name} {plane}")


def run_batch_scenario(mirror):
    """Join a prefill group, decode, join, reorder + retire, extract + re-admit, trim,
    multi-token steps."""
    mirror.join({"a": mirror.prefill("a", [5]), "b": mirror.prefill("b", [7, 6])})
    mirror.check()
    for _ in range(4):
        mirror.step()
    mirror.check()
    mirror.join({"c": mirror.prefill("c", [3, 9, 12])})
    mirror.step()
    mirror.check()
    mirror.filter([2, 0])  # retire b, reorder c before a
    mirror.step()
    mirror.check()
    row = mirror.batch.extract(1)  # a leaves; decodes alone for a while; comes back
    mirror.filter([0])
    np.testing.assert_equal(mirror.planes(row), mirror.planes(mirror.serial["a"]))
    mirror.step()
    for _ in range(2):
        k, v = mirror.kv(1, 1)
        row.update_and_fetch(k, v)
        mirror.serial["a"].update_and_fetch(k, v)
    mirror.join({"a": row})
    mirror.step()
    mirror.check()
    assert mirror.trim(2) == 2
    mirror.check()
    mirror.step(3)  # a multi-token block (e.g. speculative verification)
    mirror.check()
    room = min(mirror.serial[n].offset - getattr(mirror.serial[n], "minimum_reusable_offset", 0)
               for n in mirror.order)
    assert mirror.trim(100) == room  # clamped: the shortest row, or a precision boundary
    mirror.check()


def _parts(batch):
    if hasattr(batch, "quantized"):
        return [batch.slots, batch.quantized.slots]
    return [batch.slots]


def _moved(batch):
    return sum(p.statistics().num_rows_moved for p in _parts(batch))


@pytest.fixture(autouse=True)
def _dispatch():
    install_attention()


@pytest.mark.parametrize("kind", list(KINDS))
def test_rows_attend_as_alone_through_joins_retirements_and_trims(kind):
    twin = Twin(KINDS[kind], [3, 9, 5])
    assert is_slot_batch(twin.batch) and twin.batch.lengths == [3, 9, 5]
    twin.check_bytes()
    for _ in range(2):
        twin.step(1)
    capacity = [p.statistics().row_capacity for p in _parts(twin.batch)]
    twin.join(0)  # a one-token prompt: a slot without positions
    twin.join(4)
    twin.step(1)
    assert twin.batch.lengths == [6, 12, 8, 1, 5]
    moved = _moved(twin.batch)
    twin.retire([1])  # the last row moves into the hole
    assert _moved(twin.batch) - moved <= 1
    twin.step(3)  # a verify block; then each row keeps its own number of positions
    room = [int(c.offset) - getattr(c, "minimum_reusable_offset", 0) for c in twin.alone]
    amounts = [min(a, r) for a, r in zip([2, 0, 3, 1], room)]
    twin.batch.trim_rows(amounts)
    for row, a in zip(twin.alone, amounts):
        assert row.trim(a) == a
    for _ in range(4):
        twin.step(1)
    twin.check_bytes()
    moved = _moved(twin.batch)
    twin.retire([len(twin.alone) - 1])  # a suffix leaves: nothing moves
    assert _moved(twin.batch) == moved
    twin.step(1)
    twin.check_bytes()
    grown = [p.statistics().row_capacity for p in _parts(twin.batch)]
    assert grown[0] <= 2 * max(capacity[0], 4)  # rows grow by doubling, not per join
    if kind.startswith("delayed"):
        assert all(twin.batch.converted) and twin.batch.minimum_reusable_offsets == [
            c.minimum_reusable_offset for c in twin.alone]


@pytest.mark.parametrize("kind", list(KINDS))
def test_trim_rows_contract_and_state_round_trip(kind):
    twin = Twin(KINDS[kind], [2, 8, 4])
    twin.step(1)
    before = list(twin.batch.lengths)
    with pytest.raises(ValueError):
        twin.batch.trim_rows([1, 1])
    with pytest.raises(ValueError):
        twin.batch.trim_rows([0, 0, 99])
    with pytest.raises(ValueError):
        twin.batch.trim_rows([-1, 0, 0])
    assert twin.batch.lengths == before
    if kind.startswith("delayed"):  # the converted row never goes below its boundary
        twin.step(1)
        converted = twin.batch.converted.index(True)
        room = twin.batch.lengths[converted] - twin.batch.minimum_reusable_offsets[converted]
        amounts = [0, 0, 0]
        amounts[converted] = room + 1
        with pytest.raises(ValueError):
            twin.batch.trim_rows(amounts)
        rooms = [n - b for n, b in zip(twin.batch.lengths, twin.batch.minimum_reusable_offsets)]
        assert twin.batch.trim(99) == min(rooms) < max(rooms)  # clamped by the boundaries
        for row in twin.alone:
            assert row.trim(min(rooms)) == min(rooms)
    copy = type(twin.batch)()
    copy.state = twin.batch.state
    assert copy.lengths == twin.batch.lengths
    twin.batch = copy
    twin.check_bytes()
    twin.step(1)
    twin.check_bytes()


def test_tq_slots_fetch_left_aligned_rows_with_their_own_ends():
    twin = Twin(KINDS["tq-k4v4-fused"], [3, 9, 0])
    fetched = twin.step(1)
    assert isinstance(fetched, RotatedKV)
    assert fetched.ends == (4, 10, 1)
    assert fetched.length == 10 and fetched.key_codes.shape[:3] == (3, H, 256)
    for i, row in enumerate(twin.alone):  # row i's bytes start at position 0
        for name, want in row.written().items():
            got = getattr(fetched, name)[i:i + 1, :, :fetched.ends[i]]
            assert mx.array_equal(got, want), (i, name)


def test_delayed_slots_convert_at_the_actual_offset_after_a_crossing_block():
    twin = Twin(KINDS["delayed-k4v4-fused"], [4, 0])
    fetched = twin.step(3)  # row 0 crosses START inside the block: appended plain
    assert isinstance(fetched, mx.array) and twin.batch.converted == [False, False]
    twin.batch.trim_rows([1, 0])  # a rejected token: no boundary is set
    for row, a in zip(twin.alone, [1, 0]):
        row.trim(a)
    fetched = twin.step(1)  # converts at its retained offset, 6
    assert isinstance(fetched, MixedRowsKV)
    assert twin.batch.converted == [True, False] and twin.batch.minimum_reusable_offsets == [6, 0]
    assert twin.alone[0].minimum_reusable_offset == 6
    twin.check_bytes()


def test_capacity_doubles_with_joins_and_shrinks_after_retirements():
    twin = Twin(KINDS["tq-k4v4-fused"], [520, 2])
    for n in range(6):
        twin.join(3 + n)
    stats = twin.batch.slots.statistics()
    assert (stats.num_rows, stats.row_capacity, stats.position_capacity) == (8, 8, 768)
    twin.step(1)
    twin.retire([0, 2, 3, 4, 5, 6])  # the 520-position row and five more leave
    stats = twin.batch.slots.statistics()
    assert (stats.num_rows, stats.row_capacity, stats.position_capacity) == (2, 4, 256)
    assert stats.num_shrinks == 1 and twin.batch.nbytes == 4 * 256 * H * 68  # k4v4, D 64
    twin.step(1)
    twin.check_bytes()


def test_slot_rows_refuse_bad_input():
    rows = SlotRows()
    rows.add_rows([{"a": mx.zeros((1, 2, 3, 4))}, None])
    assert rows.lengths == [3, 0] and rows.statistics().row_capacity == 2
    with pytest.raises(ValueError, match="blocks must be"):
        rows.append({"a": mx.zeros((3, 2, 1, 4))})
    with pytest.raises(ValueError, match="does not fit"):
        rows.append({"a": mx.zeros((2, 2, 1, 5))})
    with pytest.raises(ValueError, match="not distinct"):
        rows.take([0, 0])
    with pytest.raises(TypeError):
        slot_batch(TurboQuantKVCache(4, 4, D)).extend(AffineKVCache(8, 64))
    tq = slot_batch(TurboQuantKVCache(4, 4, D))
    with pytest.raises(ValueError, match="cannot combine"):
        tq.extend(TurboQuantKVCache(4, 3, D))
