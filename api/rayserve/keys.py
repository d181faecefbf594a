"""What the Ray front reads from a request to route it: the prompt's prefix keys, and the
replica a Responses follow-up must reach.

Keys: token prompts (`prompt_tokens`, a token-list `prompt`) and, with the model's
tokenizer loaded in the front (mlx-lm directories), text prompts, chat `messages` (+
Anthropic's `system`, with `tools` through the chat template) and Responses `input` are
tokenized as the engine does and cut into engine.kvevents' 16-token blocks, the hashes the
replicas' KV events carry. Without a tokenizer (a GGUF model) text prompts get `tqserve
route`'s text keys: affinity by what was routed before, not by KV events. The token count
of a tokenized prompt goes with its keys: the router costs a request by it, and the
front's own `done` for a request cancelled before a replica had it reports it.
"""

from __future__ import annotations

from typing import Any

import attrs

from tqserve.api.rayserve.relay import replica_of_response
from tqserve.api.router.core import prefix_keys, token_keys

BLOCK_CHARS = 64  # text keys' block, as `tqserve route`'s default


@attrs.frozen(kw_only=True)
class FrontConfig:
    block_tokens: int = 16  # engine.kvevents.BLOCK_TOKENS: the KV events' block
    max_body_bytes: int = 1 << 20
    max_message_bytes: int = 1 << 20
    max_streams_per_connection: int = 16
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    chat_template: str | None = None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def prompt_ids(path: str, fields: dict[str, Any], tokenizer: Any,
               template: str | None) -> tuple[int, ...] | None:
    """The prompt's token ids as the engine builds them (engine.request's token_ids on the
    request's prompt or turns); None where that cannot be told here, and a ValueError (the
    caller falls back to text keys) for turns or tools the engine would refuse."""
    prompt = fields.get("prompt_tokens", fields.get("prompt"))
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return tuple(prompt)
    if tokenizer is None:
        return None
    from tqserve.engine.request import GenerateRequest

    if isinstance(prompt, str):
        return GenerateRequest(prompt=prompt).token_ids(tokenizer, template)
    messages = fields.get("messages")
    if path.endswith("/responses"):
        given = fields.get("input")
        messages = ([{"role": "user", "content": given}] if isinstance(given, str) else
                    [m for m in given if isinstance(m, dict) and "role" in m]
                    if isinstance(given, list) else None)
        if isinstance(fields.get("instructions"), str) and messages is not None:
            messages = [{"role": "system", "content": fields["instructions"]}, *messages]
    if not isinstance(messages, list) or not messages:
        return None
    turns = [{"role": m.get("role"), "content": _text(m.get("content"))}
             for m in messages if isinstance(m, dict)]
    if isinstance(fields.get("system"), (str, list)):
        turns = [{"role": "system", "content": _text(fields["system"])}, *turns]
    tools = fields.get("tools")
    request = GenerateRequest(messages=turns,
                              tools=tools if isinstance(tools, list) and tools else None)
    return request.token_ids(tokenizer, template)  # the engine's own: template or fallback


@attrs.frozen(kw_only=True)
class PromptRoute:
    """What the front knows of a request's prompt: its prefix keys, and its token count as
    the engine will count it (None where the front cannot tokenize it)."""

    keys: tuple[Any, ...] = ()
    num_tokens: int | None = None


def route_prompt(path: str, fields: Any, tokenizer: Any, config: FrontConfig) -> PromptRoute:
    """The prefix keys and token count of a request body (none for what is not a
    generation request)."""
    if not isinstance(fields, dict):
        return PromptRoute()
    try:
        ids = prompt_ids(path, fields, tokenizer, config.chat_template)
    except Exception:  # turns, tools or a template the engine refuses: the replica says why
        ids = None
    if ids is not None:
        return PromptRoute(keys=token_keys(ids, config.block_tokens), num_tokens=len(ids))
    return PromptRoute(keys=prefix_keys(fields, block_tokens=config.block_tokens,
                                        block_chars=BLOCK_CHARS))


def response_pin(method: str, path: str, fields: Any) -> str | None:
    """The replica a Responses request must reach: the one storing the response it names
    (`previous_response_id`, or GET /v1/responses/<id>); None: any replica."""
    parts = path.rstrip("/").split("/")
    if method == "GET" and len(parts) >= 2 and parts[-2] == "responses":
        return replica_of_response(parts[-1])
    if method == "POST" and parts[-1] == "responses" and isinstance(fields, dict):
        return replica_of_response(fields.get("previous_response_id"))
    return None
