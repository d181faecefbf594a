"""Screenshot the playground page in headless Chromium (the picture in docs/serving.md).

    python -m tqserve.tools.playground_shot [--model PATH] [--out docs/playground.png]
                                    [--prompt TEXT] [--max-tokens 96] [--seed 3]

Starts a real server (float32) on a loopback port, opens `/` in Debian's `chromium`
(`apt-get install chromium`; TQSERVE_CHROMIUM names another binary) driven by
Playwright's Python package with executable_path:
Playwright's own browser downloads are never used. The prompt runs twice (the second run
reuses the first one's prefix from the RAM tier, so the summary shows cached tokens), then
the pointer rests on the least likely token so its alternatives show, and a 1000x700 PNG
is saved. `launch_chromium` is the one place that knows the browser's flags; the tests use
it too.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

CHROMIUM = os.environ.get("TQSERVE_CHROMIUM", "/usr/bin/chromium")  # Debian's package
CHROMIUM_ARGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync")
VIEWPORT = {"width": 1000, "height": 700}
ACTION_TIMEOUT_MS = 60_000  # a hang guard for each browser wait, never a measurement
DEFAULT_PROMPT = "import json\n\n\ndef load_config(path):\n"


def chromium_missing() -> str | None:
    """Why the browser cannot run here, naming what to install; None when it can."""
    if not Path(CHROMIUM).is_file():
        return (f"{CHROMIUM} not found: install Debian's chromium (apt-get install chromium) "
                "or point TQSERVE_CHROMIUM at a Chromium binary")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed: pip install playwright (in the test extra)"
    return None


def launch_chromium(playwright: Any, user_data_dir: Path) -> Any:
    """A headless Chromium context on a fresh profile dir (Playwright's BrowserContext)."""
    context = playwright.chromium.launch_persistent_context(
        str(user_data_dir), executable_path=CHROMIUM, headless=True, args=list(CHROMIUM_ARGS),
        viewport=VIEWPORT)
    context.set_default_timeout(ACTION_TIMEOUT_MS)
    return context


def run_in_page(page: Any, prompt: str, *, max_tokens: int, temperature: float,
                seed: int | None = None, top_logprobs: int = 5) -> None:
    """Fill the form, click Generate and wait until the request has ended."""
    page.fill("#prompt", prompt)
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", str(temperature))
    page.fill("#seed", "" if seed is None else str(seed))
    page.fill("#top-logprobs", str(top_logprobs))
    page.click("#generate")
    page.wait_for_selector("#generate:not([disabled])")  # the request has ended


def take_screenshot(context: Any, url: str, out: Path, *, prompt: str = DEFAULT_PROMPT,
                    max_tokens: int = 96, seed: int = 3) -> None:
    """Generate twice on the page at `url`, hover the least likely token, save a PNG."""
    page = context.new_page()
    page.goto(url + "/")
    page.wait_for_selector("#connection[data-state='open']")
    for _ in range(2):
        run_in_page(page, prompt, max_tokens=max_tokens, temperature=0.7, seed=seed)
    page.evaluate("document.activeElement.blur()")
    lowest = page.evaluate("""() => {
        const spans = [...document.querySelectorAll('.tok[data-logprob]')];
        spans.sort((a, b) => Number(a.dataset.logprob) - Number(b.dataset.logprob));
        return spans.length ? Number(spans[0].dataset.index) : -1; }""")
    if lowest >= 0:
        page.hover(f".tok[data-index='{lowest}']")
        page.wait_for_selector("#tooltip:not([hidden])")
    out.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(out))
    page.close()


async def _serve_and_shoot(args: argparse.Namespace) -> None:
    import trio
    from playwright.sync_api import sync_playwright

    from tqserve.api.config import ServerConfig
    from tqserve.api.server import serve
    from tqserve.engine.model import load_model

    def shoot(url: str) -> None:
        with tempfile.TemporaryDirectory() as profile, sync_playwright() as playwright:
            context = launch_chromium(playwright, Path(profile))
            try:
                take_screenshot(context, url, args.out, prompt=args.prompt,
                                max_tokens=args.max_tokens, seed=args.seed)
            finally:
                context.close()

    loaded = load_model(args.model, "float32")
    async with trio.open_nursery() as nursery:
        url = await nursery.start(lambda task_status: serve(
            ServerConfig(port=0), loaded=loaded, task_status=task_status))
        await trio.to_thread.run_sync(shoot, url)
        nursery.cancel_scope.cancel()


def main(argv: Sequence[str] | None = None) -> int:
    """Take the screenshot; exit 2 with one line when the browser is missing."""
    from tqserve.engine.model import DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="python -m tqserve.tools.playground_shot",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--out", type=Path, default=Path("docs/playground.png"))
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args(argv)
    problem = chromium_missing()
    if problem is not None:
        print(f"playground_shot: {problem}", file=sys.stderr)
        return 2
    import trio

    trio.run(_serve_and_shoot, args)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
