"""`tqserve route` as a process: one-line errors, help with defaults, SIGTERM drains."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import httpx
import pytest
import trio

from tests.api.routerkit import start_replica
from tests.conftest import REPO

CLI = [sys.executable, "-m", "tqserve.api.cli"]


@pytest.mark.parametrize("args, needle", [
    ([], "--backend"),
    (["--backend", "127.0.0.1:8000"], "give http://host:port"),
    (["--backend", "http://a:1", "--backend", "http://a:1"], "listed twice"),
    (["--backend", "http://a:1", "--spill-threshold", "0"], "--spill-threshold must be >= 1"),
    (["--backend", "http://a:1", "--min-match-fraction", "2"], "--min-match-fraction must"),
    (["--backend", "http://a:1", "--policy", "random"], "invalid choice"),
    (["--backend", "http://a:1", "--port", "99999"], "--port must be <= 65535"),
])
def test_bad_arguments_exit_2_with_one_line(args, needle):
    result = subprocess.run([*CLI, "route", *args], capture_output=True, text=True,
                            cwd=REPO, timeout=60)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and needle in lines[0], result.stderr


def test_taken_port_is_a_one_line_error():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = subprocess.run([*CLI, "route", "--backend", "http://127.0.0.1:1", "--port",
                                 str(port)], capture_output=True, text=True, cwd=REPO,
                                timeout=60)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in lines[0]


def test_help_shows_every_default():
    out = subprocess.run([*CLI, "route", "--help"], capture_output=True, text=True, cwd=REPO,
                         timeout=60).stdout
    entries = [" ".join(e.split()) for e in re.split(r"\n  (?=-)", out.split("options:")[1])]
    valued = [e for e in entries if re.match(r"--[\w-]+ [A-Z_{]", e)
              and not e.startswith(("--backend URL", "--backend-api-key"))]
    assert len(valued) >= 14 and all("(default:" in e for e in valued), valued


async def test_route_process_serves_then_drains_on_sigterm(nursery, draft_model):
    replica = await start_replica(nursery, draft_model)
    proc = await trio.lowlevel.open_process(
        [*CLI, "route", "--port", "0", "--backend", replica.url], cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    buf = b""
    while b"\n" not in buf:
        chunk = await proc.stdout.receive_some(4096)
        assert chunk, "tqserve route exited before it listened"
        buf += chunk
    url = re.search(rb"on (http://\S+) ", buf).group(1).decode()
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        r = await http.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    proc.send_signal(signal.SIGTERM)
    assert await proc.wait() == 0
    err = (await proc.stderr.receive_some(65536)).decode()
    assert "router shut down on SIGTERM" in err and "Traceback" not in err
