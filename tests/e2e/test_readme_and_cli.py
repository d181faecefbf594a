"""The README's embedded example and the CLI run for real, as a user would run them."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run(args: list[str], **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                          **kw)


def readme_block(name: str) -> str:
    text = (REPO / "README.md").read_text()
    match = re.search(rf"<!-- {name} -->\n```\w*\n(.*?)```\n<!-- /{name} -->", text, re.S)
    assert match, f"README lost its {name} block"
    return match.group(1)


def test_readme_embedded_example_runs():
    result = run([sys.executable, "-c", readme_block("example:embedded")])
    assert result.returncode == 0, result.stderr
    assert re.search(r"\[(length|stop): \d+ tokens\]", result.stdout)
    assert "rows_active=0" in result.stdout and "kv_bytes=0" in result.stdout


def test_readme_keeps_exactly_the_two_setup_commands():
    install = readme_block("ci:install").strip().splitlines()
    test = readme_block("ci:test").strip().splitlines()
    assert len(install) == 1 and "tqserve generate" in install[0]
    assert len(test) == 1 and "pytest" in test[0]


def test_cli_generate_streams_text():
    result = run([sys.executable, "-m", "tqserve.api.cli", "generate", "--prompt", "def f(x):",
                  "--max-tokens", "12"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def f(x):") and len(result.stdout) > len("def f(x):")


@pytest.mark.parametrize("args,needle", [
    (["generate"], "--prompt"),
    (["generate", "--prompt", "x", "--max-batch", "0"], "--max-batch must"),
    (["generate", "--prompt", "x", "--max-tokens", "lots"], "--max-tokens"),
    (["generate", "--prompt", "x", "--temperature", "-1"], "--temperature must"),
    (["generate", "--prompt", "x", "--model", "no/such/dir/anywhere"], "model"),
    (["generate", "--prompt", "x", "--dtype", "int4"], "--dtype"),
    (["serve", "--port", "70000"], "--port must"),
    (["generate", "--prompt", "x", "--cache-dir", "README.md"], "--cache-dir"),
    (["generate", "--prompt", "x", "--ram-cache-bytes", "-5"], "--ram-cache-bytes must"),
    (["serve", "--shutdown-timeout", "-1"], "--shutdown-timeout must"),
    (["generate", "--prompt", "x", "--default-max-tokens", "5000"],
     "--default-max-tokens (5000) exceeds --max-tokens-cap (4096)"),
    (["generate", "--prompt", "x", "--kv", "affine:4,start=8"],
     "argument --kv: unknown option 'start=8' (options here: group=N)"),
    # checked before the model loads: the missing model is never reached
    (["generate", "--prompt", "x", "--max-tokens", "5000", "--model", "no/such/dir"],
     "--max-tokens (5000) exceeds --max-tokens-cap (4096)"),
    (["frobnicate"], "invalid choice"),
])
def test_cli_bad_arguments_exit_2_with_one_line(args, needle):
    result = run([sys.executable, "-m", "tqserve.api.cli", *args])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_cli_help_describes_every_flag_with_its_default(command):
    from tqserve.api.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    result = run([sys.executable, "-m", "tqserve.api.cli", command, "--help"])
    assert result.returncode == 0, result.stderr
    entries = {e.split()[0]: " ".join(e.split())
               for e in re.split(r"\n  (?=-)", result.stdout.split("options:")[1]) if e.strip()}
    numeric = [a for a in sub.choices[command]._actions if a.type in (int, float)
               and a.help != argparse.SUPPRESS]  # hidden: the deprecated aliases
    assert len(numeric) >= 10
    for action in numeric:
        flag = action.option_strings[0]
        assert action.help, f"{flag} has no description"
        default = "off" if action.default is None else str(action.default)
        assert f"(default: {default})" in entries[flag], entries[flag]
    assert "--max-tokens-cap" in entries and "(default: 4096)" in entries["--max-tokens-cap"]


@pytest.mark.parametrize("command", ["bench", "bench mlx-lm", "bench kv", "bench prefix",
                                     "bench gpu", "eval-kv", "bench spec", "bench tp"])
def test_tool_help_shows_every_default(command):
    result = run([sys.executable, "-m", "tqserve.api.cli", *command.split(), "--help"])
    assert result.returncode == 0, result.stderr
    entries = [" ".join(e.split())
               for e in re.split(r"\n  (?=-)", result.stdout.split("options:")[1]) if e.strip()]
    valued = [e for e in entries if re.match(r"--[\w-]+ [A-Z_{]", e)]  # flags taking a value
    assert valued and all("(default:" in e for e in valued), \
        [e for e in valued if "(default:" not in e]


def test_serve_on_a_taken_port_is_a_one_line_error():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = run([sys.executable, "-m", "tqserve.api.cli", "serve", "--port", str(port)])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0], result.stderr
