"""Structured output at the core: the sans-io scheduler driving the real runner and model.

A constrained greedy row reports the target model's raw logprobs (not the masked
distribution's); a grammar that stops ends the row with "stop" and no EOS token; a row
whose matcher cannot be built finishes with "error" and a message naming response_format
(an `invalid_request` event through the engine),
while the unconstrained row beside it runs on; the grammar statistics count the work."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tqserve.engine.runner import Runner
from tqserve.engine.sampling import SamplingParams
from tqserve.engine.scheduler import SchedulerCore
from tqserve.engine.step import Finished, TokenOut
from tqserve.engine.structured import GrammarMasks, validate_response_format

MAX_STEPS = 200
LOGPROB_TOLERANCE = 1e-4  # nats: one full forward vs step-by-step decode in float32


def make(loaded, masks: GrammarMasks) -> tuple[SchedulerCore, Runner]:
    core = SchedulerCore(max_batch=4, prefill_chunk=64, eos_token_ids=loaded.eos_token_ids)
    return core, Runner(loaded.model, masks=masks)


def drive(core: SchedulerCore, runner: Runner) -> list:
    events: list = []
    for _ in range(MAX_STEPS):
        if not core.has_work():
            return events
        plan, started = core.schedule()
        events += started
        events += core.postprocess(runner.execute(plan))
    raise AssertionError(f"still working after {MAX_STEPS} steps")


def masks_for(loaded, tokenizer=None) -> GrammarMasks:
    return GrammarMasks(loaded.tokenizer if tokenizer is None else tokenizer,
                        loaded.vocab_size, loaded.eos_token_ids)


def test_constrained_greedy_logprobs_are_the_models_raw_ones(draft_model):
    masks = masks_for(draft_model)
    core, runner = make(draft_model, masks)
    prompt = tuple(draft_model.tokenizer.encode("import os\n"))
    fmt = validate_response_format({"type": "regex", "pattern": "(yes|no): [a-z]{2,5}!"})
    core.add("c", prompt, SamplingParams(max_tokens=24, temperature=0.0, logprobs=True,
                                         top_logprobs=3), response_format=fmt)
    core.add("u", prompt, SamplingParams(max_tokens=5, temperature=0.0))
    events = drive(core, runner)
    outs = [e for e in events if isinstance(e, TokenOut) and e.request_id == "c"]
    (done,) = [e for e in events if isinstance(e, Finished) and e.request_id == "c"]
    ids = [t for e in outs for t in e.token_ids]
    logprobs = [lp for e in outs for lp in e.logprobs]
    tops = [top for e in outs for top in e.top_logprobs]
    text = draft_model.tokenizer.decode(ids)
    assert done.finish_reason == "stop" and text.endswith("!") and text[:2] in ("ye", "no")
    assert outs[-1].final and ids[-1] not in draft_model.eos_token_ids  # the grammar stopped it
    logits = draft_model.model(mx.array(list(prompt) + ids[:-1])[None])[0, len(prompt) - 1:]
    raw = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    masked_off = 0
    for i, tok in enumerate(ids):
        assert logprobs[i] == pytest.approx(raw[i, tok].item(), abs=LOGPROB_TOLERANCE)
        top = [t for t, _ in tops[i]]
        assert top == mx.argsort(-raw[i])[:3].tolist()
        masked_off += top[0] != tok  # the raw favourite that the grammar refused
    assert masked_off > 0  # the grammar did steer this greedy row
    stats = masks.statistics()
    assert stats.num_rows == 1 and stats.num_masks == len(ids)
    assert stats.mask_seconds > 0 and stats.consume_seconds > 0


def test_a_matcher_that_cannot_be_built_fails_only_its_row(draft_model):
    core, runner = make(draft_model, masks_for(draft_model, tokenizer=object()))
    prompt = tuple(draft_model.tokenizer.encode("def f():"))
    fmt = validate_response_format({"type": "json_object"})
    core.add("c", prompt, SamplingParams(max_tokens=8), response_format=fmt)
    core.add("u", prompt, SamplingParams(max_tokens=6, temperature=0.0))
    events = drive(core, runner)
    finished = {e.request_id: e for e in events if isinstance(e, Finished)}
    assert finished["c"].finish_reason == "error" and finished["c"].completion_tokens == 0
    assert "response_format" in finished["c"].error and "tokenizer" in finished["c"].error
    assert not [e for e in events if isinstance(e, TokenOut) and e.request_id == "c"]
    assert finished["u"].finish_reason == "length" and finished["u"].error is None
    assert runner.statistics().num_rows == 0 and runner.kv_bytes() == 0


class _OpaqueTokenizer:
    """The model's tokenizer for everything but llguidance, which cannot convert it."""

    _tokenizer = object()

    def __init__(self, real) -> None:
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)


async def test_a_failed_matcher_is_an_invalid_request_event_through_the_engine(draft_model):
    import attrs
    import trio

    from tqserve.actors.engine import open_engine
    from tqserve.actors.messages import Done, Error
    from tqserve.engine.config import Config
    from tqserve.engine.request import GenerateRequest

    loaded = attrs.evolve(draft_model, tokenizer=_OpaqueTokenizer(draft_model.tokenizer))
    ends: dict[str, object] = {}

    async def run(name: str, request: GenerateRequest) -> None:
        async for event in engine.generate(request):
            if isinstance(event, (Done, Error)):
                ends[name] = event

    async with open_engine(Config(), loaded=loaded) as engine:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "c", GenerateRequest(
                prompt="x = ", params=SamplingParams(max_tokens=8),
                response_format={"type": "json_object"}))
            nursery.start_soon(run, "u", GenerateRequest(
                prompt="x = ", params=SamplingParams(max_tokens=8, temperature=0.0)))
        await engine.wait_idle()
    assert isinstance(ends["c"], Error) and ends["c"].code == "invalid_request"
    assert "response_format" in ends["c"].message and "tokenizer" in ends["c"].message
    assert isinstance(ends["u"], Done) and ends["u"].finish_reason == "length"


def test_a_row_opened_with_its_output_so_far_masks_where_that_output_left_it(draft_model):
    """A preempted row resumes with a fresh matcher that has consumed its output so far
    (GrammarMasks.open_row(fmt, consumed)): its first mask is the one a matcher that
    advanced token by token had; output the grammar refuses fails the row by name."""
    masks = masks_for(draft_model)
    fmt = validate_response_format(
        {"type": "regex", "pattern": r"(?:[a-z ]{1,40}\n[=() ]{1,40}\n)+"})
    tokens = draft_model.tokenizer.encode("ab c\n(=)\nxy")
    stepped = masks.open_row(fmt)
    for token in tokens:
        assert stepped.mask() is not None
        stepped.advance(token)
    resumed = masks.open_row(fmt, tokens)
    fresh = masks.open_row(fmt)
    assert (resumed.mask() == stepped.mask()).all()
    assert not (resumed.mask() == fresh.mask()).all()  # the grammar's place matters here
    assert resumed.error is None and stepped.error is None
    bad = masks.open_row(fmt, draft_model.tokenizer.encode("ab\nxy"))  # letters on a "=()" line
    assert bad.mask() is None and "does not fit" in (bad.error or "")
