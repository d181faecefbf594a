"""serve's exposure flags map onto Config: --api-key (or TQSERVE_API_KEY), --allowed-origins."""

from __future__ import annotations

import pytest

from api.cli import _config, build_parser, main


def serve_config(argv: list[str]):
    return _config(build_parser().parse_args(["serve", *argv]))


def test_api_key_and_origins_flags(monkeypatch):
    monkeypatch.delenv("TQSERVE_API_KEY", raising=False)
    plain = serve_config([])
    assert plain.api_key is None and plain.allowed_origins == ()
    assert plain.host == "127.0.0.1"  # the default bind stays loopback
    config = serve_config(["--api-key", "k1", "--allowed-origins",
                           "https://a.example, http://b.example:8080/"])
    assert config.api_key == "k1"
    assert config.allowed_origins == ("https://a.example", "http://b.example:8080")
    assert "k1" not in repr(config)  # the key never reaches a log through repr
    monkeypatch.setenv("TQSERVE_API_KEY", "from-env")
    assert serve_config([]).api_key == "from-env"
    assert serve_config(["--api-key", "flag-wins"]).api_key == "flag-wins"


@pytest.mark.parametrize("key", [" ", "bad\nkey"])
def test_a_blank_or_unprintable_key_is_a_one_line_error(key, capsys, monkeypatch):
    monkeypatch.delenv("TQSERVE_API_KEY", raising=False)
    assert main(["serve", "--api-key", key]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "api-key" in err[0]
