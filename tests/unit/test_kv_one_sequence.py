"""SlotRows as one sequence's store (one row, or a block of rows written together: what a
one-row cache holds), checked against a numpy model: growth, extract, trim, `holding`."""

import mlx.core as mx
import numpy as np
import pytest

from tqserve.engine.kv.slot_rows import STEP, SlotRows

HEADS = 2


def _block(rng: np.random.Generator, num_rows: int, length: int) -> dict[str, mx.array]:
    """A codes-like uint32 plane and a norms-like float16 plane."""
    codes = rng.integers(0, 2**32, (num_rows, HEADS, length, 3), dtype=np.uint32)
    norms = rng.standard_normal((num_rows, HEADS, length, 1)).astype(np.float16)
    return {"codes": mx.array(codes), "norms": mx.array(norms)}


def _row(rows: SlotRows, i: int) -> dict[str, np.ndarray]:
    """Row i's written planes, read directly from the valid region."""
    return {n: np.array(a[i : i + 1]) for n, a in rows.fetch().items()}


def _assert_rows(rows: SlotRows, expected: list[dict[str, np.ndarray]]) -> None:
    assert rows.num_rows == len(expected)
    for i, want in enumerate(expected):
        got = _row(rows, i)
        assert set(got) == set(want)
        for name in want:
            assert got[name].dtype == want[name].dtype
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"row {i} {name}")
        assert rows.lengths[i] == want["codes"].shape[2]


def _grow(expected: list[dict[str, np.ndarray]], block: dict[str, mx.array]) -> None:
    for i, row in enumerate(expected):
        for n, a in block.items():
            row[n] = np.concatenate([row[n], np.array(a[i : i + 1])], axis=2)


def _written(rng: np.random.Generator, num_rows: int,
             chunks: list[int]) -> tuple[SlotRows, list[dict[str, np.ndarray]]]:
    """Rows written together, chunk by chunk, and their numpy model."""
    rows = SlotRows.holding({}, num_rows)
    expected = [{"codes": np.zeros((1, HEADS, 0, 3), np.uint32),
                 "norms": np.zeros((1, HEADS, 0, 1), np.float16)} for _ in range(num_rows)]
    for length in chunks:
        block = _block(rng, num_rows, length)
        rows.append(block)
        _grow(expected, block)
    return rows, expected


def test_append_grows_in_steps_and_nbytes_counts_allocation() -> None:
    rng = np.random.default_rng(0)
    rows = SlotRows.holding({}, 2)
    assert rows.empty and rows.nbytes == 0 and rows.lengths == [0, 0]
    rows.append(_block(rng, 2, 5))
    per_position = 2 * HEADS * (3 * 4 + 2)  # rows * heads * (3 uint32 + 1 float16)
    assert rows.planes()["codes"].shape[2] == STEP
    assert rows.nbytes == STEP * per_position
    rows.append(_block(rng, 2, STEP - 5))
    assert rows.nbytes == STEP * per_position
    rows.append(_block(rng, 2, 1))
    assert rows.planes()["norms"].shape[2] == 2 * STEP and rows.lengths == [STEP + 1] * 2
    rows.append(_block(rng, 2, 600))  # one block of 600 grows by the steps it needs at once
    assert rows.planes()["codes"].shape[2] == 4 * STEP


def test_append_extract_trim_against_model() -> None:
    rng = np.random.default_rng(1)
    rows, expected = _written(rng, 3, [4, 5, 1, 2])
    assert rows.lengths == [12] * 3
    _assert_rows(rows, expected)

    extracted = rows.extract(1)
    assert {n: a.shape for n, a in extracted.items()} == {
        "codes": (1, HEADS, 12, 3), "norms": (1, HEADS, 12, 1)}
    np.testing.assert_array_equal(np.array(extracted["codes"]), expected[1]["codes"])
    np.testing.assert_array_equal(np.array(extracted["norms"]), expected[1]["norms"])

    rows.trim_rows([3] * 3)
    assert rows.lengths == [9] * 3
    expected = [{n: a[:, :, :-3] for n, a in e.items()} for e in expected]
    _assert_rows(rows, expected)
    block = _block(rng, 3, 2)  # written over the trimmed positions
    rows.append(block)
    _grow(expected, block)
    _assert_rows(rows, expected)
    with pytest.raises(ValueError, match="cannot trim"):  # never past what is written
        rows.trim_rows([12] * 3)
    rows.trim_rows([11] * 3)
    assert not rows.empty and all(a.shape[2] == 0 for a in rows.fetch().values())


def test_holding_round_trip_is_byte_exact() -> None:
    rng = np.random.default_rng(2)
    rows, expected = _written(rng, 2, [3, 7])
    back = SlotRows.holding(rows.extract(1))
    assert back.num_rows == 1 and back.lengths == [10]
    _assert_rows(back, [expected[1]])
    block = _block(rng, 1, 4)  # the exactly sized planes grow to whole steps on the next append
    back.append(block)
    _grow(expected[1:], block)
    _assert_rows(back, [expected[1]])
    assert back.planes()["codes"].shape[2] == STEP
    empty = SlotRows.holding({})
    assert empty.empty and empty.num_rows == 1 and empty.lengths == [0]


def test_invalid_blocks_and_indices_raise() -> None:
    rng = np.random.default_rng(5)
    rows, _ = _written(rng, 1, [2])
    with pytest.raises(ValueError, match="planes"):
        rows.append({"codes": mx.zeros((1, HEADS, 1, 3), mx.uint32)})
    with pytest.raises(ValueError, match="does not fit"):
        rows.append({"codes": mx.zeros((1, HEADS, 1, 4), mx.uint32),
                     "norms": mx.zeros((1, HEADS, 1, 1), mx.float16)})
    with pytest.raises(ValueError, match="one L"):
        rows.append({"codes": mx.zeros((1, HEADS, 1, 3), mx.uint32),
                     "norms": mx.zeros((1, HEADS, 2, 1), mx.float16)})
    with pytest.raises(ValueError, match="n=1"):
        rows.append(_block(rng, 2, 1))
    with pytest.raises(ValueError, match="outside"):
        rows.extract(3)
    with pytest.raises(ValueError, match="one B, H, T"):
        SlotRows.holding({"codes": mx.zeros((1, HEADS, 2, 3), mx.uint32),
                                  "norms": mx.zeros((1, HEADS, 3, 1), mx.float16)})
    with pytest.raises(ValueError, match="one B, H, T"):
        SlotRows.holding({"codes": mx.zeros((HEADS, 2, 3), mx.uint32)})
