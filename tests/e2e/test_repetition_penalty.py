"""repetition_penalty end to end: a served request gives exactly the tokens of an
independent greedy loop over mlx-lm's model that applies the penalty itself."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from tests.api.wsclient import LONG_PROMPT, run_alone

MAX_TOKENS = 24


def penalized_greedy(loaded, prompt: str, penalty: float, max_tokens: int) -> list[int]:
    """Greedy decoding over a plain mlx-lm cache; before each argmax every id seen so far
    (prompt and output, no window) has its logit divided by `penalty` if positive,
    multiplied if negative."""
    ids = loaded.tokenizer.encode(prompt)
    cache = make_prompt_cache(loaded.model)
    logits = loaded.model(mx.array(ids)[None], cache=cache)[0, -1].astype(mx.float32)
    seen, out = list(ids), []
    for _ in range(max_tokens):
        line = logits.tolist()
        for t in set(seen):
            line[t] = line[t] * penalty if line[t] < 0 else line[t] / penalty
        token = max(range(len(line)), key=line.__getitem__)
        out.append(token)
        if token in loaded.eos_token_ids:
            break
        seen.append(token)
        logits = loaded.model(mx.array([[token]]), cache=cache)[0, -1].astype(mx.float32)
    return out


@pytest.mark.parametrize("penalty", [1.3, 0.8])
async def test_served_repetition_penalty_equals_the_reference_loop(server, draft_model, penalty):
    want = penalized_greedy(draft_model, LONG_PROMPT, penalty, MAX_TOKENS)
    plain = penalized_greedy(draft_model, LONG_PROMPT, 1.0, MAX_TOKENS)
    assert want != plain  # the penalty changes this output
    result = await run_alone(server.ws_url, "rp", prompt=LONG_PROMPT, max_tokens=MAX_TOKENS,
                             temperature=0, repetition_penalty=penalty)
    assert result.token_ids == want, (result.token_ids, want)
