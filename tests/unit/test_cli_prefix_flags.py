"""--ssd-write and --ssd-flush map 1:1 onto Config; write-through and async by default."""

import pytest

from tqserve.api.cli import _config, build_parser
from tqserve.engine.config import Config


def test_defaults_are_write_through_async():
    config = _config(build_parser().parse_args(["serve", "--cache-dir", "d"]))
    assert (config.ssd_write, config.ssd_flush, config.cache_dir) == ("through", "async", "d")
    assert Config().ssd_write == "through" and Config().ssd_flush == "async"


def test_write_back_and_sync_flags():
    args = build_parser().parse_args(["serve", "--ssd-write", "back", "--ssd-flush", "sync"])
    config = _config(args)
    assert (config.ssd_write, config.ssd_flush) == ("back", "sync")


def test_bad_values_name_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--ssd-write", "around"])
    assert exit_info.value.code == 2
    assert "--ssd-write" in capsys.readouterr().err
    with pytest.raises(ValueError, match="ssd-write must be through or back"):
        Config(ssd_write="around")
