"""Learning-rate schedules, computed inside the algorithm graph from the step counter.

A schedule is a factor f(s) of the base learning rate, where s is the step
counter before the update (0 at the first update).  The update number s uses
``lr * f(s)``: the semantics of ``torch.optim.lr_scheduler.LambdaLR(opt, f)``
with ``scheduler.step()`` called after every ``optimizer.step()``.

- ``linear_warmup(w)``        f(s) = min(1, (s + 1) / w)
- ``step_decay(n, gamma)``    f(s) = gamma ** floor(s / n)                 (= torch StepLR)
- ``cosine(T, warmup=w)``     f(s) = (s + 1) / w                           for s < w
                              f(s) = (1 + cos(pi * min(1, (s - w) / (T - w)))) / 2   otherwise
                              (w = 0: torch CosineAnnealingLR(T_max=T, eta_min=0) up to s = T;
                              after T the factor stays 0 instead of rising again)
- ``cosine()``                the same, T the updates of the run: a state variable
                              (metadata ``onnxtrain.schedule``) that ``fit`` sets when it
                              starts, to epochs x updates per epoch, unless a checkpoint
                              already holds it (``TrainingSession.schedule_total_steps``);
                              until it is set, the factor is 1 after the warmup

``factor(s)`` is the same formula in Python, for tests and for plotting;
``spec`` the schedule as ``make-training --schedule`` writes it.

>>> [round(step_decay(2, 0.5).factor(s), 3) for s in range(5)]
[1.0, 1.0, 0.5, 0.5, 0.25]
>>> [round(linear_warmup(4).factor(s), 2) for s in range(5)]
[0.25, 0.5, 0.75, 1.0, 1.0]
>>> round(cosine(10).factor(5), 6), cosine().factor(5, total=10) == cosine(10).factor(5)
(0.5, True)
>>> cosine(1000, 100).spec, cosine().spec, step_decay(500, 0.5).spec
('cosine:1000:100', 'cosine', 'step_decay:500:0.5')
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from onnx import TensorProto

from ..core.emitter import Emitter

F64 = TensorProto.DOUBLE


class Schedule:
    """A learning-rate factor f(step)."""

    #: Whether the total number of updates comes from the run (``fit`` sets it):
    #: then ``emit`` gets the 0-D float64 tensor holding it as ``total``.
    run_total = False

    def factor(self, step: int) -> float:
        """f(step) in Python (the reference of ``emit``)."""
        raise NotImplementedError

    def emit(self, e: Emitter, step: str) -> str:
        """Append nodes computing f(step) as a 0-D float64 tensor from the int64 counter."""
        raise NotImplementedError

    @property
    def spec(self) -> str:
        """The schedule as ``make-training --schedule`` writes it (``cosine:1000``)."""
        return type(self).__name__


def _as_float(e: Emitter, step: str) -> str:
    return e.Cast(step, to=F64)


def _check_positive_int(owner: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{owner}: {name} must be an integer > 0, got {value!r}")


@dataclass(frozen=True)
class LinearWarmup(Schedule):
    """f(s) = min(1, (s + 1) / warmup_steps)."""

    warmup_steps: int

    def __post_init__(self) -> None:
        _check_positive_int("linear_warmup", warmup_steps=self.warmup_steps)

    def factor(self, step: int) -> float:
        return min(1.0, (step + 1) / self.warmup_steps)

    @property
    def spec(self) -> str:
        return f"linear_warmup:{self.warmup_steps}"

    def emit(self, e: Emitter, step: str) -> str:
        one = e.const(1.0, dtype=F64)
        ramp = e.Div(e.Add(_as_float(e, step), one), e.const(float(self.warmup_steps), dtype=F64))
        return e.Min(ramp, one)


@dataclass(frozen=True)
class StepDecay(Schedule):
    """f(s) = gamma ** floor(s / step_size)  (torch.optim.lr_scheduler.StepLR)."""

    step_size: int
    gamma: float = 0.1

    def __post_init__(self) -> None:
        _check_positive_int("step_decay", step_size=self.step_size)
        if not (isinstance(self.gamma, (int, float)) and self.gamma >= 0):
            raise ValueError(f"step_decay: gamma must be a number >= 0, got {self.gamma!r}")

    def factor(self, step: int) -> float:
        return float(self.gamma) ** (step // self.step_size)

    @property
    def spec(self) -> str:
        return f"step_decay:{self.step_size}:{self.gamma:g}"

    def emit(self, e: Emitter, step: str) -> str:
        # Integer division of a non-negative counter is floor division.
        periods = e.Div(step, e.scalar_int(self.step_size))
        return e.Pow(e.const(float(self.gamma), dtype=F64), _as_float(e, periods))


@dataclass(frozen=True)
class Cosine(Schedule):
    """Linear warmup over ``warmup`` steps, then cosine annealing to 0 at ``total_steps``
    (None: the updates of the run, set by ``fit``; see the module doc).

    f(s) = (s + 1) / warmup                                       for s < warmup
    f(s) = (1 + cos(pi * min(1, (s - warmup) / (total_steps - warmup)))) / 2   otherwise"""

    total_steps: int | None = None
    warmup: int = 0

    def __post_init__(self) -> None:
        if self.total_steps is not None:
            _check_positive_int("cosine", total_steps=self.total_steps)
        limit = "" if self.total_steps is None else f", total_steps={self.total_steps}"
        if (not isinstance(self.warmup, int) or isinstance(self.warmup, bool) or self.warmup < 0
                or (self.total_steps is not None and self.warmup >= self.total_steps)):
            raise ValueError(f"cosine: warmup must be an integer in [0{limit}), got {self.warmup!r}")

    @property
    def run_total(self) -> bool:  # type: ignore[override]
        return self.total_steps is None

    @property
    def spec(self) -> str:
        if self.total_steps is None:
            return "cosine" + (f"::{self.warmup}" if self.warmup else "")
        return f"cosine:{self.total_steps}" + (f":{self.warmup}" if self.warmup else "")

    def factor(self, step: int, total: int | None = None) -> float:
        total = self.total_steps if self.total_steps is not None else total
        if step < self.warmup:
            return (step + 1) / self.warmup
        if not total:  # the run's total, not set yet
            return 1.0
        progress = min(1.0, (step - self.warmup) / (total - self.warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    def emit(self, e: Emitter, step: str, total: str | None = None) -> str:
        s = _as_float(e, step)
        warmup = e.const(float(self.warmup), dtype=F64)
        if self.total_steps is not None:
            span = e.const(float(self.total_steps - self.warmup), dtype=F64)
        else:
            # The run's total (0 until fit sets it; max() keeps the division finite).
            span = e.Max(e.Sub(total, warmup), e.const(1.0, dtype=F64))
        progress = e.Min(e.Div(e.Sub(s, warmup), span), e.const(1.0, dtype=F64))
        half = e.const(0.5, dtype=F64)
        cosine = e.Cos(e.Mul(e.const(math.pi, dtype=F64), progress))
        annealed = e.Mul(half, e.Add(e.const(1.0, dtype=F64), cosine))
        if self.total_steps is None:  # factor 1 until the total is set
            unset = e.LessOrEqual(total, e.const(0.0, dtype=F64))
            annealed = e.Where(unset, e.const(1.0, dtype=F64), annealed)
        if not self.warmup:
            return annealed
        ramp = e.Div(e.Add(s, e.const(1.0, dtype=F64)), warmup)
        warming = e.Less(step, e.scalar_int(self.warmup))
        return e.Where(warming, ramp, annealed)


def cosine(total_steps: int | None = None, warmup: int = 0) -> Cosine:
    """Cosine annealing to 0 over ``total_steps`` updates (None: the updates of
    the run, set when ``fit`` starts), after ``warmup`` linear warmup steps."""
    return Cosine(total_steps, warmup)


def step_decay(step_size: int, gamma: float = 0.1) -> StepDecay:
    """Multiply the learning rate by ``gamma`` every ``step_size`` updates."""
    return StepDecay(step_size, gamma)


def linear_warmup(warmup_steps: int) -> LinearWarmup:
    """Ramp the learning rate linearly over ``warmup_steps`` updates, then hold it."""
    return LinearWarmup(warmup_steps)
