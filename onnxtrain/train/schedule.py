"""What ``fit`` does about a learning-rate schedule: the run's total, and its end.

- A schedule built without a total (``build.cosine()``, ``make-training
  --schedule cosine``) keeps it in a state variable (metadata
  ``onnxtrain.schedule``); when ``fit`` starts and it is not set yet (a
  checkpoint may hold it), it becomes the run's number of updates: the
  batches of ``epochs`` epochs whose algorithm (``cycle``) computes the rate.
- When a step's rate is 0 while the base rate is not, the schedule has ended
  (cosine's factor stays 0 past its total): one warning per run names the
  schedule, since further steps change nothing.

>>> updates((0,), 3 * 10, 0), updates((0, 0, 1), 3 * 10, 1), updates((None,), 7, 0)
(30, 10, 7)
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from ..io.metadata import model_metadata


class ScheduleEndedWarning(UserWarning):
    """``fit`` trains on with a learning rate of 0: the schedule has ended."""


def updates(cycle: Sequence[int | None], batches: int, algorithm: int) -> int:
    """How many of ``batches`` consecutive batches (from the cycle's start) run
    ``algorithm`` (None in the cycle runs every algorithm)."""
    hits = [a is None or a == algorithm for a in cycle]
    whole, rest = divmod(batches, len(cycle))
    return whole * sum(hits) + sum(hits[:rest])


class ScheduleWatch:
    """Warns once, the first time a step's rate is 0 while the base rate is not."""

    def __init__(self, spec: str, total: int | None, base: float) -> None:
        #: ``total``: the run's total of a schedule that spans the run, else None.
        self.spec, self.total, self.base = spec, total, base
        self.warned = False

    def check(self, lr: float, epoch: int, batch: int) -> None:
        if self.warned or lr != 0.0 or self.base == 0.0:
            return
        self.warned = True
        if self.total:
            what = (f"{self.spec}, over the {self.total} updates of the run that set it,")
            fix = "rebuild the model, or set sess.schedule_total_steps in Python, to train longer"
        else:
            what = self.spec
            fix = "build with a longer schedule, or with cosine alone to span the run"
        warnings.warn(
            f"fit: the learning-rate schedule {what} has ended: the rate is 0 from epoch "
            f"{epoch + 1}, batch {batch + 1} on, so further steps change nothing ({fix})",
            ScheduleEndedWarning, stacklevel=6)  # the caller of TrainingSession.fit (via _Fit.train_batch)


def start_schedule(sess: Any, epochs: int, per_epoch: int | None,
                   cycle: Sequence[int | None]) -> ScheduleWatch | None:
    """Set the run's total of a schedule that takes it from the run (when unset)
    and return the watch of its end; None for a model without a schedule."""
    model = getattr(sess, "model", None)
    info = model_metadata(model).get("schedule") if model is not None else None
    if not isinstance(info, dict):
        return None
    spec = str(info.get("spec", "?"))
    total = None
    if info.get("state"):
        total = sess.schedule_total_steps
        if total is None:
            if per_epoch is None:
                raise ValueError(
                    f"fit: the schedule {spec} spans the run, but the data has no length to count "
                    "its updates; set sess.schedule_total_steps first, or pass a list of batches")
            total = updates(cycle, epochs * per_epoch, int(info.get("algorithm", 0)))
            warmup = int(info.get("warmup", 0))
            if total <= warmup:
                raise ValueError(f"fit: the schedule {spec} spans the run, whose {total} "
                                 f"update(s) do not go past its warmup of {warmup}")
            sess.schedule_total_steps = total
    return ScheduleWatch(spec, total, float(sess.learning_rate))
