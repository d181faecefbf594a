"""The router's sans-io core: prefix keys, affinity, spill, health transitions, LRU bound;
and the Ray router's least-work policy (api.router.cost)."""

import pytest

from tqserve.api.router.core import (TRANSITIONS, BackendState, HealthEvent, KvFeed,
                                     NoHealthyBackend, Route, RouteTable, RoutingConfig,
                                     prefix_keys, text_keys, token_keys)
from tqserve.api.router.cost import MAX_UNSENT, MAX_WAIT_S, LeastWork

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


# least work (api.router.cost): the Ray router's policy, costed in prompt tokens

def _work(*names, **kw):
    """A LeastWork over healthy backends `names` (blocks of 16 tokens)."""
    table = RouteTable(list(names), RoutingConfig(**kw))
    table.set_backends(list(names))
    return LeastWork(table)


def _ids(n, start=0):
    return list(range(start, start + n))


def test_least_work_gives_the_holder_a_prompt_while_it_is_not_far_behind():
    """The holder of 896 of a prompt's 1,000 tokens gets it while its own backlog is less
    than twice what its cache saves (a computed token counts twice: its own wait, and
    the delay to the requests behind it); 2,404 tokens behind, the idle backend gets it
    (spill)."""
    work = _work(A, B)
    keys = token_keys(_ids(1000), 16)           # 62 whole blocks: 992 tokens
    work.table.observe(A, keys[:56], ())        # A holds 56 blocks: 896 tokens
    work.routed("x", A, token_keys(_ids(300, 5000), 16), 300, now=0.0)  # A owes 300
    (a, b) = work.estimates(keys, 1000, now=0.0)
    assert (a.num_pending, a.num_cached, a.num_uncached, a.cost) == (300, 896, 104, 508)
    assert (b.num_pending, b.num_cached, b.num_uncached, b.cost) == (0, 0, 1000, 2000)
    assert work.choose("y", keys, 1000, now=0.0) == Route(backend=A, reason="affinity",
                                                          matched_blocks=56)
    work.routed("y", A, keys, 1000, now=0.0)
    work.routed("z", A, token_keys(_ids(2000, 9000), 16), 2000, now=0.0)
    assert work.num_pending(A, 0.0) == 300 + 104 + 2000  # 2,404 + 2 x 104 > 2 x 1,000
    route = work.choose("w", keys, 1000, now=0.0)
    assert route == Route(backend=B, reason="spill", matched_blocks=0)
    assert work.num_pending(B, 0.0) == 1000  # booked where chosen, before Ray sends it


def test_least_work_spreads_new_prompts_and_skips_a_backend_far_busier_by_count():
    work = _work(A, B, C, spill_threshold=2)
    for backend, n in ((A, 0), (B, 1), (C, 3)):
        work.table.set_load(backend, n)
    keys = token_keys(_ids(64), 16)
    work.table.observe(C, keys, ())   # C holds it all but has 3 more requests than A
    assert [e.backend for e in work.estimates(keys, 64, now=0.0)] == [A, B]
    first = work.choose("r1", keys, 64, now=0.0)
    assert first == Route(backend=A, reason="least_loaded", matched_blocks=0)
    second = work.choose("r2", token_keys(_ids(64, 100), 16), 64, now=0.0)
    assert second.backend == B  # A owes 64 now: B is cheaper
    assert work.choose(None, (), None, now=0.0).reason == "least_loaded"  # not booked
    assert work.num_pending(A, 0.0) == 64 and work.num_pending(B, 0.0) == 64


def test_a_request_waits_for_a_prefix_being_computed_then_reuses_it():
    """A 3,000-token prompt being computed on A, a second request with the same prefix:
    computing it again on B (100 tokens behind) costs more than waiting for A's first
    token, so the decision is `wait` (nothing booked); after that first token the prefix
    is A's, cached, and the request goes there. A donor whose first token is not reported
    is never waited for: computing it on B (6,180) beats A (9,080)."""
    work = _work(A, B)
    donor = token_keys(_ids(3000), 16)  # 187 whole blocks: 2,992 tokens
    work.routed("d", A, donor, 3000, signals=True, now=0.0)
    work.routed("e", B, token_keys(_ids(100, 9000), 16), 100, now=0.0)
    follow = token_keys(_ids(3000) + _ids(40, 7000), 16)  # 3,040 tokens, 190 blocks
    a, b = work.estimates(follow, 3040, now=0.1)
    assert (a.num_pending, a.num_cached, a.num_wait_cached, a.cost) == (3000, 0, 2992, 3096)
    assert a.waits and not b.waits and b.cost == 100 + 2 * 3040
    assert work.choose("f", follow, 3040, now=0.1) == Route(backend=A, reason="wait")
    assert work.num_pending(A, 0.1) == 3000 and work.num_waits == 1
    work.prefilled("d", 1.0)  # its first token: 3,000 tokens in 1 s
    assert work.rate(A) == 3000.0 and work.num_pending(A, 1.0) == 0
    assert work.choose("f", follow, 3040, now=1.0) == Route(backend=A, reason="affinity",
                                                            matched_blocks=187)
    # a donor whose first token is not reported (signals False) is never waited for
    other = _work(A, B)
    other.routed("d", A, donor, 3000, now=0.0)
    other.routed("e", B, token_keys(_ids(100, 9000), 16), 100, now=0.0)
    assert other.choose("f", follow, 3040, now=0.1).backend == B


def test_the_oldest_prompt_counts_done_at_the_measured_rate():
    work = _work(A, B)
    work.routed("a", A, token_keys(_ids(1000), 16), 1000, signals=True, now=0.0)
    work.prefilled("a", 0.5)  # 1,000 tokens in 0.5 s: 2,000 tokens/s
    assert work.rate(A) == 2000.0
    work.routed("b", A, token_keys(_ids(2000, 5000), 16), 2000, signals=True, now=0.4)
    work.routed("c", A, token_keys(_ids(500, 9000), 16), 500, signals=True, now=0.6)
    # b started at a's first token (0.5 s, not when it was sent); c waits behind it
    assert work.num_pending(A, 0.5) == 2000 + 500
    assert work.num_pending(A, 1.0) == 2000 + 500 - 1000
    assert work.num_pending(A, 9.0) == 500  # b is done at most, never c before it
    work.prefilled("b", 1.5)  # 2,000 tokens in 1 s: the same rate
    assert work.rate(A) == 2000.0
    work.prefilled("c", 1.6)  # 500 tokens in 0.1 s: 5,000/s, weighed in at a quarter
    assert work.rate(A) == pytest.approx(2000.0 + 0.25 * (5000.0 - 2000.0))


def test_least_work_books_follow_ray_to_the_end():
    """Booked where chosen, moved where Ray sent it, done at the first token, gone at the
    end; a prompt computed (first token, or the end) is its backend's from then on."""
    work = _work(A, B)
    keys = token_keys(_ids(320), 16)
    assert work.choose("r", keys, 320, now=0.0).backend in (A, B)
    work.routed("r", B, keys, 320, now=0.0)   # Ray sent it to B
    assert (work.num_pending(A, 0.0), work.num_pending(B, 0.0)) == (0, 320)
    work.completed("r", A)                    # a refused try on A: B's booking stays
    assert work.num_pending(B, 0.0) == 320
    work.completed("r", B)                    # ended without a first token reported
    assert work.num_pending(B, 0.0) == 0 and work.table.depth_held(B, keys) == 20
    work.prefilled("r", 1.0)                  # late or unknown notes change nothing
    assert work.rate(B) is None
    for i in range(MAX_UNSENT + 5):           # chosen, never sent: bounded
        work.choose(f"u{i}", keys, 320, now=0.0)
    assert work.num_pending(A, 0.0) + work.num_pending(B, 0.0) <= MAX_UNSENT * 320
    work.forget(A)
    work.forget(B)
    assert (work.num_pending(A, 0.0), work.num_pending(B, 0.0)) == (0, 0)
    with pytest.raises(NoHealthyBackend):
        work.estimates(keys, 320, exclude=[A, B], now=0.0)


def test_an_untokenized_prompt_counts_a_block_per_key():
    work = _work(A, B)
    keys = text_keys("x" * 640, 64)  # 10 text keys
    (a, _) = work.estimates(keys, None, now=0.0)
    assert a.num_uncached == 160


def test_waits_are_bounded_in_time_and_in_number():
    """A request waits for a prefix being computed at most MAX_WAIT_S, and no more
    requests wait at once than there are backends (each holds one of Ray's routing
    tasks); past either, the prefix being computed counts for nothing."""
    work = _work(A, B)
    donor = token_keys(_ids(3000), 16)
    work.routed("d", A, donor, 3000, signals=True, now=0.0)
    work.routed("e", B, token_keys(_ids(100, 9000), 16), 100, now=0.0)
    follows = [token_keys(_ids(3000) + _ids(40, 7000 + 100 * i), 16) for i in range(3)]
    assert [work.choose(f"f{i}", keys, 3040, now=0.1)
            for i, keys in enumerate(follows)] == [
        Route(backend=A, reason="wait"), Route(backend=A, reason="wait"),
        Route(backend=B, reason="least_loaded")]  # 2 wait already: B, the least work
    assert work.num_waits == 2
    assert work.choose("f0", follows[0], 3040, now=0.1 + MAX_WAIT_S).reason == "wait"
    late = work.choose("f0", follows[0], 3040, now=0.2 + MAX_WAIT_S)  # waited too long:
    assert late == Route(backend=A, reason="least_loaded")  # A owes 3,000, B now 3,140
    assert work.num_waits == 2
