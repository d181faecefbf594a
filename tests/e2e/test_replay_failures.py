"""tqserve replay when things go wrong, on the bundled model: interrupted (SIGINT, SIGTERM
as a real process; --timeout) it writes what it measured, marked partial, and exits
130 / 143 / 124 with one line; failed requests keep the server's message and exit 3; the
context check warns before sending (or leaves requests out); a missing matplotlib is said
once at the start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tqserve.engine.model import DEFAULT_MODEL
from tqserve.tools.replay.cli import main

WAIT = 120  # seconds for the child's imports, model load and exit: a hang guard
COMMON = ["--model", str(DEFAULT_MODEL), "--dtype", "float32", "--block-tokens", "8",
          "--concurrency", "2"]


def _trace(tmp_path: Path, rows: list[dict], name: str = "trace.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _long_trace(tmp_path: Path) -> Path:
    """40 requests of 100 output tokens: a run that lasts well past its first requests."""
    return _trace(tmp_path, [{"timestamp": 100 * i, "input_length": 700, "output_length": 100,
                              "hash_ids": [0, i + 1]} for i in range(40)])


def _check_partial(out: Path, reason: str) -> dict:
    summary = json.loads((out / "A" / "summary.json").read_text())
    partial = summary["partial"]
    assert partial["reason"] == reason
    rows = [json.loads(x) for x in (out / "A" / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == partial["ended"] + partial["cut_off"] >= 1
    assert partial["ended"] + partial["cut_off"] + partial["not_sent"] == 40
    assert partial["not_sent"] > 0
    cut = [r for r in rows if r["error"] == "interrupted"]
    assert len(cut) == partial["cut_off"] == summary["interrupted"]
    assert all(reason in r["error_message"] for r in cut)
    assert summary["failed"] == 0 and summary["completed"] == partial["ended"]
    return summary


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_writes_partial_results_and_one_line(tmp_path, sig, code):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "tqserve.api.cli", "replay", str(_long_trace(tmp_path)),
           *COMMON, "--out", str(out), "--no-plots"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        seen = b""
        while b" 1/40 " not in seen:  # the progress bar: one request has ended
            chunk = proc.stderr.read1(4096)
            assert chunk, seen.decode(errors="replace")
            seen += chunk
        proc.send_signal(sig)
        stdout, rest = proc.communicate(timeout=WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [x for x in (seen + rest).decode().replace("\r", "\n").splitlines()
             if x.strip() and not x.startswith("A embedded")]  # less the progress bar
    assert proc.returncode == code, lines
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert lines[0].startswith(f"tqserve replay: interrupted by {sig.name} after "), lines
    assert f"partial results in {out / 'A'}" in lines[0]
    assert f"(PARTIAL: {sig.name})" in stdout.decode()
    _check_partial(out, sig.name)


def test_timeout_writes_partial_results(tmp_path, capsys):
    out = tmp_path / "out"
    argv = [str(_long_trace(tmp_path)), *COMMON, "--timeout", "3", "--no-progress",
            "--no-plots", "--out", str(out)]
    assert main(argv) == 124
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tqserve replay: interrupted by --timeout 3 s")
    summary = _check_partial(out, "--timeout 3 s")
    assert summary["partial"]["at_s"] >= 3


def test_failed_requests_keep_the_reason_and_exit_3(tmp_path, capsys):
    big = {"timestamp": 10, "input_length": 33000, "output_length": 4,
           "hash_ids": list(range(100, 165))}  # 33,000 tokens: over the context of 32768
    trace = _trace(tmp_path, [
        {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [0, 1]}, big,
        {"timestamp": 20, "input_length": 900, "output_length": 4, "hash_ids": [0, 1]}])
    argv = [str(trace), "--model", str(DEFAULT_MODEL), "--dtype", "float32", "--concurrency",
            "1", "--no-progress", "--no-plots"]
    assert main(argv + ["--out", str(tmp_path / "a")]) == 3
    captured = capsys.readouterr()
    assert captured.err.startswith("WARNING: 1 of 3 requests have prompt + max_tokens over "
                                   "the target's context of 32768 tokens")
    assert "1 of 3 requests failed on A (invalid_request 1)" in captured.err
    reason = "prompt_tokens holds 33000 ids, more than the model's context of 32768 tokens"
    assert f"invalid_request                  1  {reason}" in captured.out
    rows = [json.loads(x) for x in (tmp_path / "a" / "A" / "requests.jsonl").read_text()
            .splitlines()]
    assert [r["error"] for r in rows] == [None, "invalid_request", None]
    assert rows[1]["error_message"] == reason and rows[1]["end_s"] >= rows[1]["send_s"]
    summary = json.loads((tmp_path / "a" / "A" / "summary.json").read_text())
    assert summary["stats_after"]["limits"]["max_model_len"] == 32768
    assert summary["reuse"]["prompt_tokens"] == 600 + 900  # ideals over completed prompts
    assert summary["by_outcome"]["ram"]["requests"] == 1  # 900 reuses 599 of 600

    assert main(argv + ["--skip-over-context", "--out", str(tmp_path / "b")]) == 0
    err = capsys.readouterr().err
    assert err.startswith("context check: left out 1 of 3 requests") and "WARNING" not in err
    summary = json.loads((tmp_path / "b" / "A" / "summary.json").read_text())
    assert (summary["completed"], summary["failed"], summary["skipped_over_context"]) == (2, 0, 1)


def test_missing_matplotlib_is_said_at_start(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    trace = _trace(tmp_path, [{"timestamp": 0, "input_length": 600, "output_length": 2,
                               "hash_ids": [0, 1]}])
    out = tmp_path / "out"
    argv = [str(trace), *COMMON, "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == ["plots off: matplotlib is not installed (pip install 'tqserve[replay]'); "
                   "the JSON and JSONL are written"]
    assert (out / "A" / "summary.json").is_file() and not (out / "A" / "replay.png").exists()
