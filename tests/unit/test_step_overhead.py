"""Per-step host work: the ops a decode step builds (tools.step_ops). Rows of equal length
(a single row, a burst of equal prompts) decode in slots with no more ops than mlx-lm's
KVCache (one slice update per layer, no mask); uneven rows with fewer than mlx-lm's
BatchKVCache."""

import json

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

from tqserve.engine.kv.slots import RowSlotsKVCache
from tqserve.engine.model import DEFAULT_MODEL
from tqserve.tools.step_ops import main, measure

H, D = 2, 8


def _row(length: int, seed: int) -> KVCache:
    cache = KVCache()
    k = mx.random.normal((1, H, length, D), key=mx.random.key(seed))
    cache.update_and_fetch(k, k * 2)
    return cache


def test_equal_lengths_decode_without_a_mask_and_attend_the_same():
    equal = RowSlotsKVCache.merge([_row(5, 1), _row(5, 2)])
    assert equal.make_mask(1) is None and RowSlotsKVCache.merge([_row(3, 1)]).make_mask(1) is None
    assert equal.make_mask(2).shape == (2, 1, 2, 7)  # a block of positions keeps causality
    uneven = RowSlotsKVCache.merge([_row(5, 1), _row(3, 2)])
    assert uneven.make_mask(1).shape == (2, 1, 1, 6)
    q = mx.random.normal((2, H, 1, D), key=mx.random.key(9))
    keys, values = equal.update_and_fetch(q, q)
    full = mx.ones((2, 1, 1, keys.shape[2]), dtype=mx.bool_)
    plain = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.5, mask=None)
    masked = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.5, mask=full)
    assert mx.array_equal(plain, masked)


def test_single_row_slots_decode_matches_mlx_lm_bit_for_bit(draft_model):
    """One row in slots (no mask) against mlx-lm's own KVCache: equal logits, 8 steps."""
    model = draft_model.model
    prompt = mx.array([[5, 17, 301, 42, 7, 99, 1000, 12]])
    ref = make_prompt_cache(model)
    model(prompt, cache=ref)
    single = make_prompt_cache(model)
    model(prompt, cache=single)
    slots = [RowSlotsKVCache.merge([c]) for c in single]
    token = mx.array([[3]])
    for _ in range(8):
        want = model(token, cache=ref)[:, -1]
        got = model(token, cache=slots)[:, -1]
        assert mx.array_equal(want, got)
        token = mx.argmax(want, axis=-1)[:, None]


def test_a_decode_step_in_slots_builds_no_more_ops_than_mlx_lm(draft_model):
    ops = measure(draft_model.model, 4)
    assert list(ops) == ["single", "B4 equal", "B4 uneven"]
    assert ops["single"]["tqserve"] <= ops["single"]["mlx_lm"], ops
    assert ops["B4 equal"]["tqserve"] < ops["B4 equal"]["mlx_lm"], ops
    assert ops["B4 uneven"]["tqserve"] < ops["B4 uneven"]["mlx_lm"], ops
    # equal lengths: the ops of a single row; uneven ones add the mask and, per layer, the
    # scatter of keys and values (3 ops each, their index arrays shared by all layers)
    assert ops["B4 equal"]["tqserve"] == ops["single"]["tqserve"], ops
    extra = ops["B4 uneven"]["tqserve"] - ops["B4 equal"]["tqserve"]
    assert 0 < extra <= 20 * draft_model.num_layers, ops


def test_step_ops_tool_writes_the_counts(tmp_path, capsys):
    out = tmp_path / "ops.json"
    assert main(["--model", str(DEFAULT_MODEL), "--batch", "3", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["model"] == DEFAULT_MODEL.name and report["dtype"] == "float32"
    assert set(report["ops"]) == {"single", "B3 equal", "B3 uneven"}
    assert all(v["tqserve"] > 0 and v["mlx_lm"] > 0 for v in report["ops"].values())
    assert "B3 uneven: tqserve" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["--batch", "1"])
    assert exc.value.code == 2
