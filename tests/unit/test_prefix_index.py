"""The sans-io prefix index: longest usable donor, bounds, supersession, budget, namespaces."""

from engine.prefix import PrefixEntry, PrefixIndex, Tier, cache_namespace

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
    assert index.lookup(NS, (4, 5, 6, 7), 4) is None
    index.spilled("b", entry("ssd-b", (4, 5, 6)))
    assert index.lookup(NS, (4, 5, 6, 7), 5).tier is Tier.SSD
    stats = index.statistics()
    assert (stats.ram_entries, stats.ssd_entries, stats.hits_ssd, stats.misses) == (2, 1, 1, 1)
