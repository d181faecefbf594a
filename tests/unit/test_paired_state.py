"""Paired snapshots' pieces, synchronously: the namespaces rule (engine.namespaces), the
proposer state's cut and planes, and StateLayout's refusals (engine.speculative.state)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tqserve.engine.namespaces import CacheNamespaces
from tqserve.engine.prefix import cache_namespace
from tqserve.engine.speculative.policy import SpecChoice
from tqserve.engine.speculative.state import ProposerState, StateLayout, paired_minimum

IDENTITIES = {"draft": "draft:d0", "mtp": "mtp:m0"}
DRAFT = StateLayout(identity="draft:d0", prefix="draft", hidden=None,
                    layers=(((1, 1, 8), "float32"), ((1, 1, 8), "float32")))
MTP = StateLayout(identity="mtp:m0", prefix="mtp", layers=(((1, 2, 8), "float32"),),
                  hidden=((1, 16), "float32"))


def _planes(layout: StateLayout, offset: int, cached: int) -> dict:
    """Shapes and dtypes of a state of `cached` KV positions for `offset` tokens."""
    out = {}
    for i, (pattern, dtype) in enumerate(layout.layers):
        for part in ("keys", "values"):
            out[f"{layout.prefix}.{i}.{part}"] = ((*pattern[:2], cached, *pattern[2:]), dtype)
    if layout.hidden is not None:
        out[f"{layout.prefix}.hidden"] = ((1, offset - cached, *layout.hidden[0][1:]),
                                          layout.hidden[1])
    return out


def _state(offset: int, cached: int) -> ProposerState:
    rng = np.random.default_rng(offset)
    layers = ((mx.array(rng.standard_normal((1, 2, cached, 8)).astype(np.float32)),
               mx.array(rng.standard_normal((1, 2, cached, 8)).astype(np.float32))),)
    hidden = mx.array(rng.standard_normal((1, offset - cached, 16)).astype(np.float32))
    return ProposerState(identity=MTP.identity, prefix="mtp", layers=layers, hidden=hidden,
                         offset=offset)


def test_each_method_has_its_own_namespace_and_state_free_ones_keep_the_old_one():
    spaces = CacheNamespaces.build("fp", "plain:float32", IDENTITIES,
                                   default=SpecChoice(method="draft"))
    base = cache_namespace("fp", "plain:float32")
    draft, mtp = (cache_namespace("fp", "plain:float32", i) for i in IDENTITIES.values())
    assert spaces.base == base and len({base, draft, mtp}) == 3
    assert spaces.all() == {base, draft, mtp}
    assert spaces.of_request(None) == spaces.of_request(True) == draft  # the default
    assert spaces.of_request(False) == spaces.of_request(SpecChoice(method="lookup")) == base
    assert spaces.of_request(SpecChoice(method="mtp", num_tokens=2)) == mtp
    assert [spaces.of_state(s) for s in ("", "draft:d0", "mtp:m0")] == [base, draft, mtp]
    assert [spaces.state_of(n) for n in (base, draft, mtp, "other")] == ["", "draft:d0",
                                                                         "mtp:m0", None]
    with pytest.raises(KeyError):
        spaces.of_state("draft:another-model")
    unpaired = CacheNamespaces.build("fp", "plain:float32", {})  # e.g. a draft not pairable
    assert unpaired.of_request(SpecChoice(method="draft")) == base == unpaired.of_request(None)


def test_an_mtp_state_cuts_down_to_one_past_its_head_positions():
    state = _state(offset=10, cached=6)
    assert (state.num_cached, state.minimum) == (6, 7)
    assert state.nbytes == 2 * (2 * 6 * 8 * 4) + 4 * 16 * 4
    cut = state.cut(8)
    assert (cut.offset, cut.num_cached, cut.hidden.shape) == (8, 6, (1, 2, 16))
    assert mx.array_equal(cut.hidden, state.hidden[:, :2]).item()
    assert cut.hidden is not state.hidden and cut.layers[0][0] is not state.layers[0][0]
    for length in (0, 6, 11):
        with pytest.raises(ValueError, match="cannot cut"):
            state.cut(length)
    fresh = _state(offset=10, cached=0)  # a prompt's state: the head has not run yet
    assert fresh.minimum == 1 and fresh.cut(1).hidden.shape == (1, 1, 16)
    assert state.header_fields() == {"paired": "mtp:m0", "paired_minimum": 7}
    assert paired_minimum(state.header_fields()) == 7 and paired_minimum({}) == 0


def test_planes_round_trip_through_the_layout():
    state = _state(offset=10, cached=6)
    planes = {name: (data, shape, dtype) for name, data, shape, dtype in state.planes()}
    assert MTP.check(offset=10, planes={n: p[1:] for n, p in planes.items()},
                     fields=state.header_fields()) == 6
    back = MTP.restore(10, planes)
    assert (back.identity, back.offset, back.minimum) == ("mtp:m0", 10, 7)
    assert mx.array_equal(back.hidden, state.hidden).item()
    assert all(mx.array_equal(a, b).item() for a, b in zip(back.layers[0], state.layers[0]))
    bad = dict(planes, **{"mtp.hidden": (planes["mtp.hidden"][0][:-4], (1, 4, 16), "float32")})
    with pytest.raises(ValueError, match="mtp.hidden holds"):
        MTP.restore(10, bad)


@pytest.mark.parametrize("change,match", [
    (lambda p: p.pop("draft.1.values"), "draft.1.values is missing"),
    (lambda p: p.update({"draft.2.keys": ((1, 1, 5, 8), "float32")}), "unexpected planes"),
    (lambda p: p.update({"draft.0.keys": ((1, 2, 5, 8), "float32")}), "draft.0.keys"),  # heads
    (lambda p: p.update({"draft.0.keys": ((1, 1, 5, 16), "float32")}), "draft.0.keys"),  # dim
    (lambda p: p.update({"draft.1.keys": ((1, 1, 5, 8), "float16")}), "draft.1.keys"),  # dtype
    (lambda p: p.update({"draft.1.values": ((1, 1, 4, 8), "float32")}), "draft.1.values"),
    (lambda p: p.update({"draft.0.keys": ((1, 5, 8), "float32")}), "draft.0.keys"),  # rank
])
def test_draft_planes_that_do_not_fit_are_refused(change, match):
    planes = _planes(DRAFT, 5, 5)
    assert DRAFT.check(offset=5, planes=planes) == 5
    change(planes)
    with pytest.raises(ValueError, match=match):
        DRAFT.check(offset=5, planes=planes)


def test_a_draft_state_must_cover_the_offset():
    with pytest.raises(ValueError, match="4 positions for offset 5"):
        DRAFT.check(offset=5, planes=_planes(DRAFT, 4, 4))


@pytest.mark.parametrize("planes,fields,match", [
    (_planes(MTP, 5, 5), None, "mtp.hidden"),  # no pending hidden state: N must be < T
    ({**_planes(MTP, 5, 2), "mtp.hidden": ((1, 3, 8), "float32")}, None, "mtp.hidden"),
    ({**_planes(MTP, 5, 2), "mtp.hidden": ((1, 2, 16), "float32")}, None, "mtp.hidden"),
    ({k: v for k, v in _planes(MTP, 5, 2).items() if k != "mtp.hidden"}, None, "missing"),
    (_planes(MTP, 5, 2), {"paired": "mtp:other", "paired_minimum": 3}, "paired"),
    (_planes(MTP, 5, 2), {"paired": "mtp:m0", "paired_minimum": 1}, "paired_minimum"),
    (_planes(MTP, 5, 2), {"paired": "mtp:m0"}, "paired_minimum"),
])
def test_mtp_planes_and_fields_that_do_not_fit_are_refused(planes, fields, match):
    with pytest.raises(ValueError, match=match):
        MTP.check(offset=5, planes=planes, fields=fields)
    assert MTP.check(offset=5, planes=_planes(MTP, 5, 2),
                     fields={"paired": "mtp:m0", "paired_minimum": 3}) == 2
