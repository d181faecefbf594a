"""`tqserve generate`: one request on an embedded engine, its text streamed to stdout.

SIGINT (Ctrl-C) and SIGTERM end it at any moment (importing MLX, loading the model,
prefilling, streaming tokens) with one line on stderr, e.g. `tqserve: interrupted by
SIGINT after 37 tokens`, and the exit code shells report for that signal, 128 + its
number (130, 143). The signal cancels the run, so the engine closes as after any cancel
(the row freed, pending SSD writes drained); a step or a model load under way finishes
first. A signal before trio ran (api.signals) ends it before the model loads. Only the
first signal counts.
"""

from __future__ import annotations

import signal
import sys
from typing import TYPE_CHECKING

import trio

from tqserve import blas
from tqserve.api.signals import SIGNALS, SignalLatch

if TYPE_CHECKING:
    from tqserve.engine.config import Config
    from tqserve.engine.sampling import SamplingParams


class Progress:
    """How far a run got: what it was doing, tokens printed, an unfinished stdout line."""

    def __init__(self) -> None:
        self.stage = "while starting"
        self.num_tokens = 0
        self.printed = False  # stdout holds text without its final newline

    def report(self, signum: int) -> int:
        """End stdout's line, write the one stderr line; the exit code for `signum`."""
        if self.printed:
            sys.stdout.write("\n")
            sys.stdout.flush()
        where = f"after {self.num_tokens} tokens" if self.num_tokens else self.stage
        print(f"tqserve: interrupted by {signal.Signals(signum).name} {where}",
              file=sys.stderr, flush=True)
        return 128 + signum


async def run_generate(config: Config, params: SamplingParams, prompt: str,
                       latch: SignalLatch, blas_line: str | None = None) -> int:
    """Generate and print until done or signalled. Exit code: 0; 2 when the engine
    refused the request; 128 + the signal's number when interrupted."""
    progress = Progress()
    code = 0
    with trio.open_signal_receiver(*SIGNALS) as signals:
        if latch.signum is None:
            async with trio.open_nursery() as nursery:
                async def watch() -> None:
                    async for signum in signals:
                        latch.note(signum)
                        nursery.cancel_scope.cancel()

                nursery.start_soon(watch)
                code = await _generate(config, params, prompt, progress, blas_line)
                nursery.cancel_scope.cancel()
    return code if latch.signum is None else progress.report(latch.signum)


async def _generate(config: Config, params: SamplingParams, prompt: str,
                    progress: Progress, blas_line: str | None) -> int:
    from tqserve.actors.engine import open_engine
    from tqserve.actors.messages import Error, Token
    from tqserve.engine.request import GenerateRequest

    request = GenerateRequest(prompt=prompt, params=params)
    progress.stage = "while loading the model"
    async with open_engine(config) as engine:
        blas.say_once(blas_line)
        sys.stdout.write(prompt)
        progress.printed, progress.stage = True, "before the first token"
        async for event in engine.generate(request):
            if isinstance(event, Token):
                progress.num_tokens += 1
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif isinstance(event, Error):
                print(f"\ntqserve: error: {event.code}: {event.message}", file=sys.stderr)
                return 2
    sys.stdout.write("\n")
    progress.printed = False
    return 0
