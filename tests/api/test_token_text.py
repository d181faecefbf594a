"""Token frames carry their own token's text when `stop` is set (docs/protocol.md)."""

from __future__ import annotations

import pytest

from tests.api.wsclient import LONG_PROMPT, run_alone
from tests.unit.test_detokenize import released_by_spec


@pytest.mark.parametrize("stop", [["\n\n\n"], ["import sys", "zzz"]])
async def test_frames_with_stop_carry_their_own_tokens_text(server, draft_model, stop):
    tok = draft_model.tokenizer
    result = await run_alone(server.ws_url, "s", prompt=LONG_PROMPT, max_tokens=40,
                             temperature=0, stop=stop)
    ids, texts = result.token_ids, [f["text"] for f in result.tokens]
    assert result.finish_reason in ("length", "stop") and len(ids) > 10
    spec = released_by_spec(tok, ids, stop)
    assert result.text == (spec[-1] if result.finish_reason == "stop" else tok.decode(ids))
    num_own = 0
    for i, text in enumerate(texts[:-1]):
        assert "".join(texts[: i + 1]) == spec[i], (i, list(zip(ids, texts))[: i + 1])
        if spec[i] == tok.decode(ids[: i + 1]) and (i == 0 or spec[i - 1] == tok.decode(ids[:i])):
            assert text == tok.decode([ids[i]]), (i, list(zip(ids, texts))[: i + 1])
            num_own += 1
    assert num_own >= len(ids) // 4  # many frames hold nothing back
