"""Warm-up: run the shapes serving will meet once, before the first request does.

On a GPU the first forward of each batch size and prefill group shape compiles kernels
(MLX-CUDA's JIT kernels, TurboQuant's decode kernels: tens of seconds for the first
TurboQuant request in issue 9), and that time would land on a user's request. `warm_up`
drives a private SchedulerCore and the real Runner through a burst of short requests per
decode batch bucket (1, 2, 4, ... up to max_batch, and max_batch itself): each burst
prefills as one group under the engine's own --prefill-chunk and --max-step-tokens (the
group shapes a burst of that size meets) and decodes a few steps at that batch size, half
of its rows greedy and half sampled (top-p, seeded: the sampling chain's sort and noise).
Every second row's prompt is one token shorter, so batches of two or more rows decode with
the attention mask of uneven lengths and a single row without one (engine.kv.slots): both
attention paths are warmed.
Then the runner is reset: no row, no KV and no snapshot is left behind, and every
request served afterwards gets the same tokens as without warm-up.

Runs on the runner thread (it calls the runner directly), before the actors start.
Prompt lengths other than WARMUP_PROMPT_TOKENS still meet new prefill shapes.
"""

from __future__ import annotations

import time
from typing import Callable

import attrs

from tqserve.engine.model import auto_on_gpu
from tqserve.engine.runner import Runner
from tqserve.engine.sampling import SamplingParams
from tqserve.engine.scheduler import SchedulerCore

WARMUP_PROMPT_TOKENS = 32   # prompt length of every warm-up request
WARMUP_NEW_TOKENS = 4       # tokens each generates: the pipelined decode steps' shapes
WARMUP_FIRST_TOKEN = 2      # prompt ids are consecutive from here (0 and 1 are special)


@attrs.frozen(kw_only=True)
class WarmupReport:
    """What a warm-up ran."""

    batches: tuple[int, ...]     # decode batch sizes warmed, in order
    num_steps: int               # engine steps run
    num_forward_tokens: int      # tokens the runner's forwards processed
    seconds: float


def wanted(setting: str) -> bool:
    """Whether --warmup `setting` (auto | on | off) warms up here: auto on a GPU only."""
    return auto_on_gpu(setting)


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """The decode batch sizes warmed: powers of two below max_batch, and max_batch."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch]
    return (*sizes, max_batch)


def warm_up(runner: Runner, *, max_batch: int, prefill_chunk: int, max_step_tokens: int,
            vocab_size: int, progress: Callable[[str], None] = lambda line: None
            ) -> WarmupReport:
    """Run every batch bucket once through `runner` (module doc); returns what ran.
    `progress` gets one line per bucket. The runner must hold no rows."""
    if runner.statistics().num_rows:
        raise RuntimeError("warm-up needs an idle runner")
    start = time.perf_counter()
    forward_before = runner.statistics().num_forward_tokens
    core = SchedulerCore(max_batch=max_batch, prefill_chunk=prefill_chunk,
                         max_step_tokens=max_step_tokens, eos_token_ids=())
    buckets = batch_buckets(max_batch)
    prompt = tuple((WARMUP_FIRST_TOKEN + i) % vocab_size for i in range(WARMUP_PROMPT_TOKENS))
    try:
        for n, size in enumerate(buckets, 1):
            progress(f"warm-up: batch {size} ({n}/{len(buckets)}), "
                     f"{time.perf_counter() - start:.1f} s so far")
            for i in range(size):
                params = SamplingParams(max_tokens=WARMUP_NEW_TOKENS, temperature=0.0) \
                    if i % 2 == 0 else SamplingParams(max_tokens=WARMUP_NEW_TOKENS,
                                                      temperature=0.8, top_p=0.95, seed=i)
                core.add(f"warmup-{size}-{i}", prompt[:len(prompt) - i % 2], params)
            while core.has_work():
                plan, _ = core.schedule()
                core.postprocess(runner.execute(plan))
    finally:
        runner.reset()
    seconds = time.perf_counter() - start
    progress(f"warm-up: done, {len(buckets)} batch sizes in {seconds:.1f} s")
    return WarmupReport(batches=buckets, num_steps=core.statistics().num_steps,
                        num_forward_tokens=runner.statistics().num_forward_tokens
                        - forward_before, seconds=seconds)
