"""Stopping a run whose steps keep failing: consecutive skipped steps, counted one step late.

The train step never applies a non-finite update (`train/step.py`); it reports `finite` = 0
instead. `SkipWatch` reads each step's flag only after the next step has been dispatched, so
the check never stalls the device queue, counts skips in a row, and says when
`train.max_consecutive_skips` is reached. Under fp16 loss scaling an overflow skip is routine
(the scale halves and the step is retried on the next batch); such skips count only once the
scale has reached its minimum.
"""
from __future__ import annotations

from typing import Any


class SkipWatch:
    """Consecutive-skip counter over `(step, metrics, tokens)` records.

    Args:
      limit: stop once this many steps in a row were skipped (0 = never).
      min_loss_scale: the fp16 loss scale's floor, or None without loss scaling.
    Attributes:
      in_a_row: current run of counted skips. total: all skipped steps seen.
      last_bad: `(step, tokens)` of the newest skipped step, or None.
    """

    def __init__(self, limit: int, min_loss_scale: float | None = None):
        self.limit = limit
        self.min_loss_scale = min_loss_scale
        self.in_a_row = 0
        self.total = 0
        self.last_bad: tuple[int, Any] | None = None
        self._pending = None

    def push(self, step: int, metrics: dict, tokens) -> bool:
        """Record step `step` (not read yet); True when the step before it reached the limit."""
        previous, self._pending = self._pending, (step, metrics, tokens)
        return previous is not None and self._account(*previous)

    def flush(self) -> bool:
        """Account the newest pending step (end of the loop)."""
        previous, self._pending = self._pending, None
        return previous is not None and self._account(*previous)

    def _account(self, step: int, metrics: dict, tokens) -> bool:
        if float(metrics["finite"]) != 0:
            self.in_a_row = 0
            return False
        self.total += 1
        self.last_bad = (step, tokens)
        at_floor = (self.min_loss_scale is None
                    or float(metrics["loss_scale"]) <= self.min_loss_scale)
        if at_floor:
            self.in_a_row += 1
        return self.limit > 0 and self.in_a_row >= self.limit
