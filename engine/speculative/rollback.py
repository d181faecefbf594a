"""Per-row rollback of rejected speculative positions, for every batch cache kind.

`trim_rows(cache, amounts)` drops the last amounts[i] positions of batch row i. Contract
(the same for every kind): one amount per row, 0 <= amounts[i] <= what row i may lose
(its length; a delayed TurboQuant row's length minus its `minimum_reusable_offset`), else
ValueError; afterwards row i holds length_i - amounts[i] positions and its kept bytes
are unchanged. Every batch the runner speculates on keeps its rows in slots
(engine/kv/slots.py), whose `trim_rows` lowers lengths and moves no byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def trim_rows(cache: Any, amounts: Sequence[int]) -> None:
    """Drop the last amounts[i] positions of row i of one layer's batch cache (see the
    module doc for the contract). TypeError for a cache kind that cannot do it."""
    if not hasattr(cache, "trim_rows"):
        raise TypeError(f"{type(cache).__name__} cannot roll back rows one by one")
    amounts = [int(a) for a in amounts]
    lengths = getattr(cache, "lengths", None)
    if lengths is not None and (len(amounts) != len(lengths) or any(
            not 0 <= a <= n for a, n in zip(amounts, lengths))):
        # (the plain slot batch's own trim_rows clamps; a rollback never may)
        raise ValueError(f"cannot trim {amounts} from rows holding {list(lengths)}")
    cache.trim_rows(amounts)


def trim_batch_rows(caches: Sequence[Any], amounts: Sequence[int]) -> None:
    """`trim_rows` on every layer's cache."""
    for cache in caches:
        trim_rows(cache, amounts)
