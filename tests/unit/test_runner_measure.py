"""The runner's step measurement (what the speculation time policy learns from): steady
decode steps report their duration, except the first step of each forward shape, whose
time on MLX-CUDA includes compiling that shape's kernels (the H200 run of issue 10 saw
verify steps measured at 13-36 tok/s against 350-640 plain, and speculation turned off)."""

from __future__ import annotations

from typing import Any

import attrs

from tqserve.engine.runner import Runner
from tqserve.engine.sampling import SamplingParams
from tqserve.engine.scheduler import SchedulerCore
from tqserve.engine.speculative.policy import SpecChoice
from tqserve.engine.speculative.proposers import LookupProposer
from tqserve.engine.speculative.speculator import Speculator

# a repetitive prompt: prompt lookup finds n-grams to propose from
PROMPT = tuple([7, 8, 9, 10, 11] * 6)


def test_first_step_of_each_shape_is_not_measured(draft_model: Any) -> None:
    speculator = Speculator({"lookup": LookupProposer()},
                            SpecChoice(method="lookup", num_tokens=3))
    core = SchedulerCore(max_batch=4, prefill_chunk=64, eos_token_ids=(),
                         speculative_methods=speculator.proposers)
    runner = Runner(draft_model.model, speculator=speculator)
    core.add("a", PROMPT, SamplingParams(max_tokens=40, temperature=0.0))
    seen: set[tuple[str, int, int]] = set()
    measured = {"plain": 0, "speculative": 0}
    for step in range(60):
        if not core.has_work():
            break
        plan, _ = core.schedule()
        if step % 8 >= 4:  # four verify steps (k = 1, 2, 3, 3), four plain ones, again
            plan = attrs.evolve(plan, propose=(("a", min(step % 8 - 3, 3)),))
        result = runner.execute(plan)
        core.postprocess(result)
        shape = runner.step_shape
        if shape is not None and shape not in seen:
            assert result.decode_seconds is None, (step, shape)
            seen.add(shape)
        elif result.decode_seconds is not None:
            measured["speculative" if result.speculative else "plain"] += 1
    assert {s[0] for s in seen} == {"plain", "speculative"}
    assert measured["plain"] > 0 and measured["speculative"] > 0, measured
