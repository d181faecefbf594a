"""Tool calls in model output: one module per template family, chosen from the template.

A family (hermes, qwen3_coder, llama3, mistral, gemma) knows the markers its models write
around a call (`start`, and `end`, or None where a call runs to the output's end), how
to read a call's body (`parse`: a list of (name, arguments) or ValueError), and the Lark
grammar that forces one call matching the tools' schemas (`grammar`, for tool_choice
`required` and a named function). `family_of` picks the family from the chat template's
text, as mlx-lm and vLLM infer theirs; `stream.ToolCallStream` splits an output, fed in
chunks of any size, into text and calls, returning a malformed call as text.
"""

from __future__ import annotations

from types import ModuleType

from tqserve.api.toolcalls import gemma, hermes, llama3, mistral, qwen3_coder
from tqserve.api.toolcalls.schema import ToolCall, arguments_json, schemas_of

__all__ = ["FAMILIES", "ToolCall", "arguments_json", "family_of", "schemas_of"]

FAMILIES: dict[str, ModuleType] = {m.NAME: m for m in (hermes, qwen3_coder, llama3,
                                                       mistral, gemma)}
# (text in the template, family), the first match wins: the most specific markers first
_SIGNS = (("<start_function_call>", "gemma"), ("<function=", "qwen3_coder"),
          ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3"),
          ("<|start_header_id|>", "llama3"), ("<tool_call>", "hermes"))
DEFAULT_FAMILY = "hermes"  # templates that show no format of their own


def family_of(template: str | None) -> ModuleType:
    """The family whose markers the chat template writes (hermes where it shows none)."""
    for sign, name in _SIGNS:
        if template and sign in template:
            return FAMILIES[name]
    return FAMILIES[DEFAULT_FAMILY]


