"""The config split: Config holds the engine's settings only, ServerConfig the server's and
a Config; each refuses a bad value at construction, naming the setting as its CLI flag."""

from __future__ import annotations

import attrs
import pytest

import tqserve
from tqserve.api.config import ServerConfig
from tqserve.engine.config import Config

BAD_VALUES = {  # ServerConfig field -> (a bad value, the error's text: it names the flag)
    "port": (70000, "--port must be in [0, 65535], got 70000"),
    "max_message_bytes": (0, "--max-message-bytes must be a positive integer, got 0"),
    "max_streams_per_connection": (
        -1, "--max-streams-per-connection must be a positive integer, got -1"),
    "max_connections": (True, "--max-connections must be a positive integer, got True"),
    "acceptor": ("thread", "--acceptor must be process or off, got 'thread'"),
    "http_idle_timeout": (0, "http-idle-timeout must be a number of seconds > 0, got 0"),
    "http_header_timeout": (-1.0,
                            "http-header-timeout must be a number of seconds > 0, got -1.0"),
    "http_body_timeout": ("5", "http-body-timeout must be a number of seconds > 0, got '5'"),
    "ws_message_timeout": (1e7,
                           "ws-message-timeout must be a number of seconds > 0, got 10000000.0"),
    "shutdown_timeout": (-1, "--shutdown-timeout must be a number of seconds >= 0, got -1"),
    "api_key": (" ", "api-key must be a non-empty printable string (or unset)"),
    "served_model_name": (["a", " "],
                          "--served-model-name must be non-empty names, got ['a', ' ']"),
}
UNCHECKED = {"engine", "host", "allowed_origins", "strict_fields"}  # any value is a setting


@pytest.mark.parametrize("field", sorted(BAD_VALUES))
def test_server_config_refuses_a_bad_value_naming_the_flag(field: str) -> None:
    value, message = BAD_VALUES[field]
    with pytest.raises(ValueError) as exc:
        ServerConfig(**{field: value})
    assert str(exc.value) == message


def test_every_server_setting_is_checked_or_free() -> None:
    assert {f.name for f in attrs.fields(ServerConfig)} == set(BAD_VALUES) | UNCHECKED


def test_the_defaults_and_the_converted_fields() -> None:
    config = ServerConfig()
    assert config.engine == Config() and (config.host, config.port) == ("127.0.0.1", 8000)
    assert config.acceptor == "process" and config.api_key is None
    named = ServerConfig(served_model_name="a, b", allowed_origins="https://x.example/, ",
                         api_key="secret-key")
    assert named.served_model_name == ("a", "b")
    assert named.allowed_origins == ("https://x.example",)
    assert "secret-key" not in repr(named)  # the key never reaches a log through repr
    assert ServerConfig(port=0).port == 0  # any free port
    assert ServerConfig(shutdown_timeout=0).shutdown_timeout == 0  # end in-flight at once


@pytest.mark.parametrize("field", sorted(BAD_VALUES) + ["host", "strict_fields"])
def test_config_refuses_a_server_field(field: str) -> None:
    """The split is real: Config has no server setting (Config(port=1) is a TypeError)."""
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{field}'"):
        Config(**{field: getattr(ServerConfig(), field)})


def test_engine_must_be_a_config() -> None:
    with pytest.raises(TypeError, match="engine must be the engine's Config, got dict"):
        ServerConfig(engine={"max_batch": 4})
    assert ServerConfig(engine=Config(max_batch=4)).engine.max_batch == 4


async def test_serve_refuses_an_engine_config() -> None:
    """`serve` takes the server's config; an engine Config is a TypeError before any work."""
    with pytest.raises(TypeError, match="serve takes a ServerConfig"):
        await tqserve.serve(Config())


def test_the_front_door_has_both() -> None:
    assert tqserve.ServerConfig is ServerConfig and tqserve.Config is Config
