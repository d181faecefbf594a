"""The router's sans-io core: prefix keys, affinity, spill, health transitions, LRU bound."""

import pytest

from tqserve.api.router.core import (TRANSITIONS, BackendState, HealthEvent, KvFeed,
                                     NoHealthyBackend, Route, RouteTable, RoutingConfig,
                                     prefix_keys, text_keys, token_keys)

A, B, C = "http://a:1", "http://b:1", "http://c:1"


def _table(policy="prefix", **kw):
    table = RouteTable([A, B, C], RoutingConfig(policy=policy, **kw))
    for name in table.names:
        table.set_health(name, HealthEvent.UP)
    return table


def test_keys_are_chained_prefix_hashes():
    a = token_keys(list(range(40)), 16)
    b = token_keys(list(range(32)) + [99] * 8, 16)
    assert len(a) == 2 and a == b  # the tail shorter than a block names nothing
    c = token_keys([5] + list(range(1, 40)), 16)
    assert c[0] != a[0] and c[1] != a[1]  # a different first block changes every key
    assert text_keys("x" * 130, 64) == text_keys("x" * 128 + "yz", 64)
    assert len(text_keys("x" * 63, 64)) == 0
    assert token_keys([1] * 16, 16) != text_keys("\x01" * 64, 64)


def test_prefix_keys_read_every_prompt_shape():
    kw = dict(block_tokens=4, block_chars=8)
    toks = list(range(12))
    assert prefix_keys({"prompt_tokens": toks}, **kw) == token_keys(toks, 4)
    assert prefix_keys({"prompt": toks}, **kw) == token_keys(toks, 4)  # OpenAI ids
    assert prefix_keys({"prompt": ["a" * 16]}, **kw) == text_keys("a" * 16, 8)
    chat = prefix_keys({"messages": [{"role": "user", "content": "hello there, world"}]}, **kw)
    longer = prefix_keys({"messages": [{"role": "user", "content": "hello there, world"},
                                       {"role": "assistant", "content": "hi! " * 10}]}, **kw)
    assert chat and longer[:len(chat)] == chat
    system = prefix_keys({"system": "be brief", "messages": [{"role": "user",
                                                              "content": "x" * 20}]}, **kw)
    assert system[0] != prefix_keys({"messages": [{"role": "user", "content": "x" * 20}]},
                                    **kw)[0]
    for bad in ({}, {"prompt": 3}, {"prompt_tokens": ["a"]}, {"messages": "x"},
                {"prompt_tokens": [2**70]}):
        assert prefix_keys(bad, **kw) == ()


def test_affinity_follows_the_longest_prefix():
    t = _table()
    base = token_keys(list(range(64)), 16)  # 4 blocks
    first = t.choose(base)
    assert first.reason == "least_loaded"
    t.started(first, base)
    t.finished(first.backend)
    longer = token_keys(list(range(64)) + list(range(200, 232)), 16)  # 6 blocks, 4 known
    again = t.choose(longer)
    assert (again.backend, again.reason, again.matched_blocks) == (first.backend, "affinity", 4)
    # a prompt sharing only 1 of 6 blocks (a system prompt) is spread by load instead
    other = token_keys(list(range(16)) + list(range(500, 580)), 16)
    assert t.choose(other).reason == "least_loaded"


def test_overloaded_owner_spills_to_the_least_loaded():
    t = _table(spill_threshold=2)
    keys = token_keys(list(range(32)), 16)
    r = t.choose(keys)
    t.started(r, keys)
    assert t.choose(keys).reason == "affinity"
    t.started(t.choose(keys), keys)  # owner now has 2 in flight, the others 0
    spill = t.choose(keys)
    assert spill.reason == "spill" and spill.backend != r.backend
    t.started(spill, keys)  # the spill target now owns the keys
    assert t.choose(keys).backend == spill.backend
    stats = t.statistics()
    assert stats.backends[r.backend].num_routed == {"least_loaded": 1, "affinity": 1}
    assert stats.backends[spill.backend].num_owned_keys == 2
    assert stats.backends[r.backend].num_owned_keys == 0
    assert t.num_in_flight() == 3


def test_unhealthy_and_draining_backends_get_nothing():
    t = _table()
    keys = token_keys(list(range(32)), 16)
    r = t.choose(keys)
    t.started(r, keys)
    t.failed(r.backend)
    assert t.state(r.backend) is BackendState.UNHEALTHY
    assert t.statistics().backends[r.backend].num_owned_keys == 0  # forgotten
    assert t.choose(keys).backend != r.backend
    t.set_health(r.backend, HealthEvent.UP)
    rest = [n for n in t.names if n != r.backend]
    for n in rest:
        t.set_health(n, HealthEvent.DRAIN)
        t.set_health(n, HealthEvent.UP)  # draining is sticky
        assert t.state(n) is BackendState.DRAINING
    assert {t.choose(keys).backend for _ in range(5)} == {r.backend}
    with pytest.raises(NoHealthyBackend, match="after 1 tried"):
        t.choose(keys, exclude=[r.backend])
    t.finished(r.backend)
    with pytest.raises(ValueError, match="no request in flight"):
        t.finished(r.backend)  # an illegal event raises and changes nothing
    assert t.num_in_flight(r.backend) == 0
    assert t.statistics().num_no_backend == 1


def test_round_robin_ignores_prefixes_and_skips_unhealthy():
    t = _table("round-robin")
    keys = token_keys(list(range(32)), 16)
    picks = [t.choose(keys).backend for _ in range(6)]
    assert picks == [A, B, C, A, B, C]
    t.set_health(B, HealthEvent.DOWN)
    assert {t.choose(keys).backend for _ in range(4)} == {A, C}
    t.started(t.choose(keys), keys)
    assert t.statistics().num_keys == 0


def test_lru_is_bounded_and_transition_table_is_total():
    t = _table(max_keys=5)
    for i in range(4):
        keys = token_keys([i] * 48, 16)
        t.started(t.choose(keys), keys)
    stats = t.statistics()
    assert stats.num_keys == 5
    assert sum(b.num_owned_keys for b in stats.backends.values()) == 5
    assert set(TRANSITIONS) == {(s, e) for s in BackendState for e in HealthEvent}


def test_config_and_table_errors_name_the_problem():
    with pytest.raises(ValueError, match="policy"):
        RoutingConfig(policy="random")
    with pytest.raises(ValueError, match="spill_threshold"):
        RoutingConfig(spill_threshold=0)
    with pytest.raises(ValueError, match="listed twice"):
        RouteTable([A, A], RoutingConfig())
    t = RouteTable([A], RoutingConfig())
    with pytest.raises(NoHealthyBackend, match="no healthy backend"):
        t.choose(())  # UNKNOWN until the first health check


def test_health_checks_need_consecutive_failures_to_take_a_backend_out():
    t = RouteTable([A, B], RoutingConfig(health_failures=2))
    assert t.checked(A, False) is BackendState.UNHEALTHY  # never seen up: out at once
    assert t.checked(B, True) is BackendState.HEALTHY
    assert t.checked(B, False) is BackendState.HEALTHY  # one slow answer
    assert t.checked(B, True) is BackendState.HEALTHY   # resets the count
    assert t.checked(B, False) is BackendState.HEALTHY
    assert t.checked(B, False) is BackendState.UNHEALTHY
    assert t.checked(B, True) is BackendState.HEALTHY
    t.set_health(B, HealthEvent.DRAIN)
    assert t.checked(B, False) is BackendState.DRAINING
    assert t.checked(B, False) is BackendState.DRAINING


def test_kv_events_make_a_backend_hold_keys_and_drop_them():
    """Keys a backend's KV events say it holds route there (the least loaded of several
    holders); keys it removed do not, even where they were routed there before."""
    table = _table(min_match_fraction=0.0)
    keys = token_keys(list(range(64)), 16)
    table.observe(B, keys, ())
    assert table.choose(keys) == Route(backend=B, reason="affinity", matched_blocks=4)
    table.observe(C, keys[:2], ())
    table.set_load(B, 3)
    assert table.choose(keys).backend == B  # C holds only 2 of 4 blocks
    assert table.choose(keys[:2]).backend == C  # both hold it: the less loaded
    table.set_load(B, 0)
    table.started(Route(backend=A, reason="least_loaded"), keys)  # routed to A last
    table.observe(B, (), keys)
    table.observe(C, (), keys[:2])
    assert table.held_by(B) == [] and table.held_by(C) == []
    assert table.choose(keys).backend == A  # only the routed-before memory is left
    table.observe(A, (), keys)  # A's cache dropped them too: no affinity anywhere
    assert table.choose(keys).reason == "least_loaded"


def test_set_backends_follows_a_changing_replica_set():
    table = RouteTable(["r1", "r2"], RoutingConfig())
    table.set_backends(["r1", "r2"])
    assert table.routable() == ["r1", "r2"]  # listed by the cluster: healthy
    keys = token_keys(list(range(32)), 16)
    table.observe("r2", keys, ())
    table.set_backends(["r1", "r3"])  # r2 died, r3 replaced it
    assert table.names == ("r1", "r3") and table.held_by("r2") == []
    assert table.choose(keys).reason == "least_loaded"
    table.set_load("r1", 2)
    assert table.choose(()).backend == "r3"


def test_kv_feed_applies_each_batch_once_and_resyncs_after_a_gap():
    table = RouteTable(["r1"], RoutingConfig())
    table.set_backends(["r1"])
    feed = KvFeed()
    feed.absorb(table, "r1", {"kv_next": 2, "kv_batches": [(1, [10, 11], []), (2, [12], [])]})
    assert sorted(table.held_by("r1")) == [10, 11, 12]
    # the next report repeats batch 2 and adds 3: only 3 applies (11 removed once)
    feed.absorb(table, "r1", {"kv_next": 3, "kv_batches": [(2, [12], []), (3, [], [11])]})
    assert sorted(table.held_by("r1")) == [10, 12] and feed.num_resyncs == 0
    feed.absorb(table, "r1", {"kv_next": 3, "kv_batches": [(3, [11], [])]})  # nothing new
    assert sorted(table.held_by("r1")) == [10, 12]
    # batches 4..6 were missed: start afresh from the window
    feed.absorb(table, "r1", {"kv_next": 8, "kv_batches": [(7, [20], []), (8, [21], [])]})
    assert sorted(table.held_by("r1")) == [20, 21] and feed.num_resyncs == 1
    feed.absorb(table, "r1", {})  # prefix cache off: nothing
    assert feed.seen == {"r1": 8}


def test_a_head_every_backend_holds_decides_nothing():
    """Affinity counts what the holder has beyond what the least loaded backend holds too:
    a system prompt two backends hold does not pin new conversations to either."""
    table = _table(min_match_fraction=0.25)
    head = list(range(32))  # 2 blocks every conversation starts with
    first = token_keys(head + list(range(100, 164)), 16)   # 6 blocks, on A
    table.observe(A, first, ())
    table.observe(B, first[:2], ())
    table.set_load(A, 1)
    table.set_load(B, 1)
    new = token_keys(head + list(range(500, 628)), 16)     # 10 blocks, shares the head
    assert table.choose(new) == Route(backend=C, reason="least_loaded", matched_blocks=0)
    table.set_load(C, 2)
    table.set_load(B, 0)
    assert table.choose(new) == Route(backend=B, reason="least_loaded", matched_blocks=2)
    follow = token_keys(head + list(range(100, 164)) + list(range(900, 916)), 16)  # 7
    assert table.choose(follow) == Route(backend=A, reason="affinity", matched_blocks=6)
