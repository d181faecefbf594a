"""Grammar rows speculate: proposals are cut to the prefix the row's grammar accepts, every
verified position samples under the mask after the proposals before it, so a constrained
speculating row gives exactly its plain twin's tokens, next to unconstrained rows."""

from __future__ import annotations

import trio

from tqserve.actors.engine import open_engine
from tqserve.actors.messages import Done, Error, Token
from tqserve.engine.config import Config
from tqserve.engine.request import GenerateRequest
from tqserve.engine.sampling import SamplingParams

PROMPT = "answers = [\n    'yes: abc!',\n    'no: xyz!',\n    'yes: abc!',\n    '"
FORMAT = {"type": "regex", "pattern": "((yes|no): [a-z]{2,5}!', '){2,4}done"}


async def _one(engine, out, key, speculative, response_format, temperature=0.0, seed=None):
    req = GenerateRequest(prompt=PROMPT, speculative=speculative, response_format=response_format,
                          params=SamplingParams(max_tokens=40, temperature=temperature,
                                                seed=seed))
    tokens = []
    async for event in engine.generate(req):
        if isinstance(event, Token):
            tokens.append(event.token_id)
        elif isinstance(event, (Done, Error)):
            out[key] = (tokens, event)


async def test_grammar_rows_speculate_and_keep_their_tokens(draft_model):
    config = Config(max_batch=6, speculative="lookup", num_speculative_tokens=4,
                    speculative_time_policy=False)
    out: dict = {}
    async with open_engine(config, loaded=draft_model) as engine:
        async with trio.open_nursery() as nursery:
            for spec in (None, False):
                nursery.start_soon(_one, engine, out, ("greedy", spec), spec, FORMAT)
                nursery.start_soon(_one, engine, out, ("seeded", spec), spec, FORMAT, 1.0, 5)
                nursery.start_soon(_one, engine, out, ("free", spec), spec, None)
    for kind in ("greedy", "seeded", "free"):
        spec_tokens, spec_done = out[(kind, None)]
        plain_tokens, plain_done = out[(kind, False)]
        assert isinstance(spec_done, Done) and isinstance(plain_done, Done), spec_done
        assert spec_tokens == plain_tokens, kind
        assert plain_done.speculative is None
    text = draft_model.tokenizer.decode(out[("greedy", None)][0])
    assert text.endswith("done") and out[("greedy", None)][1].finish_reason == "stop"
    usage = out[("greedy", None)][1].speculative
    assert usage is not None and usage[1] > 0  # the grammar row accepted proposals
