"""OpenAI answers with one or more choices: `n` sampled rows per prompt, lists of prompts.

`respond` takes one GenerateRequest per choice (prompt i's j-th sample is choice i * n + j,
as OpenAI orders them), admits them all before any byte is sent (a refusal closes those
already admitted), and runs them together in the engine's batch (the prompt's KV is
shared through the prefix cache once its first row has published it). Not streamed, the
answer lists every choice; streamed, the choices' chunks interleave as their tokens come,
each naming its `index`, and each ends with its own finish_reason. Chat choices go
through api.chatout (reasoning and tool calls); completions may `echo` the prompt.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Callable

import trio
from quart import Response, jsonify

from tqserve.actors.messages import PromptLogprobs, Token
from tqserve.api.chatout import ChatOutput, Delta
from tqserve.api.ending import complete
from tqserve.api.httpcommon import SSE_HEADERS, ApiError, Run, sse, start_run


def tool_call_json(call: Any, index: int | None = None) -> dict[str, Any]:
    """A parsed call in OpenAI's shape (with its index in a streamed delta)."""
    out = {"id": call.id, "type": "function",
           "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


def _chat_delta(delta: Delta, index: int) -> dict[str, Any]:
    if delta.kind == "call":
        return {"tool_calls": [tool_call_json(delta.call, index)]}
    if delta.kind == "reasoning":
        return {"reasoning_content": delta.text, "reasoning": delta.text}
    return {"content": delta.text}


def chat_message(out: ChatOutput) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant",
                               "content": out.content if out.content or not out.calls else None}
    if out.reasoning:
        message["reasoning_content"] = message["reasoning"] = out.reasoning
    if out.calls:
        message["tool_calls"] = [tool_call_json(c) for c in out.calls]
    return message


def usage(runs: list[Run], firsts: list[int], score_only: bool = False) -> dict[str, Any]:
    """Prompt tokens once per prompt (the choices at `firsts`), completions of all (none
    when the request only scored its prompt)."""
    dones = [runs[i].outcome.done for i in firsts]
    prompt = sum(d.prompt_tokens for d in dones if d is not None)
    cached = sum(d.cached_tokens for d in dones if d is not None)
    completion = 0 if score_only else sum(len(r.outcome.token_ids) for r in runs)
    extra = dones[0].speculative_usage() if len(runs) == 1 and dones[0] is not None else {}
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}, **extra}


class Logprobs:
    """Token logprobs in the completions shape or the chat shape."""

    def __init__(self, chat: bool, text_of: Callable[[int], str]) -> None:
        self.chat = chat
        self.text_of = text_of
        self.offset = 0

    def entry(self, tok: Token) -> dict[str, Any]:
        text = self.text_of(tok.token_id)
        top = tok.top_logprobs or ()
        self.offset += len(tok.text)
        if self.chat:
            return {"token": text, "logprob": tok.logprob, "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [{"token": self.text_of(t), "logprob": lp,
                                      "bytes": list(self.text_of(t).encode("utf-8"))}
                                     for t, lp in top]}
        return {"token": text, "logprob": tok.logprob, "offset": self.offset - len(tok.text),
                "top": {self.text_of(t): lp for t, lp in top}}

    def prompt(self, prompt: PromptLogprobs | None) -> list[dict[str, Any]]:
        """The echoed prompt's entries (completions shape; the first has no logprob)."""
        entries, offset = [], 0
        if prompt is None:
            return []
        for token, lp, top in zip(prompt.token_ids, prompt.logprobs, prompt.top_logprobs):
            text = self.text_of(token)
            entries.append({"token": text, "logprob": lp, "offset": offset, "top": None
                            if top is None else {self.text_of(t): v for t, v in top}})
            offset += len(text)
        return entries

    def block(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        if self.chat:
            return {"content": entries}
        return {"tokens": [e["token"] for e in entries],
                "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [e["top"] for e in entries],
                "text_offset": [e["offset"] for e in entries]}


class Choice:
    """One choice's run and what its answer is built from."""

    def __init__(self, index: int, run: Run, chat: bool, text_of: Callable[[int], str],
                 make_output: Callable[[], ChatOutput], echo: str = "",
                 echo_logprobs: bool = False, score_only: bool = False) -> None:
        self.index = index
        self.run = run
        self.chat = chat
        self.lp = Logprobs(chat, text_of)
        self.lp.offset = len(echo)
        self.out = make_output()
        self.echo = echo
        # echo with logprobs: the prompt's logprobs come before its first token (streamed,
        # the echo chunk waits for them)
        self.echo_logprobs = echo_logprobs
        # echo with max_tokens 0: the prompt is scored, the one token generated is not shown
        self.score_only = score_only
        self.num_calls = 0  # tool calls streamed so far: the next one's index

    def finish_reason(self) -> str:
        done = complete(self.run.outcome)  # a cut output raises ApiError
        if self.score_only:
            return "length"
        if self.out.calls and done.finish_reason == "stop":
            return "tool_calls"
        return done.finish_reason

    def whole(self, entries: list[dict[str, Any]] | None) -> dict[str, Any]:
        """The non-streamed choice (the run has ended)."""
        if entries is not None and self.score_only:
            entries = []
        if entries is not None and self.echo_logprobs:
            entries = self.lp.prompt(self.run.outcome.prompt_logprobs) + entries
        choice: dict[str, Any] = {"index": self.index,
                                  "logprobs": self.lp.block(entries) if entries is not None
                                  else None}
        if self.chat:
            self.out.feed(self.run.outcome.text)
            self.out.finish()
            choice["message"] = chat_message(self.out)
        else:
            choice["text"] = self.echo + ("" if self.score_only else self.run.outcome.text)
        choice["finish_reason"] = self.finish_reason()
        return choice

    def deltas(self, deltas: list[Delta], logprobs: Any) -> list[tuple[Any, Any]]:
        """(delta, logprobs) pairs of the chat chunks for new deltas."""
        out = []
        for d in deltas:
            out.append((_chat_delta(d, self.num_calls), logprobs))
            self.num_calls += d.kind == "call"
            logprobs = None
        if logprobs is not None:
            out.append(({"content": ""}, logprobs))
        return out


async def admit(events: list[AsyncIterator[Any]]) -> list[Run]:
    """Every choice's run past admission; on a refusal, those admitted are closed."""
    runs: list[Run] = []
    try:
        for stream in events:
            runs.append(await start_run(stream))
    except BaseException:
        for run in runs:
            await run.aclose()
        raise
    return runs


@trio.as_safe_channel
async def _merged(choices: list[Choice]) -> AsyncIterator[tuple[Choice, Token | None]]:
    """(choice, token) as the choices' tokens come; (choice, None) when one has ended."""
    send, recv = trio.open_memory_channel[tuple[Choice, Token | None]](0)

    async def pump(choice: Choice, send: trio.MemorySendChannel) -> None:
        async with send:
            async for tok in choice.run.tokens():
                await send.send((choice, tok))
            await send.send((choice, None))

    async with trio.open_nursery() as nursery, recv:
        async with send:
            for choice in choices:
                nursery.start_soon(pump, choice, send.clone())
        async for item in recv:
            yield item


async def whole(choices: list[Choice], base: dict[str, Any], want_logprobs: bool,
                firsts: list[int]) -> Response:
    entries: dict[int, list[dict[str, Any]]] = {c.index: [] for c in choices}
    try:
        async with _merged(choices) as items:
            async for choice, tok in items:
                if tok is not None and want_logprobs:
                    entries[choice.index].append(choice.lp.entry(tok))
    finally:
        with trio.CancelScope(shield=True):
            for c in choices:
                await c.run.aclose()
    body = [c.whole(entries[c.index] if want_logprobs else None) for c in choices]
    return jsonify({**base, "choices": body, "usage": usage([c.run for c in choices], firsts,
                                                            choices[0].score_only)})


def _client_went_away(group: BaseExceptionGroup) -> bool:
    """aclose() at a yield inside `_merged` (the response was dropped: the client went
    away): trio's safe channel hands the GeneratorExit back in a group with its pump's
    cancellation. The stream then just ends, as aclose() expects (a yield after it would
    be a RuntimeError); anything else in the group is a real failure."""
    rest = group.split((GeneratorExit, trio.Cancelled))[1]
    return rest is None and group.subgroup(GeneratorExit) is not None


def streamed(choices: list[Choice], base: dict[str, Any], want_logprobs: bool,
             include_usage: bool, firsts: list[int], error_body: Callable[..., Any]) -> Response:
    chat = choices[0].chat
    chunk_base = {**base, "object": "chat.completion.chunk" if chat else "text_completion"}

    def chunk(index: int, delta: Any, logprobs: Any = None, finish: str | None = None) -> bytes:
        choice = {"index": index, ("delta" if chat else "text"): delta, "logprobs": logprobs,
                  "finish_reason": finish}
        out = {**chunk_base, "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return sse(out)

    def ended(choice: Choice) -> list[bytes]:  # a chat's held-back text, then its finish
        tail = [chunk(choice.index, d, lp) for d, lp in
                choice.deltas(choice.out.finish(), None)] if chat else []
        return tail + [chunk(choice.index, {} if chat else "", None, choice.finish_reason())]

    async def events() -> AsyncIterator[bytes]:
        try:
            for c in choices:
                if chat:
                    yield chunk(c.index, {"role": "assistant", "content": ""})
                elif c.echo and not c.echo_logprobs:
                    yield chunk(c.index, c.echo)
            async with _merged(choices) as items:
                async for choice, tok in items:
                    if choice.echo_logprobs:  # its prompt's logprobs came before this
                        choice.echo_logprobs = False
                        prompt = choice.lp.prompt(choice.run.outcome.prompt_logprobs)
                        yield chunk(choice.index, choice.echo, choice.lp.block(prompt))
                    if tok is None:
                        for piece in ended(choice):
                            yield piece
                        continue
                    if choice.score_only or (not tok.text and not want_logprobs):
                        continue
                    lp = choice.lp.block([choice.lp.entry(tok)]) if want_logprobs else None
                    if chat:
                        for delta, logprobs in choice.deltas(choice.out.feed(tok.text), lp):
                            yield chunk(choice.index, delta, logprobs)
                    else:
                        yield chunk(choice.index, tok.text, lp)
            if include_usage:
                yield sse({**chunk_base, "choices": [], "usage": usage(
                    [c.run for c in choices], firsts, choices[0].score_only)})
            yield sse("[DONE]")
        except ApiError as cut:  # a cut output: no finish_reason, the client raises
            yield sse(error_body(cut.status, cut.message, cut.param, cut.code))
        except BaseExceptionGroup as group:
            if not _client_went_away(group):
                raise
        finally:
            with trio.CancelScope(shield=True):
                for c in choices:
                    await c.run.aclose()

    response = Response(events(), headers=SSE_HEADERS)
    response.timeout = None  # a long generation is not a stuck response
    return response


def base_of(rid: str, chat: bool, model: str) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model}
