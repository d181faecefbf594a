"""A `tqserve serve` subprocess for the agent scripts (tools/agent_codex.py,
tools/agent_claude.py): started on a free loopback port, waited for until /health
answers, stopped after; its access-log lines are kept for the report."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Iterator

START_TIMEOUT_S = 120  # a guard on the server's start (model load), never a measurement


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"tqserve serve exited with {server.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"tqserve did not answer {url}/health in {START_TIMEOUT_S} s")


@contextlib.contextmanager
def serving(flags: list[str]) -> Iterator[tuple[str, list[str]]]:
    """`tqserve serve FLAGS` on a free port: yields its URL and a list that holds the
    server's access-log lines once the block has ended (the server stopped)."""
    port = free_port()
    cmd = [sys.executable, "-c", "from tqserve.api.cli import run; run()", "serve",
           "--port", str(port), *flags]
    access: list[str] = []
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, server)
            yield url, access
        finally:
            server.terminate()
            server.wait(timeout=60)
            log.seek(0)
            access += [line for line in log if "tqserve.access" in line]
