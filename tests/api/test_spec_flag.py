"""`--speculative-config JSON` (api.specflag): values -> Config fields, bad values -> one
exit-2 line, the old knob flags as deprecated aliases, a real generate run equal to the
old flags', and replay's spawned `serve` spelling a recorded config the new way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tqserve.engine.model import DEFAULT_MODEL as DRAFT_MODEL
from tqserve.api.cli import _config, build_parser, main
from tqserve.engine.config import Config

REPO = Path(__file__).resolve().parents[2]
FIELDS = ("speculative", "draft_model", "num_speculative_tokens", "speculative_max_batch",
          "speculative_time_policy", "speculative_ngram")
DEFAULTS = (None, None, 4, 0, True, 3)


def spec_config(*argv: str, command: str = "generate"):
    args = ["generate", "--prompt", "x"] if command == "generate" else ["serve"]
    config = _config(build_parser().parse_args([*args, *argv]))
    return tuple(getattr(config, f) for f in FIELDS)


@pytest.mark.parametrize("argv,fields", [
    ([], DEFAULTS),
    (["--speculative", "lookup"], ("lookup", None, 4, 0, True, 3)),
    (["--speculative-config", '{"method": "lookup", "ngram": 5}'],
     ("lookup", None, 4, 0, True, 5)),
    (["--speculative", "draft", "--speculative-config",
      '{"model": "d", "num_speculative_tokens": 2, "max_batch": 8, "time_policy": false}'],
     ("draft", "d", 2, 8, False, 3)),
    (["--speculative", "mtp", "--speculative-config", '{"method": "mtp"}'],
     ("mtp", None, 4, 0, True, 3)),
    (["--speculative-config", "{}"], DEFAULTS),
    (["--speculative-config", '{"model": "d"}'], (None, "d", 4, 0, True, 3)),
])
def test_good_values_set_the_config_fields(argv, fields):
    assert spec_config(*argv) == fields
    assert spec_config(*argv, command="serve") == fields


@pytest.mark.parametrize("value,message", [
    ("", "not JSON: Expecting value"),
    ("{method: lookup}", "not JSON"),
    ("[1]", "must be a JSON object, got list"),
    ('{"k": 4}', "unknown key 'k' (keys: method, model, num_speculative_tokens, max_batch, "
                 "time_policy, ngram)"),
    ('{"num_speculative_tokens": "4"}', 'num_speculative_tokens must be a JSON integer, '
                                        'got "4"'),
    ('{"num_speculative_tokens": true}', "num_speculative_tokens must be a JSON integer, "
                                         "got true"),
    ('{"time_policy": 0}', "time_policy must be a JSON true or false, got 0"),
    ('{"model": null}', "model must be a JSON string, got null"),
])
def test_bad_values_exit_2_with_one_line_naming_the_flag(value, message, capsys):
    for command in (["generate", "--prompt", "x"], ["serve"]):
        with pytest.raises(SystemExit) as exc:
            main([*command, "--speculative-config", value])
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"error: argument --speculative-config: {message}" in err[0], err


@pytest.mark.parametrize("argv,message", [
    (["--speculative-config", '{"num_speculative_tokens": 17}'],
     "--speculative-config num_speculative_tokens must be an integer in [1, 16], got 17"),
    (["--speculative-config", '{"ngram": 0}'],
     "--speculative-config ngram must be an integer in [1, 16], got 0"),
    (["--speculative-config", '{"max_batch": -1}'], "--speculative-config max_batch"),
    (["--speculative", "draft"], "--speculative draft needs a draft model: "
                                 "--speculative-config '{\"model\": PATH}'"),
    (["--speculative-config", '{"method": "fly"}'],
     "--speculative must be draft, mtp or lookup (or unset), got 'fly'"),
    (["--speculative", "mtp", "--speculative-config", '{"method": "lookup"}'],
     "--speculative mtp and --speculative-config method 'lookup' disagree"),
    (["--speculative-config", "{}", "--speculative-ngram", "4"],
     "--speculative-config and --speculative-ngram both set speculation: give "
     "--speculative-config alone"),
])
def test_range_and_conflict_errors_are_one_line_exit_2(argv, message, capsys):
    assert main(["generate", "--prompt", "x", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("old,fields", [
    (["--draft-model", "d"], {"model": "d"}),
    (["--num-speculative-tokens", "3", "--speculative-ngram", "5"],
     {"num_speculative_tokens": 3, "ngram": 5}),
    (["--speculative-max-batch", "8", "--no-speculative-time-policy"],
     {"max_batch": 8, "time_policy": False}),
])
def test_old_flags_still_work_with_one_deprecation_line(old, fields, capsys):
    got = spec_config("--speculative", "lookup", *old)
    assert got == spec_config("--speculative", "lookup", "--speculative-config",
                              json.dumps(fields))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tqserve: " + old[0]), err
    spelled = err[0].split("use --speculative-config ", 1)[1]
    assert json.loads(spelled.strip("'")) == fields  # the line's spelling means the same


def test_old_flags_are_hidden_from_help(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--speculative-config JSON" in out and "--speculative {draft,mtp,lookup}" in out
    for old in ("--draft-model", "--num-speculative-tokens", "--speculative-max-batch",
                "--no-speculative-time-policy", "--speculative-ngram"):
        assert old not in out


def test_replay_spawns_serve_with_the_new_spellings():
    from tqserve.tools.replay.cli import _serve_args

    config = Config(speculative="draft", draft_model="d", num_speculative_tokens=3,
                    speculative_time_policy=False, turboquant="k4v4", quantized_kv_start=8)
    argv = _serve_args(config)
    assert "--draft-model" not in argv and "--turboquant" not in argv
    assert _config(build_parser().parse_args(["serve", *argv])) == config


def generate(*flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "tqserve.api.cli", "generate", "--prompt",
                           "def fibonacci(n):", "--max-tokens", "16", "--dtype", "float32",
                           "--model", str(DRAFT_MODEL), "--speculative", "draft", *flags],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_generate_with_the_config_gives_the_old_flags_tokens():
    new = generate("--speculative-config",
                   json.dumps({"model": str(DRAFT_MODEL), "num_speculative_tokens": 3}))
    old = generate("--draft-model", str(DRAFT_MODEL), "--num-speculative-tokens", "3")
    assert new.returncode == old.returncode == 0, (new.stderr, old.stderr)
    assert new.stdout.startswith("def fibonacci(n):") and new.stdout == old.stdout
    assert "deprecated" not in new.stderr
    assert "--draft-model, --num-speculative-tokens are deprecated" in old.stderr
