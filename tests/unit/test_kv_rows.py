"""KvTensorRows: shared row positions over arbitrary planes, checked against a numpy model."""

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
    """Row i's written, unpadded planes, read directly from the valid region."""
    start = rows.left_padding[i]
    return {n: np.array(a[i : i + 1, :, start:]) for n, a in rows.valid_planes().items()}


def _assert_rows(rows: KvTensorRows, expected: list[dict[str, np.ndarray]]) -> None:
    assert rows.num_rows == len(expected)
    for i, want in enumerate(expected):
        got = _row(rows, i)
        assert set(got) == set(want)
        for name in want:
            assert got[name].dtype == want[name].dtype
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"row {i} {name}")
        assert rows.offsets[i] == want["codes"].shape[2]


def _grow(expected: dict[str, np.ndarray], block: dict[str, mx.array], i: int) -> None:
    for n, a in block.items():
        expected[n] = np.concatenate([expected[n], np.array(a[i : i + 1])], axis=2)


def _single(rng: np.random.Generator, length: int) -> tuple[KvTensorRows, dict]:
    rows = KvTensorRows()
    block = _block(rng, 1, length)
    rows.append(block)
    return rows, {n: np.array(a) for n, a in block.items()}


def test_append_grows_in_steps_and_nbytes_counts_allocation() -> None:
    rng = np.random.default_rng(0)
    rows = KvTensorRows([0, 0])
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


def test_merge_filter_extend_extract_trim_against_model() -> None:
    rng = np.random.default_rng(1)
    singles = [_single(rng, n) for n in (4, 9, 1)]
    rows = KvTensorRows.merge([r for r, _ in singles])
    expected = [e for _, e in singles]
    assert rows.left_padding == (5, 0, 8) and rows.idx == 9
    _assert_rows(rows, expected)
    for _ in range(3):
        block = _block(rng, 3, 2)
        rows.append(block)
        for i in range(3):
            _grow(expected[i], block, i)
    _assert_rows(rows, expected)

    rows.filter([2, 0])  # drop the longest row, reorder: shared padding shifts away
    expected = [expected[2], expected[0]]
    assert rows.left_padding == (3, 0) and rows.idx == 10
    _assert_rows(rows, expected)

    other, other_expected = _single(rng, 14)
    rows.extend(other)
    expected.append(other_expected)
    assert rows.left_padding == (7, 4, 0)
    _assert_rows(rows, expected)

    extracted = rows.extract(1)
    assert {n: a.shape for n, a in extracted.items()} == {
        "codes": (1, HEADS, 10, 3), "norms": (1, HEADS, 10, 1)}
    np.testing.assert_array_equal(np.array(extracted["codes"]), expected[1]["codes"])

    assert rows.trim(3) == 3
    expected = [{n: a[:, :, :-3] for n, a in e.items()} for e in expected]
    _assert_rows(rows, expected)
    assert rows.offsets == (4, 7, 11)
    assert rows.trim(100) == 4 and rows.offsets == (0, 3, 7)  # clamped to the shortest row


def test_readmission_round_trip_is_byte_exact() -> None:
    rng = np.random.default_rng(2)
    singles = [_single(rng, n) for n in (3, 7)]
    rows = KvTensorRows.merge([r for r, _ in singles])
    back = KvTensorRows.from_planes(rows.extract(0))
    rows.filter([1])
    rows.extend(back)
    _assert_rows(rows, [singles[1][1], singles[0][1]])


def test_prepare_and_finalize_move_right_padding_left() -> None:
    rng = np.random.default_rng(3)
    rows = KvTensorRows([0, 0])
    rows.prepare(right_padding=[2, 0])
    block = _block(rng, 2, 5)  # row 0's last two positions are padding tokens
    rows.append(block)
    rows.finalize()
    assert rows.left_padding == (2, 0) and rows.offsets == (3, 5)
    np.testing.assert_array_equal(np.array(rows.valid_planes()["codes"][0, :, 2:]),
                                  np.array(block["codes"][0, :, :3]))
    empty = KvTensorRows([0, 1])
    empty.prepare(left_padding=[3, 0])
    assert empty.left_padding == (3, 1)
    with pytest.raises(ValueError, match="empty"):
        rows.prepare(left_padding=[1, 1])


def test_pad_to_and_unpad() -> None:
    rng = np.random.default_rng(4)
    rows, expected = _single(rng, 4)
    rows.pad_to(9)
    assert rows.left_padding == (5,) and rows.idx == 9
    _assert_rows(rows, [expected])
    rows.unpad(5)
    assert rows.left_padding == (0,) and rows.idx == 4
    with pytest.raises(ValueError, match="cannot drop"):
        rows.unpad(1)
    with pytest.raises(ValueError, match="cannot pad"):
        rows.pad_to(3)
    zero = KvTensorRows([])
    zero.pad_to(6)
    assert zero.idx == 6 and zero.trim(2) == 2 and zero.idx == 4


def test_invalid_blocks_and_indices_raise() -> None:
    rng = np.random.default_rng(5)
    rows, _ = _single(rng, 2)
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
        rows.filter([1])
    with pytest.raises(ValueError, match="outside"):
        rows.extract(3)
    with pytest.raises(ValueError, match=">= 0"):
        KvTensorRows([-1])
    with pytest.raises(ValueError, match="planes"):
        KvTensorRows.merge([rows, KvTensorRows.from_planes({"other": mx.zeros((1, 1, 1, 1))})])
