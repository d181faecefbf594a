"""The first SIGINT or SIGTERM of a `serve` or `generate` run, from its very start.

`SignalLatch` replaces both signals' handlers, before anything slow runs (MLX's import,
argument checks), with one that only records the first signal: no KeyboardInterrupt is
raised, so none can land inside trio, a model load or an import (a traceback, exit 1), and
SIGTERM no longer kills the process before it can say so. While trio runs, the commands
take both signals through `trio.open_signal_receiver` and note them here too; they read
`signum` when they start, so a signal that came earlier still counts.
"""

from __future__ import annotations

import signal
from types import FrameType, TracebackType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class SignalLatch:
    """`with SignalLatch() as latch:` records the first of SIGNALS in `latch.signum`."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def note(self, signum: int) -> None:
        """Record `signum` unless an earlier signal was recorded."""
        if self.signum is None:
            self.signum = signum

    @property
    def name(self) -> str:
        """The recorded signal's name, e.g. "SIGINT"."""
        return signal.Signals(self.signum).name if self.signum is not None else "-"

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.note(signum)

    def __enter__(self) -> SignalLatch:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._restore()

    def hand_over(self) -> None:
        """Give both signals their previous handlers back now, and raise a signal recorded
        so far again for them: from here on the process ends on signals as any does."""
        self._restore()
        if self.signum is not None:
            signal.raise_signal(self.signum)

    def _restore(self) -> None:
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
