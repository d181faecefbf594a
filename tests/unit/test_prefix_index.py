"""The sans-io prefix index: longest usable donor, bounds, supersession, budget, namespaces."""

import pytest

from tqserve.engine.prefix import PrefixEntry, PrefixIndex, Tier, cache_namespace

NS = cache_namespace("fp", "plain:float32")


def entry(key, tokens, boundary=0, nbytes=10, namespace=NS):
    return PrefixEntry(key=key, namespace=namespace, tokens=tuple(tokens),
                       minimum_reusable_offset=boundary, trimmable=True, num_bytes=nbytes)


def test_longest_donor_leaves_the_last_prompt_token():
    index = PrefixIndex(1000)
    index.publish(entry("a", range(10)), Tier.RAM, 1)
    match = index.lookup(NS, tuple(range(10)), 2)
    assert (match.key, match.length) == ("a", 9)
    match = index.lookup(NS, (0, 1, 2, 99, 4), 3)
    assert match.length == 3
    assert index.lookup(NS, (5, 6), 4) is None


def test_namespaces_never_match():
    index = PrefixIndex(1000)
    other = cache_namespace("fp", "turboquant:k4v4")
    assert other != NS
    index.publish(entry("a", range(10), namespace=other), Tier.RAM, 1)
    assert index.lookup(NS, tuple(range(20)), 2) is None


def test_converted_donor_never_below_its_boundary_plain_ancestor_kept():
    index = PrefixIndex(1000)
    index.publish(entry("plain", range(8)), Tier.RAM, 1)
    superseded, _ = index.publish(entry("tq", range(20), boundary=16), Tier.RAM, 2)
    assert superseded == []  # the converted descendant cannot serve lengths below 16
    match = index.lookup(NS, tuple(range(12)) + (99,), 3)
    assert (match.key, match.length) == ("plain", 8)
    match = index.lookup(NS, tuple(range(18)) + (99,), 4)
    assert (match.key, match.length) == ("tq", 18)


def test_plain_descendant_supersedes_ancestor():
    index = PrefixIndex(1000)
    index.publish(entry("a", range(8)), Tier.RAM, 1)
    superseded, _ = index.publish(entry("b", range(12)), Tier.RAM, 2)
    assert superseded == ["a"] and "a" not in index


def test_budget_spills_coldest_unpinned_and_tiers_rank():
    index = PrefixIndex(25)
    index.publish(entry("a", (1, 2, 3)), Tier.RAM, 1)
    index.publish(entry("b", (4, 5, 6)), Tier.RAM, 2)
    index.pin("a")
    _, spill = index.publish(entry("c", (7, 8, 9)), Tier.RAM, 3)
    assert spill == ["b"] and index.tier("b") is Tier.SPILLING
    match = index.lookup(NS, (4, 5, 6, 7), 4)  # out of the budget, still reachable
    assert (match.key, match.tier, match.length) == ("b", Tier.SPILLING, 3)
    index.pending("b")  # its RAM copy went; its bytes wait for the disk
    assert index.lookup(NS, (4, 5, 6, 7), 5).tier is Tier.PENDING
    index.spilled("b", entry("ssd-b", (4, 5, 6)))
    assert index.lookup(NS, (4, 5, 6, 7), 6).tier is Tier.SSD
    stats = index.statistics()
    assert (stats.ram_entries, stats.ram_bytes, stats.ssd_entries) == (2, 20, 1)
    assert (stats.hits_ram, stats.hits_ssd, stats.misses) == (1, 2, 0)


def test_ties_prefer_ram_spilling_pending_then_ssd_and_other_tiers_are_never_superseded():
    """One prefix in every tier: each lookup takes the best tier left; a RAM descendant
    supersedes neither the SPILLING, the PENDING nor the SSD entry."""
    index = PrefixIndex(0)
    _, spill = index.publish(entry("p", (1, 2, 3)), Tier.RAM, 1)
    assert spill == ["p"]
    index.pending("p")
    _, spill = index.publish(entry("s", (1, 2, 3)), Tier.RAM, 2)
    assert spill == ["s"] and index.tier("p") is Tier.PENDING
    index.publish(entry("d", (1, 2, 3)), Tier.SSD, 3)
    index.pin("r")
    assert index.publish(entry("r", (1, 2, 3, 4)), Tier.RAM, 4) == ([], [])
    order = []
    for key in ("r", "s", "p", "d"):
        match = index.lookup(NS, (1, 2, 3, 9), 5)
        order.append((match.key, match.tier))
        index.forget(key)
    assert order == [("r", Tier.RAM), ("s", Tier.SPILLING), ("p", Tier.PENDING),
                     ("d", Tier.SSD)]
    assert index.lookup(NS, (1, 2, 3, 9), 6) is None


def test_only_a_spilling_entry_becomes_pending_and_nothing_is_published_pending():
    index = PrefixIndex(100)
    index.publish(entry("a", (1, 2)), Tier.RAM, 1)
    with pytest.raises(ValueError, match="not SPILLING"):
        index.pending("a")
    with pytest.raises(ValueError, match="not PENDING"):
        index.publish(entry("b", (3, 4)), Tier.PENDING, 2)


SYSTEM = tuple(range(1000, 1000 + 512))


def test_publish_and_lookup_visit_only_related_entries():
    """1,000 donors under one system prompt: a publish examines only the entries ending on
    its own path, a lookup only its winner; neither walks the other donors."""
    index = PrefixIndex(1 << 40)
    for i in range(1000):
        index.publish(entry(f"e{i}", SYSTEM + (i, i + 1, i + 2)), Tier.RAM, i)
    before = index.statistics().entries_visited
    superseded, spill = index.publish(entry("new", SYSTEM + (5000, 1)), Tier.RAM, 2000)
    assert (superseded, spill) == ([], [])
    assert index.statistics().entries_visited == before  # no entry ends on its path
    index.publish(entry("sys", SYSTEM), Tier.SSD, 2001)
    before = index.statistics().entries_visited
    match = index.lookup(NS, SYSTEM + (7, 8, 9, 10), 2002)
    assert (match.key, match.length, match.tier) == ("e7", 515, Tier.RAM)
    assert index.statistics().entries_visited - before == 1
    before = index.statistics().entries_visited
    match = index.lookup(NS, SYSTEM + (4242,), 2003)  # shares only the system prompt
    assert (match.key, match.length, match.tier) == ("e7", 512, Tier.RAM)  # most recent
    assert index.statistics().entries_visited - before == 1
    before = index.statistics().entries_visited
    superseded, _ = index.publish(entry("longer", SYSTEM + (7, 8, 9, 10, 11)), Tier.RAM, 2004)
    assert superseded == ["e7"]
    assert index.statistics().entries_visited - before == 2  # "sys" (SSD) and "e7"


def test_ties_prefer_ram_then_recent_and_ssd_serves_when_ram_cannot():
    index = PrefixIndex(1000)
    index.publish(entry("old", (1, 2, 3, 4)), Tier.RAM, 1)
    index.publish(entry("new", (1, 2, 3, 5)), Tier.RAM, 2)
    index.publish(entry("disk", (1, 2, 3, 6)), Tier.SSD, 3)
    assert index.lookup(NS, (1, 2, 3, 9, 9), 4).key == "new"
    assert index.lookup(NS, (1, 2, 3, 4, 9), 5).key == "old"  # longer wins
    assert index.lookup(NS, (1, 2, 3, 9, 9), 6).key == "old"  # now the most recent
    assert index.lookup(NS, (1, 2, 3, 6, 9), 7).key == "disk"  # SSD when longer


def test_boundaries_untrimmable_and_splits():
    index = PrefixIndex(1000)
    index.publish(entry("tq", range(20), boundary=16), Tier.RAM, 1)
    assert index.lookup(NS, tuple(range(10)) + (99,), 2) is None  # 10 < boundary 16
    exact = PrefixEntry(key="exact", namespace=NS, tokens=tuple(range(6)),
                        minimum_reusable_offset=0, trimmable=False, num_bytes=1)
    index.publish(exact, Tier.RAM, 3)  # splits "tq"'s run of tokens at 6
    assert index.lookup(NS, tuple(range(5)) + (99,), 4) is None  # cannot be cut to 5
    match = index.lookup(NS, tuple(range(6)) + (99,), 5)
    assert (match.key, match.length) == ("exact", 6)
    match = index.lookup(NS, tuple(range(17)) + (99,), 6)
    assert (match.key, match.length) == ("tq", 17)
    assert index.has_tokens(NS, tuple(range(6))) and not index.has_tokens(NS, range(5))
    index.forget("exact")
    index.forget("tq")
    assert index.lookup(NS, tuple(range(20)), 7) is None
    assert index.statistics().ram_entries == 0 and index.statistics().ram_bytes == 0


def test_unspill_returns_an_entry_to_ram():
    index = PrefixIndex(10)
    index.publish(entry("a", (1, 2, 3)), Tier.RAM, 1)
    _, spill = index.publish(entry("b", (4, 5, 6)), Tier.RAM, 2)
    assert spill == ["a"] and index.lookup(NS, (1, 2, 3, 4), 3).tier is Tier.SPILLING
    index.unspill("a")
    assert index.tier("a") is Tier.RAM and index.lookup(NS, (1, 2, 3, 4), 4).key == "a"
