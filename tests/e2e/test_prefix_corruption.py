"""Corrupt snapshot files are quarantined at restart and served as misses, correctly."""

from __future__ import annotations

import trio

from actors.engine import open_engine
from engine.config import Config
from tests.e2e.test_prefix_cache import assert_same, build_prompts, cold, run_all


async def test_corrupt_files_quarantined_answers_unchanged(draft_model, tmp_path):
    requests = build_prompts(draft_model.tokenizer)[:10]
    want = await cold(draft_model, requests)
    config = Config(max_batch=8, ram_cache_bytes=1, cache_dir=str(tmp_path))
    async with open_engine(config, loaded=draft_model) as engine:
        await run_all(engine, requests, 1)
        await trio.sleep(0.3)
    files = sorted(tmp_path.glob("*.tqsnap"))
    assert len(files) >= 5
    header = bytearray(files[0].read_bytes())
    header[20] ^= 0x01
    files[0].write_bytes(bytes(header))
    payload = bytearray(files[1].read_bytes())
    payload[-5] ^= 0x80
    files[1].write_bytes(bytes(payload))
    files[2].write_bytes(files[2].read_bytes()[:-17])
    a, b = files[3].read_bytes(), files[4].read_bytes()
    files[3].write_bytes(b)
    files[4].write_bytes(a)
    async with open_engine(config, loaded=draft_model) as engine:
        again = await run_all(engine, requests, 1)
        stats = engine.statistics().prefix_cache
    assert_same(again, want)
    assert stats.quarantined == 5, stats
    assert len(list((tmp_path / "quarantine").iterdir())) == 5
    assert not list(tmp_path.glob(".tmp-*"))
