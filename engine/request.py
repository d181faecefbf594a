"""A generation request as the embedded API and the WebSocket take it.

Exactly one of `prompt` (text), `prompt_tokens` (ids) or `messages` (chat) is
given. Chat messages use the tokenizer's chat template when it has one; a
tokenizer without one (the bundled pycoder models) gets "role: content" lines
followed by "assistant: ", which is written down here so that clients know.

`response_format` (optional) constrains the output: OpenAI's `json_schema` and
`json_object` shapes, or our `regex` and `grammar` (Lark) forms; see
`engine.structured.formats`. Its shape and size are checked at construction (a
`ResponseFormatError`, a ValueError, naming the field path), giving `request.constraint`
(a FormatSource); the engine compiles it with llguidance off the event loop, on a
large-stack worker thread, when the request is submitted.
"""

from __future__ import annotations

from typing import Any, Iterable

import attrs

from tqserve.engine.sampling import MAX_TOKEN_ID, SamplingParams
from tqserve.engine.speculative.policy import SpecChoice, parse_speculative
from tqserve.engine.structured import FormatSource, check_response_format

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
    if not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in value):
        raise ValueError(f"prompt_tokens must be a list of token ids in [0, {MAX_TOKEN_ID}]")


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
    response_format: dict[str, Any] | None = None
    # speculation: {"method", "num_tokens"}, false, or null (the server's default)
    speculative: SpecChoice | bool | None = attrs.field(default=None,
                                                        converter=parse_speculative)
    constraint: FormatSource | None = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        given = [n for n in ("prompt", "prompt_tokens", "messages") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of prompt, prompt_tokens or messages")
        if self.prompt == "":
            raise ValueError("prompt must not be empty")
        object.__setattr__(self, "constraint", check_response_format(self.response_format))

    @property
    def num_chars(self) -> int:
        """Characters of prompt text (the prompt, or every message's content)."""
        if self.prompt is not None:
            return len(self.prompt)
        return sum(len(m["content"]) for m in self.messages or ())

    def check_limits(self, *, max_prompt_chars: int, max_messages: int,
                     max_prompt_tokens: int) -> None:
        """Refuse, naming the field and the limit, what is too large to tokenize or hold."""
        if self.messages is not None and len(self.messages) > max_messages:
            raise ValueError(f"messages holds {len(self.messages)} entries, more than the "
                             f"limit of {max_messages} (--max-messages)")
        if self.num_chars > max_prompt_chars:
            field = "prompt" if self.prompt is not None else "messages content"
            raise ValueError(f"{field} holds {self.num_chars} characters, more than the "
                             f"limit of {max_prompt_chars} (--max-prompt-chars)")
        if self.prompt_tokens is not None and len(self.prompt_tokens) > max_prompt_tokens:
            raise ValueError(f"prompt_tokens holds {len(self.prompt_tokens)} ids, more than "
                             f"the model's context of {max_prompt_tokens} tokens")

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
