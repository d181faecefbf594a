"""KvTensorRows: one write index over arbitrary planes (one sequence, or a block of rows
written together), checked against a numpy model: growth, extract, trim, from_planes."""

import mlx.core as mx
import numpy as np
import pytest

from tqserve.engine.kv.rows import STEP, KvTensorRows

HEADS = 2


def _block(rng: np.random.Generator, num_rows: int, length: int) -> dict[str, mx.array]:
    """A codes-like uint32 plane and a norms-like float16 plane."""
    codes = rng.integers(0, 2**32, (num_rows, HEADS, length, 3), dtype=np.uint32)
    norms = rng.standard_normal((num_rows, HEADS, length, 1)).astype(np.float16)
    return {"codes": mx.array(codes), "norms": mx.array(norms)}


def _row(rows: KvTensorRows, i: int) -> dict[str, np.ndarray]:
    """Row i's written planes, read directly from the valid region."""
    return {n: np.array(a[i : i + 1]) for n, a in rows.valid_planes().items()}


def _assert_rows(rows: KvTensorRows, expected: list[dict[str, np.ndarray]]) -> None:
    assert rows.num_rows == len(expected)
    for i, want in enumerate(expected):
        got = _row(rows, i)
        assert set(got) == set(want)
        for name in want:
            assert got[name].dtype == want[name].dtype
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"row {i} {name}")
        assert rows.idx == want["codes"].shape[2]


def _grow(expected: list[dict[str, np.ndarray]], block: dict[str, mx.array]) -> None:
    for i, row in enumerate(expected):
        for n, a in block.items():
            row[n] = np.concatenate([row[n], np.array(a[i : i + 1])], axis=2)


def _written(rng: np.random.Generator, num_rows: int,
             chunks: list[int]) -> tuple[KvTensorRows, list[dict[str, np.ndarray]]]:
    """Rows written together, chunk by chunk, and their numpy model."""
    rows = KvTensorRows(num_rows)
    expected = [{"codes": np.zeros((1, HEADS, 0, 3), np.uint32),
                 "norms": np.zeros((1, HEADS, 0, 1), np.float16)} for _ in range(num_rows)]
    for length in chunks:
        block = _block(rng, num_rows, length)
        rows.append(block)
        _grow(expected, block)
    return rows, expected


def test_append_grows_in_steps_and_nbytes_counts_allocation() -> None:
    rng = np.random.default_rng(0)
    rows = KvTensorRows(2)
    assert rows.empty and rows.nbytes == 0
    rows.append(_block(rng, 2, 5))
    per_position = 2 * HEADS * (3 * 4 + 2)  # rows * heads * (3 uint32 + 1 float16)
    assert rows.planes["codes"].shape[2] == STEP
    assert rows.nbytes == STEP * per_position
    rows.append(_block(rng, 2, STEP - 5))
    assert rows.nbytes == STEP * per_position
    rows.append(_block(rng, 2, 1))
    assert rows.planes["norms"].shape[2] == 2 * STEP and rows.idx == STEP + 1
    rows.append(_block(rng, 2, 600))  # one block of 600 grows by three steps at once
    assert rows.planes["codes"].shape[2] == STEP + 1 + 3 * STEP


def test_append_extract_trim_against_model() -> None:
    rng = np.random.default_rng(1)
    rows, expected = _written(rng, 3, [4, 5, 1, 2])
    assert rows.idx == 12
    _assert_rows(rows, expected)

    extracted = rows.extract(1)
    assert {n: a.shape for n, a in extracted.items()} == {
        "codes": (1, HEADS, 12, 3), "norms": (1, HEADS, 12, 1)}
    np.testing.assert_array_equal(np.array(extracted["codes"]), expected[1]["codes"])
    np.testing.assert_array_equal(np.array(extracted["norms"]), expected[1]["norms"])

    assert rows.trim(3) == 3 and rows.idx == 9
    expected = [{n: a[:, :, :-3] for n, a in e.items()} for e in expected]
    _assert_rows(rows, expected)
    block = _block(rng, 3, 2)  # written over the trimmed positions
    rows.append(block)
    _grow(expected, block)
    _assert_rows(rows, expected)
    assert rows.trim(100) == 11 and rows.idx == 0  # clamped to what is written
    assert not rows.empty and all(a.shape[2] == 0 for a in rows.valid_planes().values())


def test_from_planes_round_trip_is_byte_exact() -> None:
    rng = np.random.default_rng(2)
    rows, expected = _written(rng, 2, [3, 7])
    back = KvTensorRows.from_planes(rows.extract(1))
    assert back.num_rows == 1 and back.idx == 10
    _assert_rows(back, [expected[1]])
    block = _block(rng, 1, 4)  # the exactly sized planes grow by a step on the next append
    back.append(block)
    _grow(expected[1:], block)
    _assert_rows(back, [expected[1]])
    assert back.planes["codes"].shape[2] == 10 + STEP
    empty = KvTensorRows.from_planes({})
    assert empty.empty and empty.num_rows == 1 and empty.idx == 0


def test_invalid_blocks_and_indices_raise() -> None:
    rng = np.random.default_rng(5)
    rows, _ = _written(rng, 1, [2])
    with pytest.raises(ValueError, match="planes"):
        rows.append({"codes": mx.zeros((1, HEADS, 1, 3), mx.uint32)})
    with pytest.raises(ValueError, match="block"):
        rows.append({"codes": mx.zeros((1, HEADS, 1, 4), mx.uint32),
                     "norms": mx.zeros((1, HEADS, 1, 1), mx.float16)})
    with pytest.raises(ValueError, match="one L"):
        rows.append({"codes": mx.zeros((1, HEADS, 1, 3), mx.uint32),
                     "norms": mx.zeros((1, HEADS, 2, 1), mx.float16)})
    with pytest.raises(ValueError, match="B=1"):
        rows.append(_block(rng, 2, 1))
    with pytest.raises(ValueError, match="outside"):
        rows.extract(3)
    with pytest.raises(ValueError, match=">= 1"):
        KvTensorRows(0)
    with pytest.raises(ValueError, match="one B, H, T"):
        KvTensorRows.from_planes({"codes": mx.zeros((1, HEADS, 2, 3), mx.uint32),
                                  "norms": mx.zeros((1, HEADS, 3, 1), mx.float16)})
    with pytest.raises(ValueError, match="one B, H, T"):
        KvTensorRows.from_planes({"codes": mx.zeros((HEADS, 2, 3), mx.uint32)})
