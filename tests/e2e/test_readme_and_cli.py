"""The README's embedded example and the CLI run for real, as a user would run them."""

from __future__ import annotations

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
    result = run([sys.executable, "-m", "api.cli", "generate", "--prompt", "def f(x):",
                  "--max-tokens", "12"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def f(x):") and len(result.stdout) > len("def f(x):")


@pytest.mark.parametrize("args,needle", [
    (["generate"], "--prompt"),
    (["generate", "--prompt", "x", "--max-batch", "0"], "max-batch"),
    (["generate", "--prompt", "x", "--max-tokens", "lots"], "--max-tokens"),
    (["generate", "--prompt", "x", "--temperature", "-1"], "temperature"),
    (["generate", "--prompt", "x", "--model", "no/such/dir/anywhere"], "model"),
    (["generate", "--prompt", "x", "--dtype", "int4"], "--dtype"),
    (["serve", "--port", "70000"], "port"),
    (["generate", "--prompt", "x", "--cache-dir", "README.md"], "cache-dir"),
    (["generate", "--prompt", "x", "--ram-cache-bytes", "-5"], "ram-cache-bytes"),
    (["frobnicate"], "invalid choice"),
])
def test_cli_bad_arguments_exit_2_with_one_line(args, needle):
    result = run([sys.executable, "-m", "api.cli", *args])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_serve_on_a_taken_port_is_a_one_line_error():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = run([sys.executable, "-m", "api.cli", "serve", "--port", str(port)])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0], result.stderr
