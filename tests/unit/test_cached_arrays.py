"""Arrays kept in module-level caches hold data, not a graph.

MLX ties an unevaluated array to the stream of the thread that built it; evaluating it on
another thread raises "There is no Stream(...) in current thread". The engine's runner is a
thread, and a process may open one engine after another (tests do, embedders may), so an
array cached by the first runner thread must still be usable by the next one. The CUDA
fidelity run on the H200 found `_ones` failing exactly so (8 kernel tests after the suite).
"""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest

from tqserve.engine.attention import cuda_decode
from tqserve.engine.attention import sdpa as attention
from tqserve.engine.kv import slot_rows

BUILDERS = {
    "cuda_decode._ones": (cuda_decode._ones, (128,)),
    "cuda_decode._scalar": (cuda_decode._scalar, (0.125,)),
    "cuda_decode._tables": (cuda_decode._tables, (128, 4)),
    "cuda_decode._meta": (cuda_decode._meta, (64, 32, 64, (0, 10, 3, 64))),
    "cuda_decode._counters_of": (cuda_decode._counters_of, (8,)),
    "attention._unpack_tables": (attention._unpack_tables, (128, 3)),
    "slot_rows.offsets_array": (slot_rows.offsets_array, ((3, 7),)),
    "slot_rows._write_index": (slot_rows._write_index, ((3, 7), 4, 2)),
}


def _on_another_thread(fn, args):
    box = {}

    def build():
        box["out"] = fn(*args)

    thread = threading.Thread(target=build)
    thread.start()
    thread.join()
    return box["out"]


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_cached_arrays_evaluate_on_any_thread(name):
    fn, args = BUILDERS[name]
    fn.cache_clear()
    try:
        out = _on_another_thread(fn, args)
        arrays = out if isinstance(out, tuple) else (out,)
        mx.eval(*arrays)  # raised "There is no Stream(...)" for a cached graph
        assert all(a.size > 0 for a in arrays)
    finally:
        fn.cache_clear()


def test_write_index_values():
    rows, heads, pos = slot_rows._write_index((3, 7), 4, 2)
    assert rows.shape == heads.shape == pos.shape == (2, 2, 4)
    assert rows.dtype == heads.dtype == pos.dtype == mx.uint32
    assert rows[:, 0, 0].tolist() == [0, 1]
    assert heads[0, :, 0].tolist() == [0, 1]
    assert pos[0, 0].tolist() == [3, 4, 5, 6] and pos[1, 1].tolist() == [7, 8, 9, 10]
