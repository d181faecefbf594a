"""A burst of unequal prompts is prefilled in batched groups under --max-step-tokens:
greedy tokens stay mlx-lm's, and every request has its first token within the steps the
budget allows."""

from __future__ import annotations

import trio

from tqserve.actors.engine import open_engine
from tqserve.actors.messages import Token
from tqserve.engine.config import Config
from tqserve.engine.request import GenerateRequest
from tqserve.engine.sampling import SamplingParams
from tests.e2e.reference import PROMPTS, classify, reference

NEW_TOKENS = 6
BURST = 16
BUDGET = 160


async def test_burst_of_16_unequal_prompts(draft_model):
    prompts = [PROMPTS[i % len(PROMPTS)] + PROMPTS[(3 * i + 1) % len(PROMPTS)] * (1 + i % 3)
               for i in range(BURST)]
    lengths = [len(draft_model.tokenizer.encode(p)) for p in prompts]
    assert len(set(lengths)) >= 8
    refs = [reference(draft_model, p, NEW_TOKENS) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    first_step: list[int] = [0] * BURST
    config = Config(max_batch=BURST, max_step_tokens=BUDGET, prefill_chunk=512)
    async with open_engine(config, loaded=draft_model) as engine:
        before = engine.statistics().steps

        async def one(k: int) -> None:
            req = GenerateRequest(prompt=prompts[k], params=SamplingParams(
                max_tokens=NEW_TOKENS, temperature=0.0))
            async for event in engine.generate(req):
                if isinstance(event, Token):
                    if event.index == 0:
                        first_step[k] = engine.statistics().steps - before
                    outs[k].append(event.token_id)

        async with trio.open_nursery() as nursery:
            for k in range(BURST):
                nursery.start_soon(one, k)
    outcomes = [classify(out, want, gaps) for out, (want, gaps, _) in zip(outs, refs)]
    assert outcomes.count("same") >= BURST - 1, outcomes
    # All 16 arriving before the first step make one group: BUDGET // 16 = 10 columns of
    # it per step. Admission may split the burst across the first steps' groups; however it
    # splits, the steps prefill at most BURST * (max length - 1) padded tokens, and each
    # step gives prefill at least BUDGET - BURST (decoding rows) - BURST (rounding to
    # whole columns) of them. (The step count is read when the client sees the token, so
    # it can only be late: an upper bound is what is asserted.)
    bound = -(-BURST * (max(lengths) - 1) // (BUDGET - 2 * BURST)) + 3
    assert max(first_step) <= bound, (first_step, lengths, bound)



def test_unequal_group_through_the_cuda_attention_routing(draft_model, monkeypatch):
    """MLX-CUDA sends prefill blocks of 2..32 positions to short_block_attention (forced
    here on the CPU). Its padded rows once went NaN (the groups were left-padded then), and
    through 0 * NaN every padded row of the group with them: the first tokens of unequal prompts sent together were
    wrong (issue 19: 3 of 8 right on the H200). One prefill group of the engine's own
    PrefillGroups, then each row's next-token logits against the row alone."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from tqserve.engine.attention import sdpa as attention
    from tqserve.engine.prefill import PrefillGroups
    from tqserve.engine.step import PrefillChunk

    monkeypatch.setattr(attention, "on_cuda", lambda: True)
    attention.install_attention()
    model = draft_model.model
    prompts = [tuple(draft_model.tokenizer.encode(p)) for p in PROMPTS[:6]]
    width = max(map(len, prompts)) - 1
    assert width <= attention.SHORT_BLOCK and len({len(p) for p in prompts}) >= 5
    groups = PrefillGroups(model)
    for k in range(len(prompts)):
        groups.add(f"r{k}", 1, make_prompt_cache(model))
    groups.run([PrefillChunk(request_id=f"r{k}", start=0, end=len(p) - 1, group=1,
                             columns=width) for k, p in enumerate(prompts)],
               {f"r{k}": p for k, p in enumerate(prompts)})
    rows, cache = groups.take("r0")
    order = [int(r[1:]) for r in rows]
    # the group's slot batches decode every row's first token (as the engine's
    # decode batch does after the group joins)
    batch = model(mx.array([[prompts[k][-1]] for k in order]), cache=cache)[:, -1]
    for i, k in enumerate(order):
        want = model(mx.array(prompts[k])[None], cache=make_prompt_cache(model))[0, -1]
        assert not mx.isnan(batch[i]).any().item(), k
        assert mx.allclose(batch[i], want, atol=1e-4).item(), k
