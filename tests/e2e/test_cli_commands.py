"""The subcommands: `tqserve bench NAME`, the hidden bench-NAME aliases, the removed tools."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tqserve.api.cli import main
from tqserve.api.commands import BENCHES

REPO = Path(__file__).resolve().parents[2]
COMMANDS = ["serve", "generate", "route", "ray-serve", "replay", "bench", "eval-kv"]


def cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "tqserve.api.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_help_lists_the_seven_commands_and_no_alias():
    result = cli("--help")
    assert result.returncode == 0, result.stderr
    listed = re.findall(r"^    (\S+)", result.stdout, re.M)
    assert listed == COMMANDS
    assert "{" + ",".join(COMMANDS) + "}" in result.stdout
    for hidden in ("bench-kv", "bench-tp", "attack", "route-sim"):
        assert hidden not in result.stdout


def test_bench_help_names_every_benchmark_then_the_default_ones_flags():
    result = cli("bench", "--help")
    assert result.returncode == 0, result.stderr
    names = re.findall(r"^  (\S+)  ", result.stdout.split("NAME:\n")[1].split("\n\n")[0], re.M)
    assert names == list(BENCHES) == ["mlx-lm", "kv", "prefix", "gpu", "spec", "tp", "ray",
                                   "preempt"]
    assert "usage: tqserve bench [-h] [--model MODEL]" in result.stdout  # tools/bench's


@pytest.mark.parametrize("name", ["kv", "prefix", "gpu", "spec", "tp"])
def test_an_old_bench_command_warns_once_and_runs_the_new_form(name):
    new, old = cli("bench", name, "--help"), cli(f"bench-{name}", "--help")
    assert new.returncode == old.returncode == 0, old.stderr
    assert old.stdout == new.stdout and f"usage: tqserve bench {name} " in new.stdout
    assert new.stderr == ""
    assert old.stderr.splitlines() == [
        f"tqserve: bench-{name} is deprecated: use tqserve bench {name}"]


@pytest.mark.parametrize("name", list(BENCHES))
def test_bench_name_hands_the_rest_of_the_arguments_to_its_tool(name, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", name, "--no-such-flag"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    prog = "tqserve bench" if name == "mlx-lm" else f"tqserve bench {name}"
    assert f"usage: {prog} " in err and "unrecognized arguments: --no-such-flag" in err


@pytest.mark.parametrize("command,module", [("attack", "tqserve.tools.attack"),
                                            ("route-sim", "tqserve.tools.route_sim")])
def test_a_removed_tool_exits_2_naming_its_module(command, module):
    result = cli(command, "--fuzz", "10")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"tqserve: error: {command} is not a tqserve command; run it as python -m {module}"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    direct = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert direct.returncode == 0 and f"usage: python -m {module} " in direct.stdout


def test_bench_ray_names_bad_input_with_exit_2():
    """`tqserve bench ray` (a new name: no deprecated bench-ray alias) refuses an unknown
    policy, a missing trace and no rounds with one line each."""
    assert "bench-ray" not in cli("--help").stdout
    bad = cli("bench", "ray", "--policies", "single,random")
    assert bad.returncode == 2 and "--policies: unknown ['random']" in bad.stderr
    missing = cli("bench", "ray", "--trace", "no/such/trace.jsonl")
    assert missing.returncode == 2 and "--trace: no file at" in missing.stderr
    assert "Traceback" not in bad.stderr + missing.stderr
    zero = cli("bench", "ray", "--rounds", "0")
    assert zero.returncode == 2 and "--rounds must be >= 1, got 0" in zero.stderr
