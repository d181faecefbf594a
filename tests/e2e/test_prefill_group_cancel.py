"""A cancel in the middle of a batched prefill group leaves every other row untouched
(issue 20 #3: cancelling the longest row of a group made the next step raise
`[broadcast_shapes] (1,1,32,128) and (1,1,0,128)`, failing the group's other rows and an
unrelated stream). The sans-io core drives the real runner: for every KV kind, each row
position of a group of unequal prompts is cancelled after each of its prefill chunks, and
the other rows, and a row decoding beside the group, give the tokens of the run without
the cancel."""

from __future__ import annotations

import pytest

from tqserve.engine.kv.factory import cache_factory_for
from tqserve.engine.runner import Runner
from tqserve.engine.sampling import SamplingParams
from tqserve.engine.scheduler import SchedulerCore
from tqserve.engine.step import Finished, TokenOut
from tests.e2e.reference import PROMPTS

CHUNK = 8
NEW_TOKENS = 4
KINDS = {"plain": (None, 0, None), "turboquant": ("k4v4", 0, None),
         "delayed": ("k4v4", 12, None), "affine": (None, 0, 8)}
GROUP = (PROMPTS[2], PROMPTS[0], PROMPTS[5])  # longest, shortest, middle (29, 3, 14 tokens)


def _run(loaded, kind: str, cancel: tuple[int, int] | None) -> dict[str, list[int]]:
    """Tokens per request; `cancel` = (row of the group, after how many group chunks)."""
    turboquant, start, kv_quant = KINDS[kind]
    runner = Runner(loaded.model, cache_factory_for(loaded.model, turboquant, start, kv_quant))
    core = SchedulerCore(max_batch=4, prefill_chunk=CHUNK, eos_token_ids=())
    tok = loaded.tokenizer
    core.add("beside", tuple(tok.encode(PROMPTS[1])), SamplingParams(max_tokens=12,
                                                                     temperature=0.0))
    out: dict[str, list[int]] = {"beside": []}
    num_chunks = 0
    for _ in range(60):
        if not core.has_work():
            return out
        if out["beside"] and "g0" not in out:  # "beside" decodes: the group arrives
            for k, prompt in enumerate(GROUP):
                core.add(f"g{k}", tuple(tok.encode(prompt)),
                         SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
                out[f"g{k}"] = []
        plan, _ = core.schedule()
        grouped = any(c.request_id.startswith("g") for c in plan.prefill)
        events = core.postprocess(runner.execute(plan))
        num_chunks += grouped
        if grouped and cancel is not None and num_chunks == cancel[1] + 1:
            events += core.cancel(f"g{cancel[0]}")
        for event in events:
            if isinstance(event, TokenOut):
                out[event.request_id] += list(event.token_ids)
            elif isinstance(event, Finished):
                assert event.finish_reason in ("length", "cancelled"), event
    raise AssertionError("still working after 60 steps")


@pytest.mark.parametrize("kind", list(KINDS))
def test_cancel_each_row_of_a_prefill_group_at_each_chunk(draft_model, kind):
    lengths = [len(draft_model.tokenizer.encode(p)) - 1 for p in GROUP]
    num_chunks = -(-max(lengths) // CHUNK)
    assert num_chunks >= 3 and len(set(lengths)) == 3
    whole = _run(draft_model, kind, None)
    assert all(len(t) == NEW_TOKENS for k, t in whole.items() if k != "beside")
    for row in range(len(GROUP)):
        for after in range(num_chunks - 1):
            got = _run(draft_model, kind, (row, after))
            for rid, tokens in whole.items():
                if rid != f"g{row}":
                    assert got[rid] == tokens, (kind, row, after, rid)
            assert got[f"g{row}"] == []
