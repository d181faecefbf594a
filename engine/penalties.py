"""OpenAI's sampling adjustments: presence and frequency penalties, logit_bias.

`additive` builds, on the host, one (B, V) float32 array added to a step's logits: for
each row a token's logit loses presence_penalty once the token appeared in the row's
output and frequency_penalty per appearance (OpenAI's definition; the prompt does not
count, unlike repetition_penalty), and gains its logit_bias entry. Rows without any of
them get zeros, so their logits stay bit-equal.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import mlx.core as mx
import numpy as np

MAX_TOKEN_ID = 2**31 - 1
MAX_LOGIT_BIAS = 1024  # entries of one logit_bias (OpenAI documents no bound, vLLM none)


def bias_pairs(value: Any) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, from a {id: bias} map (ids may be the
    strings JSON keys are) or from pairs."""
    items = value.items() if isinstance(value, dict) else value
    try:
        pairs = [(int(t), float(b)) for t, b in items]
    except (TypeError, ValueError):
        raise ValueError("logit_bias must map token ids to numbers") from None
    return tuple(sorted(pairs))


def check_bias(inst: object, attr: attrs.Attribute, value: tuple) -> None:
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, "
                         f"got {len(value)}")
    for token, bias in value:
        if not 0 <= token <= MAX_TOKEN_ID:
            raise ValueError(f"logit_bias keys must be token ids in [0, {MAX_TOKEN_ID}], "
                             f"got {token}")
        if not -100.0 <= bias <= 100.0:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")


def additive(logits: mx.array, rows: Sequence[Any]) -> mx.array:
    """Presence / frequency penalties and logit_bias for every row at once: one (B, V)
    array added to the logits (zeros for rows without them)."""
    vocab = logits.shape[-1]
    add = np.zeros((len(rows), vocab), dtype=np.float32)
    for i, row in enumerate(rows):
        p = row.params
        if row.counts and p.counts_output:
            ids = np.fromiter(row.counts, dtype=np.int64, count=len(row.counts))
            times = np.fromiter(row.counts.values(), dtype=np.float32, count=len(row.counts))
            keep = ids < vocab
            add[i, ids[keep]] -= p.presence_penalty + p.frequency_penalty * times[keep]
        for token, bias in p.logit_bias:
            if token < vocab:
                add[i, token] += bias
    return logits + mx.array(add)
