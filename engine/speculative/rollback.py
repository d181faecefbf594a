"""Per-row rollback of rejected speculative positions, for every batch cache kind.

`trim_rows(cache, amounts)` drops the last amounts[i] positions of batch row i. Contract
(the same for every kind, so a future slot-based batch cache can carry it over): one
amount per row, 0 <= amounts[i] <= what row i may lose (its offset; a delayed TurboQuant
row's offset minus its `minimum_reusable_offset`), else ValueError; afterwards row i holds
offset_i - amounts[i] positions and its kept bytes are unchanged.

Our caches (engine/kv: TurboQuant, affine, delayed) have a `trim_rows` method working on
their encoded planes. mlx-lm's BatchKVCache has none: it is done here the way its own
`finalize` moves right padding, by lowering the shared write index by the smallest amount
and rolling each row's remaining rejected tail into its left padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, dynamic_roll

from tqserve.engine.arrays import int_list


def _trim_batch_kv(cache: BatchKVCache, amounts: list[int]) -> None:
    offsets = int_list(cache.offset)
    if len(amounts) != len(offsets) or any(not 0 <= a <= o for a, o in zip(amounts, offsets)):
        raise ValueError(f"cannot trim {amounts} from rows holding {offsets}")
    shared = min(amounts, default=0)
    cache.trim(shared)
    rest = [a - shared for a in amounts]
    if not any(rest):
        return
    shifts = mx.array(rest)
    if cache.keys is not None:
        cache.keys = dynamic_roll(cache.keys[..., : cache._idx, :], shifts[:, None], axis=2)
        cache.values = dynamic_roll(cache.values[..., : cache._idx, :], shifts[:, None], axis=2)
    cache.offset = cache.offset - shifts
    cache.left_padding = cache.left_padding + shifts


def trim_rows(cache: Any, amounts: Sequence[int]) -> None:
    """Drop the last amounts[i] positions of row i of one layer's batch cache (see the
    module doc for the contract). TypeError for a cache kind that cannot do it."""
    amounts = [int(a) for a in amounts]
    if hasattr(cache, "trim_rows"):
        cache.trim_rows(amounts)
    elif isinstance(cache, BatchKVCache):
        _trim_batch_kv(cache, amounts)
    else:
        raise TypeError(f"{type(cache).__name__} cannot roll back rows one by one")


def trim_batch_rows(caches: Sequence[Any], amounts: Sequence[int]) -> None:
    """`trim_rows` on every layer's cache."""
    for cache in caches:
        trim_rows(cache, amounts)
