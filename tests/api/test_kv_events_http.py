"""GET /v1/kv_events on a real server: the blocks of what the prefix cache holds."""

from __future__ import annotations

from typing import Any

import httpx
import trio

from tests.api.wsclient import run_alone, wait_stats
from tests.conftest import Server, start_server
from tqserve.engine.kvevents import block_hashes

POLLS = 200  # /v1/kv_events reads while the step after a request's end is absorbed


def prompt_of(seed: int, n: int = 45) -> list[int]:
    return [(7 * i + seed) % 1000 + 100 for i in range(n)]


async def cached_tokens(server: Server, prompt: list[int]) -> list[int]:
    """Run `prompt` (greedy, 6 tokens); the tokens its released row's snapshot covers:
    the prompt and every generated token but the last (whose KV was never computed)."""
    result = await run_alone(server.ws_url, "r", prompt_tokens=prompt, max_tokens=6,
                             temperature=0)
    assert result.end["finish_reason"] == "length" and len(result.token_ids) == 6
    return prompt + result.token_ids[:-1]


async def events_until(raw: httpx.AsyncClient, url: str, num_blocks: int,
                       since: int = 0) -> dict[str, Any]:
    """Poll (bounded) until the cache holds `num_blocks` blocks; the page after `since`."""
    await wait_stats(raw, url, rows_active=0, rows_queued=0)
    for _ in range(POLLS):
        response = await raw.get(url + "/v1/kv_events", params={"since": since})
        assert response.status_code == 200
        page = response.json()
        if page["num_blocks"] == num_blocks:
            return page
        await trio.sleep(0.02)
    raise AssertionError(f"never {num_blocks} blocks: {page}")


def of_type(page: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [e for b in page["batches"] for e in b["events"] if e["type"] == kind]


async def test_blocks_of_the_cached_entry_paging_and_bad_since(nursery, big_model):
    server = await start_server(nursery, big_model)
    prompt = prompt_of(3)
    tokens = await cached_tokens(server, prompt)
    expected = block_hashes(tokens, 16)
    assert len(expected) == 3  # 50 tokens: 3 whole blocks
    async with httpx.AsyncClient(timeout=60) as raw:
        page = await events_until(raw, server.url, len(expected))
        assert page["block_size"] == 16 and page["complete"] is True
        stored = of_type(page, "BlockStored")
        assert of_type(page, "BlockRemoved") == []  # the prompt's snapshot was superseded
        assert [h for e in stored for h in e["block_hashes"]] == list(expected)
        assert [t for e in stored for t in e["token_ids"]] == tokens[:48]
        parent = None
        for event in stored:  # each run hangs off the block before it
            assert event["parent_block_hash"] == parent
            assert (event["block_size"], event["lora_id"], event["medium"]) == (16, None, None)
            parent = event["block_hashes"][-1]
        seqs = [b["seq"] for b in page["batches"]]
        assert seqs == list(range(1, page["next"] + 1))
        assert all(b["ts"] > 1e9 for b in page["batches"])  # wall-clock seconds
        later = (await raw.get(server.url + "/v1/kv_events",
                               params={"since": page["next"]})).json()
        assert later["batches"] == [] and later["complete"] is True
        assert later["next"] == page["next"] and later["num_blocks"] == 3
        for bad in ("abc", "-1", "1.5", ""):
            response = await raw.get(server.url + "/v1/kv_events", params={"since": bad})
            assert response.status_code == 400, bad
            error = response.json()["error"]
            assert error["param"] == "since" and "since" in error["message"]


async def test_ram_eviction_removes_the_evicted_entrys_blocks(nursery, big_model):
    roomy = await start_server(nursery, big_model)
    first = prompt_of(3)
    async with httpx.AsyncClient(timeout=60) as raw:
        await cached_tokens(roomy, first)
        await events_until(raw, roomy.url, 3)
        one_entry = (await raw.get(roomy.url + "/v1/stats")).json()["prefix_cache"]["ram_bytes"]
        assert one_entry > 0
        # room for one entry, not two; no --cache-dir: an evicted entry is gone
        tight = await start_server(nursery, big_model, ram_cache_bytes=one_entry * 3 // 2)
        old = await cached_tokens(tight, first)
        page = await events_until(raw, tight.url, 3)
        cursor = page["next"]
        new = await cached_tokens(tight, prompt_of(500))  # shares no block with `first`
        page = await events_until(raw, tight.url, 3, since=cursor)
        assert page["complete"] is True
        removed = [h for e in of_type(page, "BlockRemoved") for h in e["block_hashes"]]
        assert removed == list(block_hashes(old, 16))
        stored = [h for e in of_type(page, "BlockStored") for h in e["block_hashes"]]
        assert stored == list(block_hashes(new, 16))
        # the eviction is netted into the batch of the publish that caused it
        [batch] = [b for b in page["batches"]
                   if any(e["type"] == "BlockRemoved" for e in b["events"])]
        assert [e["type"] for e in batch["events"]] == ["BlockRemoved", "BlockStored"]
        stats = (await raw.get(tight.url + "/v1/stats")).json()["prefix_cache"]
        assert stats["ram_entries"] == 1 and stats["ssd_entries"] == 0


async def test_prefix_cache_off_is_404_behind_the_same_auth(nursery, draft_model):
    server = await start_server(nursery, draft_model, prefix_cache=False, api_key="k")
    async with httpx.AsyncClient(timeout=60) as raw:
        for path in ("/v1/stats", "/v1/kv_events"):
            assert (await raw.get(server.url + path)).status_code == 401
        response = await raw.get(server.url + "/v1/kv_events",
                                 headers={"Authorization": "Bearer k"})
        assert response.status_code == 404
        assert "prefix cache is off" in response.json()["error"]["message"]
