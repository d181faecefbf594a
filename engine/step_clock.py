"""The runner's step measurements: step gaps and steady decode steps.

A step gap is the time from one `execute` returning to the next starting while a forward
was in flight (the trio side's time per step; tools/step_idle reads them). A steady
decode step reports its duration, the time since the previous step ended
(`StepResult.decode_seconds`): the time policy's measurement (engine.speculative's
`throughput.py`). A step is steady when it prefills, joins, releases, spills and
snapshots nothing, takes the same decode path as the step before ("plain": pipelined,
"speculative": a verify step; "switch": finishing the plain forward in flight before a
verify step, never steady), and runs a forward shape (path, rows, positions per row) run
before: the first run of a shape may compile kernels on MLX-CUDA.
"""

from __future__ import annotations

import time
from collections import deque

import attrs

from tqserve.engine.step import StepPlan, StepResult

STEP_GAPS_KEPT = 4096  # recent step gaps kept for tools/step_idle (a few seconds of steps)


class StepClock:
    """Set `mode` and `shape` during a step; `start` and `end` bracket it."""

    def __init__(self) -> None:
        self.mode: str | None = None                   # this step's decode path
        self.shape: tuple[str, int, int] | None = None  # its decode forward's shape
        self.num_gaps = 0
        self.gap_seconds = 0.0
        self._last_end: float | None = None
        self._last_mode: str | None = None  # the last steady-able step's path
        self._shapes: set[tuple[str, int, int]] = set()
        self._gaps: deque[float] = deque(maxlen=STEP_GAPS_KEPT)

    def start(self, *, in_flight: bool) -> None:
        """A step begins; `in_flight`: a forward ran since the last one ended."""
        if in_flight and self._last_end is not None:
            gap = time.perf_counter() - self._last_end
            self._gaps.append(gap)
            self.num_gaps += 1
            self.gap_seconds += gap
        self.mode = None
        self.shape = None

    def end(self, plan: StepPlan, result: StepResult) -> StepResult:
        """The step ended: `result` with its duration if it was a steady decode step."""
        end = time.perf_counter()
        clean = self.mode is not None and not (
            plan.new_rows or plan.prefill or plan.join or plan.release or plan.spill
            or plan.snapshot or plan.prompt_snapshot)
        first_of_shape = self.shape is not None and self.shape not in self._shapes
        if self.shape is not None:
            self._shapes.add(self.shape)
        if (clean and not first_of_shape and self._last_end is not None
                and self.mode == self._last_mode):
            result = attrs.evolve(result, decode_seconds=end - self._last_end,
                                  speculative=self.mode == "speculative")
        self._last_mode = self.mode if clean else None
        self._last_end = end
        return result

    def gaps(self) -> list[float]:
        """The most recent step gaps in seconds (at most STEP_GAPS_KEPT), oldest first."""
        return list(self._gaps)
