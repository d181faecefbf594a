"""A converted delayed-TurboQuant donor is never reused below its minimum_reusable_offset,
from RAM or SSD; the earlier plain donors of the same prefix still are (cached_tokens):
A's, and B's prompt snapshot (published when B's prefill completed, before B converted)."""

from __future__ import annotations

import pytest

from tqserve.actors.engine import open_engine
from tqserve.engine.config import Config
from tests.e2e.test_prefix_cache import run_all, settle
from tqserve.engine.sampling import SamplingParams

A = tuple(range(100, 110))                       # 10 tokens: stays plain (start 16)
B = A + tuple(range(200, 220))                   # 30 tokens: converts at 29
C = B[:20] + tuple(range(300, 305))              # shares 20 with B, 10 with A

D = B[:29] + (400, 401)                          # shares 29 with B: at its boundary


def params(n):
    return SamplingParams(max_tokens=n, temperature=0.0)


@pytest.mark.parametrize("tier", ["ram", "ssd"])
async def test_boundary_respected_plain_donor_used(draft_model, tmp_path, tier):
    config = Config(turboquant="k4v4", quantized_kv_start=16, max_batch=4,
                    cache_dir=str(tmp_path), ram_cache_bytes=1 if tier == "ssd" else 1 << 30)
    async with open_engine(config, loaded=draft_model) as engine:
        first = await run_all(engine, [(A, params(3)), (B, params(3))], 1)
        await settle(engine)  # the last spill is ordered on the step after B's release
    if tier == "ram":  # (with a 1-byte budget A may still be on its way to disk)
        assert first[1][2].cached_tokens == 10  # B reused A's plain prefix
    async with open_engine(config, loaded=draft_model) as engine:
        if tier == "ram":
            await run_all(engine, [(A, params(3)), (B, params(3))], 1)
        (c, d) = await run_all(engine, [(C, params(2)), (D, params(2))], 1)
        stats = engine.statistics().prefix_cache
    # C: B's plain prompt snapshot (29 tokens, boundary 0) serves 20; B's converted
    # snapshot (boundary 29) could not.
    assert c[2].cached_tokens == 20 and c[2].cached_tokens_by_tier[tier] == 20
    assert d[2].cached_tokens == 29 and d[2].cached_tokens_by_tier[tier] == 29
    assert stats.misses == 0, stats
