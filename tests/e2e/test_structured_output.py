"""Structured output in the batch: hundreds of seeded samples at temperature 1 always obey
their JSON schema / regex / Lark grammar, mixed with unconstrained rows whose greedy tokens
are unchanged; seeded constrained rows are the same alone and in the batch; logprobs are
the model's raw ones; no row leaks."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import lark
import llguidance
import llguidance.hf
import trio

from tqserve.actors.engine import open_engine
from tqserve.actors.messages import Done, Error, Token
from tqserve.engine.config import Config
from tqserve.engine.request import GenerateRequest
from tqserve.engine.sampling import SamplingParams
from tqserve.engine.structured import validate_response_format
from tests.e2e.reference import PROMPTS

SCHEMA_PETS = {
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "dog", "bird"]},
                   "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "ok": {"type": "boolean"}},
    "required": ["kind", "n", "ok"], "additionalProperties": False}
SCHEMA_TAGS = {
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 6},
                   "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                   "size": {"anyOf": [{"type": "integer", "minimum": -9, "maximum": 9},
                                      {"type": "null"}]}},
    "required": ["name", "tags", "size"], "additionalProperties": False}
REGEXES = (r"(yes|no): [0-9]{1,3}", r"[A-Z][a-z]{1,8}( [a-z]{1,8}){0,3}\.")
LARK = r"""
start: NAME "(" [arg (", " arg)?] ")"
arg: NUMBER | STRING
NAME: /[a-z_]{1,8}/
NUMBER: /[0-9]{1,4}/
STRING: /"[a-z ]{0,8}"/
"""
FORMATS: dict[str, dict[str, Any]] = {
    "pets": {"type": "json_schema", "json_schema": {"name": "pets", "schema": SCHEMA_PETS}},
    "tags": {"type": "json_schema", "json_schema": {"name": "tags", "schema": SCHEMA_TAGS,
                                                    "strict": True}},
    "object": {"type": "json_object"},
    "regex0": {"type": "regex", "pattern": REGEXES[0]},
    "regex1": {"type": "regex", "pattern": REGEXES[1]},
    "lark": {"type": "grammar", "lark": LARK},
}
# samples per format: 200 JSON-schema samples, and the other forms beside them
COUNTS = {"pets": 100, "tags": 100, "object": 30, "regex0": 25, "regex1": 25, "lark": 30}
MAX_TOKENS = 48
CONCURRENT = 48          # requests in flight at once (the admission bound is 64)
UNCONSTRAINED = 6        # greedy rows that run inside the constrained batch
LOGPROB_TOLERANCE = 1e-4


class Outcome:
    def __init__(self) -> None:
        self.tokens: list[Token] = []
        self.end: Done | Error | None = None

    @property
    def ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)


async def run(engine, request: GenerateRequest, out: Outcome) -> None:
    async for event in engine.generate(request):
        if isinstance(event, Token):
            out.tokens.append(event)
        elif isinstance(event, (Done, Error)):
            out.end = event


def constrained(name: str, seed: int) -> GenerateRequest:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
    return GenerateRequest(prompt=PROMPTS[seed % len(PROMPTS)], params=params,
                           response_format=FORMATS[name])


def greedy(k: int) -> GenerateRequest:
    return GenerateRequest(prompt=PROMPTS[k], params=SamplingParams(max_tokens=32,
                                                                    temperature=0.0))


def check_output(name: str, text: str) -> None:
    """A finished output obeys its format (checked by libraries other than llguidance)."""
    if name in ("pets", "tags"):
        jsonschema.validate(json.loads(text), FORMATS[name]["json_schema"]["schema"])
    elif name == "object":
        assert isinstance(json.loads(text), dict), text
    elif name.startswith("regex"):
        assert re.fullmatch(REGEXES[int(name[-1])], text), text
    else:
        lark.Lark(LARK, parser="earley").parse(text)


async def test_two_hundred_schema_samples_and_other_forms_in_a_mixed_batch(draft_model):
    tokenizer = draft_model.tokenizer
    ll_tokenizer = llguidance.hf.from_tokenizer(
        tokenizer._tokenizer, n_vocab=draft_model.vocab_size,
        eos_token=sorted(draft_model.eos_token_ids))
    jobs = [(name, seed) for name, n in COUNTS.items() for seed in range(n)]
    async with open_engine(Config(max_batch=32), loaded=draft_model) as engine:
        alone_greedy = [Outcome() for _ in range(UNCONSTRAINED)]
        for k, out in enumerate(alone_greedy):
            await run(engine, greedy(k), out)
        alone_seeded = {job: Outcome() for job in jobs[::67]}
        for (name, seed), out in alone_seeded.items():
            await run(engine, constrained(name, seed), out)
        results = {job: Outcome() for job in jobs}
        mixed_greedy = [Outcome() for _ in range(UNCONSTRAINED)]
        limiter = trio.CapacityLimiter(CONCURRENT)

        async def one(request: GenerateRequest, out: Outcome) -> None:
            async with limiter:
                await run(engine, request, out)

        greedy_at = {k * (len(jobs) // UNCONSTRAINED) + 5: k for k in range(UNCONSTRAINED)}
        async with trio.open_nursery() as nursery:  # the limiter admits in FIFO order
            for i, job in enumerate(jobs):
                nursery.start_soon(one, constrained(*job), results[job])
                if i in greedy_at:
                    k = greedy_at[i]
                    nursery.start_soon(one, greedy(k), mixed_greedy[k])
        await engine.wait_idle()
        assert engine.statistics().rows_active == 0

    truncated = {name: 0 for name in COUNTS}
    for (name, seed), out in results.items():
        assert isinstance(out.end, Done), (name, seed, out.end)
        if out.end.finish_reason == "length":  # must at least be a valid prefix
            truncated[name] += 1
            matcher = llguidance.LLMatcher(ll_tokenizer, validate_response_format(
                FORMATS[name]).grammar)
            assert matcher.consume_tokens(out.ids) and not matcher.is_error(), (name, out.text)
            continue
        assert out.end.finish_reason == "stop", (name, seed, out.end)
        check_output(name, out.text)
    # schemas, regexes and the grammar above bound their output: only json_object may run on
    assert {k: v for k, v in truncated.items() if k != "object"} == {
        k: 0 for k in COUNTS if k != "object"}, truncated
    for job, out in alone_seeded.items():
        assert out.ids == results[job].ids, job
    assert [g.ids for g in mixed_greedy] == [g.ids for g in alone_greedy]
