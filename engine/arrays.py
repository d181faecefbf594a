"""Python ints out of MLX integer arrays, typed.

MLX's stubs type `array.item()` as `int | float | complex` and `array.tolist()` as a nested
union of every dtype's result; for an integer array both are ints. These two say so once,
so callers get `int` / `list[int]` instead of a cast at every use.
"""

from __future__ import annotations

from typing import cast

import mlx.core as mx


def item_int(a: mx.array) -> int:
    """The int a one-element integer array holds."""
    return int(cast(int, a.item()))


def int_list(a: mx.array) -> list[int]:
    """The ints of a 1-D integer array, in order."""
    return cast(list[int], a.tolist())
