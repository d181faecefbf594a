"""Recurrent state ("state" layers, mlx-lm ArraysCache) in snapshots: exact boundary only.

A qwen3_5 row (gated delta-net + full attention layers, tests/matrix.py) prefilled on its
own caches is snapshotted, turned into planes, checked against the model's probed layout
and rebuilt: the rebuilt row continues exactly as the original; it is reusable at its
full length only; a state plane of the wrong shape is refused before it is decoded.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from tests import matrix
from tqserve.engine.model import load_model
from tqserve.engine.snapshot import (from_planes, layer_kinds_text, row_from_snapshot,
                                     snapshot_kinds, snapshot_of_row, to_planes)
from tqserve.engine.snapshot_layout import plane_layout


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return load_model(matrix.build(tmp_path_factory.mktemp("m"), "qwen3_5"), "float32")


def _planes_by_name(snapshot):
    return {name: (data, shape, dtype) for name, data, shape, dtype in to_planes(snapshot)}


def test_a_hybrid_row_round_trips_and_continues_exactly(hybrid):
    model = hybrid.model
    prompt = mx.array([hybrid.tokenizer.encode("def add(a, b):\n    return a + b\n")])
    caches = make_prompt_cache(model)
    model(prompt, cache=caches)
    snap = snapshot_of_row(caches)
    assert snap is not None and "state" in snap.kinds and "kv" in snap.kinds
    assert snap.minimum_reusable_offset == snap.offset == prompt.shape[1]
    layout = plane_layout(model, make_prompt_cache(model))
    rebuilt = from_planes(make_prompt_cache(model), layer_kinds_text(snap), snap.offset,
                          snap.minimum_reusable_offset, _planes_by_name(snap), layout)
    assert rebuilt.minimum_reusable_offset == snap.offset
    nxt = mx.array([[17]])
    want = model(nxt, cache=row_from_snapshot(snap, snap.offset))
    got = model(nxt, cache=row_from_snapshot(rebuilt, rebuilt.offset))
    assert mx.array_equal(want, got).item()
    with pytest.raises(ValueError, match="cannot reuse"):
        row_from_snapshot(snap, snap.offset - 1)  # recurrent state has no shorter prefix


def test_a_state_plane_of_the_wrong_shape_is_refused(hybrid):
    model = hybrid.model
    caches = make_prompt_cache(model)
    model(mx.array([[1, 2, 3]]), cache=caches)
    snap = snapshot_of_row(caches)
    planes = _planes_by_name(snap)
    name = next(n for n in planes if n.endswith(".s1"))
    data, shape, dtype = planes[name]
    planes[name] = (data + data, (2, *shape[1:]), dtype)
    layout = plane_layout(model, make_prompt_cache(model))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        from_planes(make_prompt_cache(model), layer_kinds_text(snap), snap.offset,
                    snap.minimum_reusable_offset, planes, layout)


def test_recurrent_layers_only_cannot_be_snapshotted(tmp_path):
    mamba = load_model(matrix.build(tmp_path, "mamba2"), "float32")
    assert snapshot_kinds(make_prompt_cache(mamba.model)) is None
