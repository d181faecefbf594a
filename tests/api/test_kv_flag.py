"""`--kv FORMAT` (api.kvflag): values -> Config fields, bad values -> one exit-2 line, the old
flags as deprecated aliases, and a real generate run equal to the old flag's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tqserve.api import kvflag
from tqserve.api.cli import _config, build_parser, main

REPO = Path(__file__).resolve().parents[2]
FIELDS = ("turboquant", "quantized_kv_start", "kv_quant", "kv_group_size")


def kv_config(*argv: str):
    config = _config(build_parser().parse_args(["generate", "--prompt", "x", *argv]))
    return tuple(getattr(config, f) for f in FIELDS)


@pytest.mark.parametrize("value,fields", [
    ("plain", (None, 0, None, 64)),
    ("turboquant:k4v3", ("k4v3", 0, None, 64)),
    ("turboquant:k8v8", ("k8v8", 0, None, 64)),
    ("TurboQuant:K4V4,start=256", ("k4v4", 256, None, 64)),
    ("turboquant:k1v1,start=0", ("k1v1", 0, None, 64)),
    ("affine:8", (None, 0, 8, 64)),
    ("affine:4,group=32", (None, 0, 4, 32)),
    ("affine:8,group=128", (None, 0, 8, 128)),
])
def test_good_values_set_the_config_fields(value, fields):
    assert kv_config("--kv", value) == fields


@pytest.mark.parametrize("value,decode", [
    ("plain", "auto"), ("turboquant:k4v4", "auto"), ("turboquant:k4v4,decode=compiled",
                                                     "compiled"),
    ("turboquant:k4v4,decode=unfused,start=8", "unfused"),
])
def test_decode_path_is_a_kv_option_not_an_environment_variable(value, decode):
    """The TurboQuant decode path (once TQSERVE_TURBOQUANT_FUSED_DECODE and
    TQSERVE_TURBOQUANT_CUDA_KERNEL) is Config.turboquant_decode, set by --kv."""
    config = _config(build_parser().parse_args(["serve", "--kv", value]))
    assert config.turboquant_decode == decode
    assert kvflag.parse_kv(kvflag.spelling(kvflag.parse_kv(value))) == kvflag.parse_kv(value)


def test_no_kv_flag_is_plain_and_serve_takes_it_too():
    assert kv_config() == (None, 0, None, 64)
    config = _config(build_parser().parse_args(["serve", "--kv", "turboquant:k4v4,start=8"]))
    assert (config.turboquant, config.quantized_kv_start) == ("k4v4", 8)


@pytest.mark.parametrize("value,message", [
    ("", "'' is not plain, turboquant:kXvY[,start=N][,decode=PATH] or affine:BITS[,group=G]"),
    ("zstd", "'zstd' is not plain, turboquant:kXvY[,start=N][,decode=PATH] or affine:BITS"),
    ("plain:8", "plain takes no bits or options, got 'plain:8'"),
    ("plain,start=4", "plain takes no bits or options"),
    ("turboquant", "turboquant needs its bits: turboquant:k4v4"),
    ("turboquant:", "turboquant needs its bits"),
    ("turboquant:k9v3", "turboquant spec 'k9v3' is not k<bits>v<bits> with bits in 1..8"),
    ("turboquant:k4", "turboquant spec 'k4' is not k<bits>v<bits>"),
    ("turboquant:k4v3,start=-1", "option 'start=-1' is not start=N with N an integer >= 0"),
    ("turboquant:k4v3,start=", "option 'start=' is not start=N"),
    ("turboquant:k4v3,start=4,start=5", "option start is given twice"),
    ("turboquant:k4v3,group=32", "unknown option 'group=32' (options here: start=N, "
     "decode=auto|compiled|unfused)"),
    ("turboquant:k4v3,decode=fast", "option 'decode=fast': decode is one of auto, compiled, "
     "unfused"),
    ("turboquant:k4v3,decode", "option 'decode': decode is one of auto"),
    ("turboquant:k4v3,decode=unfused,decode=auto", "option decode is given twice"),
    ("affine:8,decode=compiled", "unknown option 'decode=compiled' (options here: group=N)"),
    ("turboquant:k4v3,", "unknown option ''"),
    ("affine", "affine needs its bits: affine:8"),
    ("affine:3", "affine bits must be one of 4, 8, got '3'"),
    ("affine:eight", "affine bits must be one of 4, 8, got 'eight'"),
    ("affine:8,group=48", "affine group must be one of 32, 64, 128, got 48"),
    ("affine:4,start=8", "unknown option 'start=8' (options here: group=N)"),
])
def test_bad_values_exit_2_with_one_line_naming_the_flag(value, message, capsys):
    for command in (["generate", "--prompt", "x"], ["serve"]):
        with pytest.raises(SystemExit) as exc:
            main([*command, "--kv", value])
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"error: argument --kv: {message}" in err[0], err


@pytest.mark.parametrize("old,spelling,fields", [
    (["--turboquant", "k4v3"], "turboquant:k4v3", ("k4v3", 0, None, 64)),
    (["--turboquant", "k4v4", "--quantized-kv-start", "16"], "turboquant:k4v4,start=16",
     ("k4v4", 16, None, 64)),
    (["--kv-quant", "8"], "affine:8", (None, 0, 8, 64)),
    (["--kv-quant", "4", "--kv-group-size", "32"], "affine:4,group=32", (None, 0, 4, 32)),
])
def test_old_flags_still_work_with_one_deprecation_line(old, spelling, fields, capsys):
    assert kv_config(*old) == fields
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(f"deprecated: use --kv {spelling}"), err
    assert err[0].startswith("tqserve: --" + old[0][2:])


def test_old_flags_are_hidden_from_help_and_kv_is_listed(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--kv FORMAT" in out and "(default: plain)" in " ".join(out.split())
    for old in ("--turboquant", "--quantized-kv-start", "--kv-quant", "--kv-group-size"):
        assert old not in out


def test_kv_and_an_old_flag_together_is_a_one_line_error(capsys):
    assert main(["generate", "--prompt", "x", "--kv", "plain", "--turboquant", "k4v4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["tqserve: error: --kv and --turboquant both set the KV cache: "
                   "give --kv alone"]


def generate(*flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "tqserve.api.cli", "generate", "--prompt",
                           "def fibonacci(n):", "--max-tokens", "24", "--dtype", "float32",
                           *flags], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def test_generate_with_kv_turboquant_gives_the_old_flags_tokens():
    new, old = generate("--kv", "turboquant:k4v3"), generate("--turboquant", "k4v3")
    assert new.returncode == old.returncode == 0, (new.stderr, old.stderr)
    assert new.stdout.startswith("def fibonacci(n):") and len(new.stdout) > 30
    assert new.stdout == old.stdout
    # and it is TurboQuant: on this prompt k4v3's greedy text differs from the plain cache's
    assert new.stdout != generate("--kv", "plain").stdout
    assert "deprecated" not in new.stderr
    assert "tqserve: --turboquant is deprecated: use --kv turboquant:k4v3" in old.stderr
