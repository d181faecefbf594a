"""api.signals: the latch records the first SIGINT/SIGTERM and raises nothing."""

from __future__ import annotations

import os
import signal

import pytest

from tqserve.api.signals import SignalLatch


def test_the_first_signal_is_recorded_and_nothing_raised():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with SignalLatch() as latch:
        assert latch.signum is None
        os.kill(os.getpid(), signal.SIGTERM)  # the default handler would end this process
        os.kill(os.getpid(), signal.SIGINT)
        assert latch.signum == signal.SIGTERM and latch.name == "SIGTERM"
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_hand_over_gives_a_recorded_signal_to_the_previous_handler():
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT has a handler of its own here")
    with SignalLatch() as latch:
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):  # Python's own SIGINT handler, again
            latch.hand_over()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
