"""The server's configuration record: the engine's Config and what only a server has (its
address, connections, time limits, auth, the names the HTTP APIs answer to).

`tqserve serve` (and `ray-serve`) map their flags 1:1 onto the two records (api.cli);
`tqserve generate` needs only the engine's. Validated at construction; an error names
the setting as its CLI flag, as engine.config's do.
"""

from __future__ import annotations

from typing import Iterable

import attrs

from tqserve.engine.config import Config, flag_name, positive, positive_seconds


def _engine(inst: object, attr: attrs.Attribute, value: object) -> None:
    if not isinstance(value, Config):
        raise TypeError(f"engine must be the engine's Config, got {type(value).__name__}")


def _port(inst: object, attr: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {value!r}")


def _acceptor(inst: object, attr: attrs.Attribute, value: str) -> None:
    if value not in ("process", "off"):
        raise ValueError(f"--acceptor must be process or off, got {value!r}")


def _seconds(inst: object, attr: attrs.Attribute, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{flag_name(attr)} must be a number of seconds >= 0, "
                         f"got {value!r}")


def _api_key(inst: object, attr: attrs.Attribute, value: str | None) -> None:
    if value is not None and (not isinstance(value, str) or not value.strip()
                              or not value.isprintable()):
        raise ValueError("api-key must be a non-empty printable string (or unset)")


def _origins(value: str | Iterable[object]) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [o for o in value.split(",") if o.strip()]
    return tuple(str(o).strip().rstrip("/") for o in value)


def _names(value: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """--served-model-name: names, comma-separated or a sequence; empty: the directory's."""
    if value == "":
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    names = tuple(n.strip() for n in items if isinstance(n, str) and n.strip())
    if len(names) != len(items):
        raise ValueError(f"--served-model-name must be non-empty names, got {value!r}")
    return names


@attrs.frozen(kw_only=True)
class ServerConfig:
    """`serve`'s settings: the engine's Config and the server's own (defaults: loopback)."""

    engine: Config = attrs.field(factory=Config, validator=_engine)
    host: str = "127.0.0.1"
    port: int = attrs.field(default=8000, validator=_port)
    max_message_bytes: int = attrs.field(default=1 << 20, validator=positive)
    max_streams_per_connection: int = attrs.field(default=16, validator=positive)
    # open connections (HTTP and WebSocket) the server holds at once; a request on one
    # beyond it is an HTTP 503 (the descriptor limit is raised to fit it)
    max_connections: int = attrs.field(default=1024, validator=positive)
    # who accepts connections (api.acceptor): "process", a small process that answers
    # overload's 429s off the event loop and hands every other connection over; "off":
    # the server's own loop (with the in-loop gate, api.overload)
    acceptor: str = attrs.field(default="process", validator=_acceptor)
    # HTTP connections (api.httpconn, docs/limits.md): seconds a connection may sit idle
    # between requests, a request's head and its body may take to arrive (then 408/close)
    http_idle_timeout: float = attrs.field(default=5.0, validator=positive_seconds)
    http_header_timeout: float = attrs.field(default=10.0, validator=positive_seconds)
    http_body_timeout: float = attrs.field(default=30.0, validator=positive_seconds)
    # seconds a WebSocket message may take from its first byte to its last (then close 1008)
    ws_message_timeout: float = attrs.field(default=30.0, validator=positive_seconds)
    # Seconds in-flight requests get to finish after SIGTERM/SIGINT before they are ended
    # with finish_reason "shutdown".
    shutdown_timeout: float = attrs.field(default=10.0, validator=_seconds)
    # HTTP and WebSocket exposure (api.auth): a bearer key, browser origins for WebSockets.
    api_key: str | None = attrs.field(default=None, validator=_api_key, repr=False)
    allowed_origins: tuple[str, ...] = attrs.field(default=(), converter=_origins)
    # The HTTP APIs (docs/agents.md): the names requests may give as `model` (the first
    # one answers; empty: the directory's name); strict_fields refuses unknown request
    # fields instead of ignoring them.
    served_model_name: tuple[str, ...] = attrs.field(default=(), converter=_names)
    strict_fields: bool = False
