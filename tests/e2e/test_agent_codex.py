"""OpenAI's Codex CLI runs a prompt end to end against tqserve's Responses API
(tools/agent_codex.py), where `codex` is installed (npm install -g @openai/codex)."""

from __future__ import annotations

import pytest

from tqserve.tools import agent_codex


def test_codex_exec_runs_a_turn_against_tqserve(capsys):
    if agent_codex.codex_binary() is None:
        pytest.skip("codex not found: npm install -g @openai/codex (or set TQSERVE_CODEX)")
    code = agent_codex.main(["--max-tokens", "4", "--prompt", "Say hello."])
    out = capsys.readouterr().out
    # Codex sent its whole turn (instructions, ~20 function tools, web_search skipped) to
    # /v1/responses, streamed the answer, and read our status: the 4M bundled model never
    # ends on its own, so the response is incomplete at max_output_tokens and Codex says so
    assert "route=POST /v1/responses status=200 outcome=length" in out
    assert "completion_tokens=4" in out
    assert "Incomplete response returned, reason: max_output_tokens" in out
    assert "tokens used" in out and code == 1
