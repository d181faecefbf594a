"""The playground page at `/`: a prompt box that streams over the WebSocket, and a chat
mode (the chat template applied server-side, a system prompt, tools and their calls).

Serves four package-data files from api/static (HTML, CSS, JS; no CDN, no network
beyond this server) and the loaded model's vocabulary as text, which the page needs
because `top_logprobs` in token frames carry token ids only. The page itself talks to:

    GET /                        playground.html
    GET /static/<name>           playground.css, playground.js, playground_chat.js (a
                                 fixed list; no paths)
    GET /playground/vocab.json   {"model": str, "tokens": [text of id 0, id 1, ...]}
    WS  /v1/stream               generate / cancel, as any client
    POST /v1/chat/completions    chat mode: streamed, with logprobs, tools and usage
    GET /health                  the model's name for the header

Every page response carries a Content-Security-Policy that allows scripts, styles and
connections from this origin only, so model text the page shows can never run as code.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import trio
from quart import Response, abort, jsonify
from quart_trio import QuartTrio

from tqserve.actors.facade import Engine

STATIC_TYPES = {
    "playground.html": "text/html; charset=utf-8",
    "playground.css": "text/css; charset=utf-8",
    "playground.js": "text/javascript; charset=utf-8",
    "playground_chat.js": "text/javascript; charset=utf-8",
}
PAGE_HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; "
                                "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                                "form-action 'none'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def read_static(name: str) -> bytes:
    """The bytes of one of the page's files (shipped as package data next to this module)."""
    if name not in STATIC_TYPES:
        raise ValueError(f"unknown static file {name!r}")
    return resources.files(__package__).joinpath("static", name).read_bytes()


def vocab_texts(tokenizer: Any, vocab_size: int) -> list[str]:
    """The text of each token id on its own (ids the tokenizer lacks decode to "").

    A byte-level token that is only part of a UTF-8 character decodes to U+FFFD here;
    in a stream the engine joins such bytes into whole characters."""
    size = min(vocab_size, len(tokenizer.vocab))
    return [tokenizer.decode([i]) for i in range(size)] + [""] * (vocab_size - size)


def add_playground(app: QuartTrio, engine: Engine) -> None:
    """Register the page, its static files and the vocabulary route on `app`."""
    files = {name: read_static(name) for name in STATIC_TYPES}
    vocab: list[dict[str, Any]] = []  # built once, on first request, off the event loop
    vocab_lock = trio.Lock()

    def page_file(name: str) -> Response:
        return Response(files[name], content_type=STATIC_TYPES[name], headers=PAGE_HEADERS)

    @app.get("/")
    async def playground() -> Response:
        return page_file("playground.html")

    @app.get("/static/<name>")
    async def static_file(name: str) -> Response:
        if name not in files or name == "playground.html":
            abort(404)
        return page_file(name)

    @app.get("/playground/vocab.json")
    async def playground_vocab() -> Any:
        async with vocab_lock:
            if not vocab:
                loaded = engine.model
                texts = await trio.to_thread.run_sync(vocab_texts, loaded.tokenizer,
                                                      loaded.vocab_size)
                vocab.append({"model": loaded.path.name, "tokens": texts})
        return jsonify(vocab[0])
