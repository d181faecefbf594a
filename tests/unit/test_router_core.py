"""The router's sans-io core: prefix keys, affinity, spill, health transitions, LRU bound."""

import pytest

from tqserve.api.router.core import (TRANSITIONS, BackendState, HealthEvent, NoHealthyBackend,
                                     RouteTable, RoutingConfig, prefix_keys, text_keys,
                                     token_keys)

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
