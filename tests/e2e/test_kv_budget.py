"""The KV byte budget (engine.kv_budget; issue 20 #4: long rows grew a process without
bound). The core starts a row only while every admitted row's whole life fits; the
runner's real allocation stays under the charge at every step; rows that wait give the
tokens they give without a budget; one too large for the budget alone is refused."""

from __future__ import annotations

import pytest

from tqserve.engine.kv.slot_rows import SlotRows
from tqserve.engine.kv_budget import (SLOT_STEP, KvBudget, allocated_rows, ceil_step, grown,
                                      grown_rows, rows_bound, shrunk)
from tqserve.engine.memory import kv_bytes_per_position
from tqserve.engine.runner import Runner
from tqserve.engine.sampling import SamplingParams
from tqserve.engine.scheduler import SchedulerCore
from tqserve.engine.step import Finished, Started, TokenOut
from tests.e2e.reference import PROMPTS

NEW_TOKENS = 20


def _store(lengths: list[int], gone: int = 0) -> SlotRows:
    """A slot store holding rows of these lengths (after `gone` more rows left it)."""
    import mlx.core as mx

    slots = SlotRows()
    slots.add_rows([{"k": mx.zeros((1, 1, n, 1))} for n in lengths + [1] * gone])
    if gone:
        slots.take(list(range(len(lengths))))
    return slots


def test_the_charge_covers_the_slot_store_through_joins_growth_and_retirements():
    """Any rows admitted together: whatever order they join, grow and leave in, the
    store's allocation stays within the charge made when they were admitted."""
    import random

    import mlx.core as mx

    budget = KvBudget(budget_bytes=1 << 60, bytes_per_position=1)
    rng = random.Random(20261207)
    for trial in range(100):
        held = [rng.randint(1, 300) for _ in range(rng.choice((0, 1, 3, 6, 8)))]
        total = rng.choice((len(held), 8, 16, 32)) if held else 0  # rows there once
        slots = _store(held, gone=max(0, total - len(held)))
        pending = [rng.randint(1, 100) for _ in range(rng.randint(0 if held else 1, 12))]
        final = [n + rng.randint(0, 900) for n in held + pending]
        st = slots.statistics()
        charge = budget.charge(final, capacity=(st.row_capacity, st.position_capacity))
        rows = list(range(len(held)))  # the rows in the store: their index into `final`
        while rows or pending:
            op = rng.random()
            if pending and (op < 0.3 or not rows):
                k = rng.randint(1, len(pending))
                joining, pending = pending[:k], pending[k:]
                rows += range(len(final) - len(pending) - k, len(final) - len(pending))
                slots.add_rows([{"k": mx.zeros((1, 1, n, 1))} for n in joining])
            elif op < 0.35:
                keep = [j for j in range(len(rows)) if rng.random() < 0.7]
                slots.take(keep)
                rows = [rows[j] for j in keep]
            else:  # a step: every row gains positions; rows at their final length leave
                done = [j for j, r in enumerate(rows) if slots.lengths[j] >= final[r]]
                keep = [j for j in range(len(rows)) if j not in done]
                if done:
                    slots.take(keep)
                    rows = [rows[j] for j in keep]
                room = min((final[r] - n for r, n in zip(rows, slots.lengths)), default=0)
                if room:
                    slots.append({"k": mx.zeros((len(rows), 1, rng.randint(1, min(room, 128)), 1))})
            st = slots.statistics()
            assert st.row_capacity * st.position_capacity <= charge, (trial, st, charge)
            mx.eval(slots.planes())
    assert [allocated_rows(n) for n in range(1, 14)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12,
                                                          12, 16]
    assert grown_rows(0, 5) == 6 and grown_rows(4, 5) == 8 and grown_rows(4, 20) == 32
    assert rows_bound(0, 1) == 1 and rows_bound(8, 8) == 8 and rows_bound(8, 13) == 16
    assert rows_bound(0, 5) == 8 and rows_bound(0, 4) == 6 and rows_bound(6, 7) == 12


def test_a_store_of_any_first_size_shrinks_to_one_or_three_slots():
    """Halving keeps a capacity on its sequence, so a first allocation is 2**k or 3 * 2**k:
    an odd one (5 rows in 5 slots) could never halve, and one long row left of a burst of
    5 would keep 5 slots at its length."""
    for first, left in ((5, 3), (7, 2), (9, 3), (6, 3), (1, 1), (16, 2)):
        slots = _store([10] * first)
        for _ in range(first - 1):
            slots.take(list(range(slots.num_rows - 1)))
        assert slots.statistics().row_capacity <= left, (first, slots.statistics())


def test_a_growth_of_the_positions_leaves_the_empty_row_slots_behind():
    """16 rows were admitted; 6 are left when the longest needs more positions: the new
    store holds 8 row slots, not 16, and the budget charges no more than that."""
    slots = _store([200] * 6, gone=10)
    assert (slots.statistics().row_capacity, slots.statistics().position_capacity) == (16, 256)
    import mlx.core as mx

    before = slots.fetch()["k"]
    slots.append({"k": mx.ones((6, 1, 60, 1))})
    st = slots.statistics()
    assert (st.row_capacity, st.position_capacity, st.num_growths) == (8, 512, 1)
    assert mx.array_equal(slots.fetch()["k"][:, :, :200], before)
    assert grown((16, 256), 6, 260) == (8, 512) and grown((16, 256), 9, 260) == (16, 512)
    budget = KvBudget(budget_bytes=1 << 60, bytes_per_position=1)
    assert budget.charge([260] * 6, capacity=(16, 256)) == 16 * 256  # 8 x 512 after
    assert budget.charge([600] * 6, capacity=(16, 256)) == 8 * 768


def test_charge_and_the_refusal_name_the_sizes():
    budget = KvBudget(budget_bytes=8 << 20, bytes_per_position=1024, context=4096)
    assert budget.row_positions(100, 5000) == 4196
    assert budget.charge([300, 20], [(2, 40)]) == (2 * 512 + 2 * 256) * 1024
    assert budget.charge([300] * 5, [(6, 40)]) == (8 * 512 + 6 * 256) * 1024  # 6 group slots
    assert budget.charge([300], capacity=(4, 1024)) == 4 * 1024 * 1024
    budget.check_alone(100, 1000)
    # preempting: a row must be able to resume alone by prefilling its whole life again
    preempting = KvBudget(budget_bytes=8 << 20, bytes_per_position=1024, preempt=True)
    assert preempting.row_length(100, 5000, positions=300) == 300 + 256
    assert preempting.row_length(100, 50, positions=120) == 150  # never past its life
    assert budget.row_length(100, 5000, positions=300) == 4196
    assert shrunk((8, 1024), 2, 300) == (4, 1024) and shrunk((8, 2048), 1, 300) == (2, 512)
    assert shrunk((4, 512), 0, 0) == (0, 0)
    preempting.check_alone(100, 3000)  # (3328 + 3328) positions x 1 KiB < 8 MiB
    with pytest.raises(ValueError, match=r"needs 8\.5 MiB of KV cache"):
        preempting.check_alone(100, 4000)
    with pytest.raises(ValueError, match=r"prompt \(3000 tokens\) plus max_tokens \(4000\) "
                                         r"needs .* MiB of KV cache, more than .* budget"):
        budget.check_alone(3000, 4000)


def _drive(loaded, budget: KvBudget | None, prompts: list[tuple[int, ...]], chunk: int = 32,
           cancel: tuple[int, list[str]] = (-1, []), make_cache=None):
    """Tokens per request, the most rows decoding at once and the peak KV bytes; the
    runner's KV never passes the core's charge. `cancel`: after which step, which rows."""
    runner = Runner(loaded.model, make_cache)
    core = SchedulerCore(max_batch=8, prefill_chunk=chunk, eos_token_ids=(), kv_budget=budget)
    for k, p in enumerate(prompts):
        core.add(f"r{k}", p, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    out = {f"r{k}": [] for k in range(len(prompts))}
    most, peak = 0, 0
    for step in range(400):
        if not core.has_work():
            return out, most, peak
        plan, _ = core.schedule()
        charge = core.kv_charge()
        result = runner.execute(plan)
        most = max(most, len(plan.decode))
        peak = max(peak, result.kv_bytes)
        if budget is not None:
            assert result.kv_bytes <= charge <= budget.budget_bytes, step
        events = core.postprocess(result)
        for rid in cancel[1] if step == cancel[0] else ():
            events += core.cancel(rid)
        for event in events:
            if isinstance(event, TokenOut):
                out[event.request_id] += event.token_ids
            elif isinstance(event, Finished):
                assert event.finish_reason == ("cancelled" if event.request_id in cancel[1]
                                               else "length")
    raise AssertionError("still working after 400 steps")


def test_rows_wait_for_the_budget_and_give_the_same_tokens(draft_model):
    tok = draft_model.tokenizer
    prompts = [tuple(tok.encode(PROMPTS[k])) for k in range(6)]
    per_position = kv_bytes_per_position(draft_model.model, Runner(draft_model.model)._make_cache)
    budget = KvBudget(budget_bytes=2 * 2 * ceil_step(64) * per_position
                      + 2 * ceil_step(32) * per_position, bytes_per_position=per_position)
    free, most_free, _ = _drive(draft_model, None, prompts)
    held, most_held, peak = _drive(draft_model, budget, prompts)
    assert held == free
    # the first two start together (a prefill group of two); later rows start as the
    # batch's allocation allows, never past the budget (checked at every step)
    assert most_free == 6 and most_held == 4
    assert 0 < peak <= budget.budget_bytes


@pytest.mark.parametrize("turboquant,start", [(None, 0), ("k4v4", 12)])
def test_a_prefill_group_that_rows_left_is_charged_the_slots_it_keeps(draft_model, turboquant,
                                                                      start):
    """7 rows prefill in a group of 8 slots; 4 are cancelled after its first chunk. The
    3 left keep the 8 slots (a store halves at a quarter in use), and the charge counts
    those 8, not 3 (it counted 3: the runner's KV passed the charge). The group then
    starts the decode batch in a store of its 3 rows (it took the 8 slots along)."""
    from tqserve.engine.kv.factory import cache_factory_for

    tok, model = draft_model.tokenizer, draft_model.model
    make_cache = cache_factory_for(model, turboquant, start)
    prompts = [tuple(tok.encode(PROMPTS[k])) for k in range(2, 9)]
    assert min(map(len, prompts)) > 4
    per_position = kv_bytes_per_position(model, Runner(model, make_cache)._make_cache)
    budget = KvBudget(budget_bytes=1 << 40, bytes_per_position=per_position)
    gone = ["r0", "r2", "r4", "r6"]
    out, _, peak = _drive(draft_model, budget, prompts, 4, (0, gone), make_cache)
    free, _, _ = _drive(draft_model, None, prompts, 4, make_cache=make_cache)
    assert peak >= 8 * SLOT_STEP * per_position  # the group's 8 slots were allocated
    assert {r: out[r] for r in ("r1", "r3", "r5")} == {r: free[r] for r in ("r1", "r3", "r5")}
    assert all(out[r] == [] for r in gone)


def test_rows_start_only_while_the_groups_they_form_fit():
    """5 rows from scratch (one group: 6 slots) and 1 reusing a prefix (its own group: 1
    slot) take 7 group slots, not the 6 of one group of 6: the check before they start
    counts the groups they form, so the charge never passes the budget once they did."""
    def core_with(budget_bytes: int) -> SchedulerCore:
        core = SchedulerCore(max_batch=8, prefill_chunk=2, eos_token_ids=(), kv_budget=KvBudget(
            budget_bytes=budget_bytes, bytes_per_position=1))
        for k in range(5):
            core.add(f"r{k}", tuple(range(1, 11)), SamplingParams(max_tokens=8))
        core.add("reuse", tuple(range(1, 21)), SamplingParams(max_tokens=8), reuse="s",
                 cached=4)
        return core

    free = core_with(1 << 40)
    started = [e for e in free.schedule()[1] if isinstance(e, Started)]
    need = free.kv_charge()
    assert len(started) == 6 and need == (8 + 6 + 1) * SLOT_STEP  # decode rows, groups
    tight = core_with(need - 1)
    started = [e for e in tight.schedule()[1] if isinstance(e, Started)]
    assert len(started) == 5 and tight.kv_charge() <= need - 1


async def test_the_server_refuses_a_request_the_budget_cannot_hold(nursery, draft_model):
    import httpx

    from tests.conftest import start_server

    server = await start_server(nursery, draft_model, kv_budget_bytes=8 << 20)
    async with httpx.AsyncClient(timeout=60) as client:
        big = await client.post(server.url + "/v1/completions",
                                json={"prompt": "import os\n", "max_tokens": 4000})
        assert big.status_code == 400, big.text
        assert "more than the server's KV budget of 8.0 MiB" in big.json()["error"]["message"]
        ok = await client.post(server.url + "/v1/completions",
                               json={"prompt": "import os\n", "max_tokens": 4})
        assert ok.status_code == 200
        stats = (await client.get(server.url + "/v1/stats")).json()
        assert stats["kv_budget_bytes"] == 8 << 20 and stats["kv_charged_bytes"] == 0
