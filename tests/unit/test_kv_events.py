"""KV events of the prefix index (engine.kvevents): block hashes, refcounts, netting, ring."""

import hashlib
import itertools
import struct

import pytest

from tqserve.engine.kvevents import (BlockRemoved, BlockStored, KvEventLog, block_digests,
                                     block_hashes)
from tqserve.engine.prefix import PrefixEntry, PrefixIndex, Tier, cache_namespace

NS = cache_namespace("fp", "plain:float32")
B = 16


def entry(key, tokens, nbytes=10, namespace=NS):
    return PrefixEntry(key=key, namespace=namespace, tokens=tuple(tokens),
                       minimum_reusable_offset=0, trimmable=True, num_bytes=nbytes)


def indexed(ram_budget=10_000, capacity=4096):
    ticks = itertools.count(1)  # the injected clock: batch timestamps 1.0, 2.0, ...
    log = KvEventLog(capacity=capacity, clock=lambda: float(next(ticks)))
    return PrefixIndex(ram_budget, log), log


def events(log, since=0):
    return [e for b in log.since(since).batches for e in b.events]


def stored(log, since=0):
    return [h for e in events(log, since) if isinstance(e, BlockStored) for h in e.block_hashes]


def removed(log, since=0):
    return [h for e in events(log, since) if isinstance(e, BlockRemoved) for h in e.block_hashes]


def test_hashes_equal_a_hand_chain_of_whole_blocks():
    tokens = list(range(1000, 1040))  # 2 whole blocks and 8 tokens left over
    first = hashlib.blake2b(b"tokens" + struct.pack("<16q", *tokens[:16]), digest_size=8)
    second = hashlib.blake2b(first.digest() + struct.pack("<16q", *tokens[16:32]),
                             digest_size=8)
    assert block_digests(tokens, 16) == (first.digest(), second.digest())
    assert block_hashes(tokens, 16) == (int.from_bytes(first.digest(), "big"),
                                        int.from_bytes(second.digest(), "big"))
    assert block_hashes(tokens) == block_hashes(tokens, 16)  # BLOCK_TOKENS is 16
    assert block_hashes(tokens[:15], 16) == ()
    changed = [tokens[0] + 1] + tokens[1:]  # a block's hash names its whole prefix
    assert block_hashes(changed, 16)[1] != block_hashes(tokens, 16)[1]


def test_hashes_are_the_routers_token_keys():
    """api.router.core keys a token prompt with the same chain (the router reads events)."""
    from tqserve.api.router.core import token_keys
    tokens = [(31 * i) % 50_000 for i in range(100)]
    assert block_hashes(tokens, 16) == token_keys(tokens, 16)
    assert block_hashes(tokens, 8) == token_keys(tokens, 8)
    assert [int.from_bytes(d, "big") for d in block_digests(tokens, 16)] == list(
        token_keys(tokens, 16))


def test_publish_stores_whole_blocks_and_a_sharing_entry_only_its_new_one():
    index, log = indexed()
    a = list(range(40))
    index.publish(entry("a", a), Tier.RAM, 1)
    page = log.since(0)
    assert page.next == 1 and page.complete and page.num_blocks == 2
    [batch] = page.batches
    assert (batch.seq, batch.ts) == (1, 1.0)
    [event] = batch.events
    assert event == BlockStored(block_hashes=block_hashes(a, B), parent_block_hash=None,
                                token_ids=tuple(a[:32]), block_size=B)
    b = a[:32] + [500 + i for i in range(20)]  # shares 32 tokens: 2 blocks, adds a third
    index.publish(entry("b", b), Tier.RAM, 2)
    [event] = events(log, 1)
    hashes = block_hashes(b, B)
    assert event == BlockStored(block_hashes=hashes[2:], parent_block_hash=hashes[1],
                                token_ids=tuple(b[32:48]), block_size=B)
    assert log.since(1).num_blocks == 3


def test_supersede_removes_nothing_another_entry_holds():
    index, log = indexed()
    a = list(range(40))
    index.publish(entry("a", a), Tier.RAM, 1)
    longer = a + list(range(100, 130))  # supersedes a: a's blocks live on in it
    superseded, _ = index.publish(entry("b", longer), Tier.RAM, 2)
    assert superseded == ["a"]
    [event] = events(log, 1)
    assert isinstance(event, BlockStored) and event.block_hashes == block_hashes(longer, B)[2:]
    assert removed(log) == [] and log.num_blocks == 4


def test_forget_removes_only_blocks_no_other_entry_holds():
    index, log = indexed()
    a, c = list(range(40)), list(range(32)) + list(range(200, 240))
    index.publish(entry("a", a), Tier.RAM, 1)
    index.publish(entry("c", c), Tier.RAM, 2)  # c is no prefix of a: both stay
    index.forget("c")
    assert removed(log, 2) == list(block_hashes(c, B)[2:])  # the shared two stay held
    index.forget("a")
    assert removed(log, 3) == list(block_hashes(a, B))
    assert log.num_blocks == 0 and log.since(0).next == 4
    index.forget("a")  # unknown now: no batch
    assert log.since(0).next == 4


def test_ram_budget_eviction_removes_the_evicted_entrys_own_blocks():
    index, log = indexed(ram_budget=15)
    a, b = list(range(40)), list(range(16)) + list(range(300, 340))
    index.publish(entry("a", a), Tier.RAM, 1)
    with log.batch():  # as actors.prefix_cache does: the publish and its evictions
        _, over = index.publish(entry("b", b), Tier.RAM, 2)
        assert over == ["a"] and index.tier("a") is Tier.SPILLING
        for key in over:  # no SSD tier: the RAM copy is dropped
            index.forget(key)
    [batch] = log.since(1).batches
    hashes_a, hashes_b = block_hashes(a, B), block_hashes(b, B)
    assert [type(e) for e in batch.events] == [BlockRemoved, BlockStored]
    assert batch.events[0].block_hashes == (hashes_a[1],)  # block 0 is b's too
    assert batch.events[1].block_hashes == hashes_b[1:]
    assert batch.events[1].parent_block_hash == hashes_b[0]


def test_spill_to_ssd_emits_nothing_and_ssd_entries_count():
    index, log = indexed(ram_budget=5)
    a = list(range(40))
    _, over = index.publish(entry("a", a), Tier.RAM, 1)
    assert over == ["a"] and log.since(0).next == 1
    index.spilled("a", entry("ssd-a", a))  # RAM entry out, its SSD twin in: one op
    assert index.tier("ssd-a") is Tier.SSD
    assert log.since(0).next == 1 and log.num_blocks == 2
    index.forget("ssd-a")  # the SSD tier counts like any other
    assert removed(log, 1) == list(block_hashes(a, B))


def test_a_batch_nets_blocks_removed_and_stored_again():
    index, log = indexed()
    a = list(range(48))
    index.publish(entry("a", a), Tier.RAM, 1)
    with log.batch():
        index.forget("a")
        index.publish(entry("a2", a[:32]), Tier.RAM, 2)
    assert removed(log, 1) == [block_hashes(a, B)[2]] and stored(log, 1) == []
    with log.batch():  # stored and removed inside one batch: nothing at all
        index.publish(entry("x", range(500, 532)), Tier.RAM, 3)
        index.forget("x")
    assert log.since(0).next == 2


def test_namespaces_share_blocks():
    index, log = indexed()
    other = cache_namespace("fp", "turboquant:k4v4")
    a = list(range(32))
    index.publish(entry("a", a), Tier.RAM, 1)
    index.publish(entry("o", a, namespace=other), Tier.RAM, 2)  # same blocks: no event
    index.forget("a")  # still held by "o"
    assert log.since(0).next == 1 and log.num_blocks == 2


def test_the_ring_keeps_at_most_max_tokens_token_ids():
    """Long prompts: the ring drops its oldest batches once their BlockStored events carry
    more than max_tokens ids together (always keeping the newest), and says so."""
    log = KvEventLog(capacity=100, max_tokens=64)
    index = PrefixIndex(10_000, log)
    for i in range(4):  # 32 new tokens (2 blocks) each
        index.publish(entry(f"e{i}", range(1000 * i, 1000 * i + 32)), Tier.RAM, i)
    page = log.since(0)
    assert [b.seq for b in page.batches] == [3, 4] and page.complete is False
    assert sum(len(e.token_ids) for b in page.batches for e in b.events) == 64
    index.publish(entry("big", range(9000, 9160)), Tier.RAM, 9)  # 160 ids: over on its own
    assert [b.seq for b in log.since(0).batches] == [5] and log.since(4).complete
    index.forget("big")  # the next batch pushes the oversized one out
    assert [b.seq for b in log.since(0).batches] == [6] and not log.since(4).complete
    assert log.since(5).complete


def test_since_pages_and_ring_overflow_says_incomplete():
    index, log = indexed(capacity=3)
    for i in range(5):
        index.publish(entry(f"e{i}", range(1000 * i, 1000 * i + 16)), Tier.RAM, i)
    page = log.since(0)
    assert [b.seq for b in page.batches] == [3, 4, 5] and page.next == 5
    assert page.complete is False  # batches 1 and 2 were dropped
    assert log.since(1).complete is False
    page = log.since(2)
    assert page.complete and [b.seq for b in page.batches] == [3, 4, 5]
    page = log.since(4)
    assert page.complete and [b.seq for b in page.batches] == [5]
    page = log.since(5)
    assert page.complete and page.batches == () and page.next == 5
    page = log.since(9)  # a cursor from another log (a restarted server)
    assert page.complete is False and page.batches == () and page.next == 5
    with pytest.raises(ValueError, match="since"):
        log.since(-1)


def test_clear_and_page_json():
    index, log = indexed()
    index.publish(entry("a", range(20)), Tier.RAM, 1)
    log.clear()
    assert log.num_blocks == 0
    body = log.since(0).as_json()
    assert body["block_size"] == 16 and body["next"] == 2 and body["num_blocks"] == 0
    first, second = body["batches"]
    assert first["events"] == [{"type": "BlockStored",
                                "block_hashes": list(block_hashes(range(20), B)),
                                "parent_block_hash": None, "token_ids": list(range(16)),
                                "block_size": 16, "lora_id": None, "medium": None}]
    assert second == {"seq": 2, "ts": 2.0, "events": [{"type": "AllBlocksCleared"}]}
    with pytest.raises(ValueError, match="already"):
        log.add("k", range(16)), log.add("k", range(16))
