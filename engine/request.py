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
# what a message may carry besides role and content: the template renders them
MESSAGE_KEYS = frozenset(("role", "content", "name", "tool_calls", "tool_call_id",
                          "reasoning_content"))


def _messages(inst: object, attr: attrs.Attribute, value: tuple | None) -> None:
    if value is None:
        return
    if not value:
        raise ValueError("messages must not be empty")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or set(m) - MESSAGE_KEYS:
            raise ValueError(f"messages[{i}] must be an object with role and content")
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}")
        calls = m.get("tool_calls")
        if calls is not None and not (m["role"] == "assistant" and isinstance(calls, list)):
            raise ValueError(f"messages[{i}].tool_calls must be a list on an assistant message")
        if not isinstance(m.get("content"), str) and not (calls and m.get("content") is None):
            raise ValueError(f"messages[{i}].content must be a string")


def _tools(inst: object, attr: attrs.Attribute, value: tuple | None) -> None:
    if value is None:
        return
    for i, tool in enumerate(value):
        if not (isinstance(tool, dict) and isinstance(tool.get("function"), dict)
                and isinstance(tool["function"].get("name"), str)):
            raise ValueError(f"tools[{i}] must be an object with function.name")


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
    # OpenAI-shaped function tools the chat template renders (messages only)
    tools: tuple[dict[str, Any], ...] | None = attrs.field(
        default=None, converter=_optional_tuple, validator=_tools)
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
        if self.tools is not None and self.messages is None:
            raise ValueError("tools need messages (a chat prompt)")
        object.__setattr__(self, "constraint", check_response_format(self.response_format))

    @property
    def num_chars(self) -> int:
        """Characters of prompt text (the prompt, or every message's content)."""
        if self.prompt is not None:
            return len(self.prompt)
        return sum(len(m["content"] or "") for m in self.messages or ())

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

    def token_ids(self, tokenizer: Any, chat_template: str | None = None) -> tuple[int, ...]:
        """The prompt as token ids; `chat_template` (--chat-template) overrides the
        tokenizer's own template."""
        if self.prompt_tokens is not None:
            return self.prompt_tokens
        if self.prompt is not None:
            return tuple(tokenizer.encode(self.prompt))
        messages = [dict(m) for m in self.messages or ()]
        if chat_template or getattr(tokenizer, "chat_template", None):
            extra: dict[str, Any] = {"chat_template": chat_template} if chat_template else {}
            if self.tools:
                extra["tools"] = [dict(t) for t in self.tools]
            return tuple(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                       **extra))
        text = "".join(f"{m['role']}: {m['content'] or ''}\n" for m in messages)
        return tuple(tokenizer.encode(text + "assistant: "))
