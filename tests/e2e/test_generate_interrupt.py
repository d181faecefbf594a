"""`tqserve generate` interrupted mid-stream, as a real process on the bundled model.

SIGINT (Ctrl-C) and SIGTERM end it with one line on stderr, no traceback, and the exit
code a shell reports for the signal: 130 and 143.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROMPT = "import os\n"  # greedy output loops without an end-of-text for hundreds of tokens
WAIT = 120  # seconds for imports, the model load and the exit: a hang guard


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_mid_stream_is_one_line_and_the_shells_exit_code(sig, code):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with tempfile.TemporaryFile(mode="w+") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tqserve.api.cli", "generate", "--prompt", PROMPT,
             "--max-tokens", "4000", "--blas", "none"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr)
        try:
            # the prompt, then tokens: it is streaming (one read blocks until they come)
            head = proc.stdout.read(len(PROMPT) + 16)
            assert head.startswith(PROMPT.encode()) and len(head) == len(PROMPT) + 16, head
            proc.send_signal(sig)
            rest, _ = proc.communicate(timeout=WAIT)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        stderr.seek(0)
        lines = stderr.read().splitlines()
    assert proc.returncode == code, lines
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert lines[0].startswith(f"tqserve: interrupted by {sig.name} after "), lines
    tokens = int(lines[0].split(" after ")[1].split()[0])
    assert 0 < tokens < 4000, lines  # cut short, not run to the end
    assert (head + rest).endswith(b"\n")  # the shell's prompt starts on a line of its own
