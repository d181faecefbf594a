"""Run one prompt through OpenAI's Codex CLI (`codex exec`) against tqserve's Responses API.

    python -m tqserve.tools.agent_codex [--url URL | --model PATH] [--chat-template FILE]
                                        [--max-tokens 64] [--prompt TEXT]

Without --url it starts `tqserve serve` on a free loopback port (the bundled model and
the test ChatML template with tools unless told otherwise; --max-tokens is the server's
--default-max-tokens, which caps Codex's turns since Codex sends no max_output_tokens),
and stops it after. Codex runs with a throwaway CODEX_HOME and working directory, a
provider `tqserve` pointing at URL/v1 with `wire_api = "responses"`, read-only sandbox.
Codex is `codex` on PATH or $TQSERVE_CODEX (`npm install -g @openai/codex`). Prints
Codex's output and the server's access-log lines; exits with Codex's exit code.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tqserve.tools.agent_server import serving

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = REPO / "tests" / "api" / "templates" / "chatml_tools.jinja"
MODEL_NAME = "tqserve-local"
RUN_TIMEOUT_S = 900    # a guard on Codex's run on a slow CPU


def codex_binary() -> str | None:
    return os.environ.get("TQSERVE_CODEX") or shutil.which("codex")


def run_codex(url: str, prompt: str, codex: str) -> subprocess.CompletedProcess:
    provider = (f'{{name="tqserve", base_url="{url}/v1", wire_api="responses", '
                'env_key="TQSERVE_CODEX_KEY"}')
    with tempfile.TemporaryDirectory() as home, tempfile.TemporaryDirectory() as work:
        env = {**os.environ, "CODEX_HOME": home, "TQSERVE_CODEX_KEY": "unused"}
        return subprocess.run(
            [codex, "exec", "--skip-git-repo-check", "--sandbox", "read-only",
             "-m", MODEL_NAME, "-c", "model_provider=tqserve",
             "-c", f"model_providers.tqserve={provider}", prompt],
            cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=RUN_TIMEOUT_S)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running tqserve (default: start one)")
    p.add_argument("--model", help="model for the started server (default: the bundled one)")
    p.add_argument("--chat-template", default=str(TEMPLATE))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt", default="Say hello.")
    args = p.parse_args(argv)
    codex = codex_binary()
    if codex is None:
        print("agent_codex: codex not found: npm install -g @openai/codex (or set "
              "TQSERVE_CODEX)", file=sys.stderr)
        return 2
    if args.url:
        done = run_codex(args.url.rstrip("/"), args.prompt, codex)
        print(done.stdout + done.stderr)
        return done.returncode
    flags = ["--served-model-name", MODEL_NAME, "--default-max-tokens", str(args.max_tokens),
             "--chat-template", args.chat_template]
    if args.model:
        flags += ["--model", args.model]
    with serving(flags) as (url, access):
        done = run_codex(url, args.prompt, codex)
    print(done.stdout + done.stderr)
    print("".join(access), end="")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
