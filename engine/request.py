"""A generation request as the embedded API and the WebSocket take it.

Exactly one of `prompt` (text), `prompt_tokens` (ids) or `messages` (chat) is
given. Chat messages use the tokenizer's chat template when it has one; a
tokenizer without one (the bundled pycoder models) gets "role: content" lines
followed by "assistant: ", which is written down here so that clients know.
"""

from __future__ import annotations

from typing import Any, Iterable

import attrs

from engine.sampling import SamplingParams

ROLES = ("system", "user", "assistant", "tool")


def _messages(inst: object, attr: attrs.Attribute, value: tuple | None) -> None:
    if value is None:
        return
    if not value:
        raise ValueError("messages must not be empty")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or set(m) - {"role", "content", "name"}:
            raise ValueError(f"messages[{i}] must be an object with role and content")
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string")


def _optional_tuple(value: Iterable[Any] | None) -> tuple[Any, ...] | None:
    return None if value is None else tuple(value)


def _tokens(inst: object, attr: attrs.Attribute, value: tuple | None) -> None:
    if value is None:
        return
    if not value:
        raise ValueError("prompt_tokens must not be empty")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise ValueError("prompt_tokens must be a list of non-negative integers")


@attrs.frozen(kw_only=True)
class GenerateRequest:
    """Prompt plus sampling parameters."""

    prompt: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(str)))
    prompt_tokens: tuple[int, ...] | None = attrs.field(
        default=None, converter=_optional_tuple, validator=_tokens)
    messages: tuple[dict[str, Any], ...] | None = attrs.field(
        default=None, converter=_optional_tuple, validator=_messages)
    params: SamplingParams = attrs.field(factory=SamplingParams)
    # OpenAI's shapes: {"type": "json_schema", "json_schema": {"schema": ...}} |
    # {"type": "json_object"} | {"type": "text"}; None = unconstrained.
    response_format: dict[str, Any] | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(dict)))

    def __attrs_post_init__(self) -> None:
        given = [n for n in ("prompt", "prompt_tokens", "messages") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of prompt, prompt_tokens or messages")
        if self.prompt == "":
            raise ValueError("prompt must not be empty")

    def token_ids(self, tokenizer: Any) -> tuple[int, ...]:
        """The prompt as token ids."""
        if self.prompt_tokens is not None:
            return self.prompt_tokens
        if self.prompt is not None:
            return tuple(tokenizer.encode(self.prompt))
        messages = [dict(m) for m in self.messages or ()]
        if getattr(tokenizer, "chat_template", None):
            return tuple(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return tuple(tokenizer.encode(text))
