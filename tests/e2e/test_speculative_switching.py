"""Rows that switch between plain (pipelined) steps and verify steps, step after step:
the sans-io scheduler and speculation books (as the speculation actor keeps them) driving
the real runner, speculator and models. A per-row back-off
that trips on any rejected proposal makes every row alternate; greedy output still
equals mlx-lm's (up to proven near-ties), and the MTP head, fed the target's hidden
states by plain steps too, keeps its acceptance; the draft catches up over plain steps."""

from __future__ import annotations

import attrs
import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from tqserve.engine.model import DEFAULT_MODEL, load_model
from tqserve.engine.runner import Runner
from tqserve.engine.sampling import SamplingParams
from tqserve.engine.scheduler import SchedulerCore
from tqserve.engine.step import Finished, TokenOut
from tqserve.engine.speculative.mtp import (KEEP_PENDING, MAX_PENDING, MtpProposer,
                                           forward_with_hidden, load_mtp_head)
from tqserve.engine.speculative.policy import SpecChoice, SpecPolicy, SpeculationPolicy
from tqserve.engine.speculative.proposers import DraftProposer
from tqserve.engine.speculative.speculator import Speculator
from tests.e2e.reference import PROMPTS, classify, reference

MAX_TOKENS = 24
MAX_STEPS = 400
# any rejection backs the row off for two steps (ema weight 1: the rate is the last step's)
ALTERNATE = SpecPolicy(backoff_threshold=0.99, backoff_steps=2, ema_weight=1.0,
                       time_policy=False)


def _proposer(method: str, loaded):
    if method == "mtp":
        return MtpProposer(loaded.model, load_mtp_head(loaded.path, loaded.model))
    return DraftProposer(load_model(DEFAULT_MODEL, "float32").model)


@pytest.mark.parametrize("method", ["mtp", "draft"])
def test_rows_alternating_plain_and_verify_steps_match_mlx_lm(big_model, method):
    choice = SpecChoice(method=method, num_tokens=3)
    speculator = Speculator({method: _proposer(method, big_model)}, choice)
    policy = SpeculationPolicy(ALTERNATE)  # the books the speculation actor keeps
    runner = Runner(big_model.model, speculator=speculator)
    core = SchedulerCore(max_batch=3, prefill_chunk=64, eos_token_ids=(),
                         speculative_methods=(method,))
    picks = [1, 2, 5]
    for idx in picks:
        core.add(f"r{idx}", tuple(big_model.tokenizer.encode(PROMPTS[idx])),
                 SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in picks}
    finished, modes = [], []
    for _ in range(MAX_STEPS):
        if not core.has_work():
            break
        plan, _ = core.schedule()
        for new in plan.new_rows:
            policy.open_row(new.request_id, choice)
        for rid in plan.release:
            policy.close_row(rid)
        decided = policy.decide(list(plan.decode), len(plan.decode))
        plan = attrs.evolve(plan, propose=tuple(decided.items()))
        result = runner.execute(plan)
        for out in result.outputs:
            policy.verified(out.request_id, out.num_proposed, out.num_accepted)
        if result.decode_seconds is not None:
            modes.append(result.speculative)
        for event in core.postprocess(result):
            if isinstance(event, TokenOut):
                tokens[event.request_id] += event.token_ids
            elif isinstance(event, Finished):
                finished.append(event)
    outcomes = {"same": 0, "near_tie": 0}
    for idx in picks:
        want, gaps, _ = reference(big_model, PROMPTS[idx], MAX_TOKENS)
        outcomes[classify(tokens[f"r{idx}"], want, gaps)] += 1
    assert outcomes["near_tie"] <= 1, outcomes
    assert len(finished) == 3 and {f.finish_reason for f in finished} == {"length"}
    stats = policy.statistics()
    assert stats.num_backoffs >= 3  # rows alternated
    assert False in modes  # steady plain steps were measured (for the time policy)
    # the proposals after plain steps still come from the right positions (a head fed
    # misaligned hidden states, or a draft that lost tokens, would accept next to nothing)
    assert stats.num_accepted / stats.num_proposed >= 0.3, stats


def test_mtp_rows_held_plain_for_long_fold_their_hidden_states(big_model):
    """A row kept plain for many steps records one hidden state per step; past
    MAX_PENDING records it keeps only the latest KEEP_PENDING positions and its head starts
    over from them: it then proposes exactly what a head fed only those positions does, and
    publishes no paired state (its head no longer describes the row's tokens)."""
    head = load_mtp_head(big_model.path, big_model.model)
    ids = big_model.tokenizer.encode(PROMPTS[2] * 40)[:MAX_PENDING + 88]
    n = len(ids) - 1  # the last token is the one fed next: no hidden state for it yet
    cache = make_prompt_cache(big_model.model)
    _, hidden = forward_with_hidden(big_model.model, mx.array(ids[:n])[None], cache)
    mx.eval(hidden)
    stepped = MtpProposer(big_model.model, head, identity="mtp:test")
    fresh = MtpProposer(big_model.model, head)
    stepped.open_row("r")
    fresh.open_row("r")
    for t in range(n):  # one record per plain step
        stepped.record_hidden("r", hidden[:, t:t + 1])
    row = stepped._rows["r"]
    kept = KEEP_PENDING + n - (MAX_PENDING + 1)
    assert len(row.pending) == n - MAX_PENDING and row.num_pending == kept
    assert stepped.state_at("r", ids[:n]) is None  # its head started over: nothing to pair
    fresh.record_hidden("r", hidden[:, n - kept:])
    got = stepped.propose([("r", ids, 4)])
    assert got == fresh.propose([("r", ids, 4)]) and len(got[0]) == 4
