"""The builder's update chain: what happens between the Gradient node and
the new parameters, as a list of transforms (optax's ``chain``).

Each transform is an ``init``/``update`` pair: ``init(layout)`` declares the
state variables it keeps (before the plan is made), ``update(algo, step)``
emits its nodes into an algorithm graph, tells it what it learned
(``algo.learn``: the state holding the rate, ...), and passes the step on
(or ends the algorithm there).  ``chain_for`` composes them from the builder's arguments:

    [AccumulateGradients(k)]  [ClipByGlobalNorm(c)]  LearningRate(lr)
    [ScaleBySchedule(schedule)]  ApplyOptimizer(optimizer)

The math they share with the other front-ends lives in ``onnxtrain.optim``
(``transforms.clip_by_global_norm``, the update rules).

>>> from onnxtrain.builder.optimizers import SGD
>>> [type(t).__name__ for t in chain_for(SGD(0.1), None, 0.5, 2)]
['AccumulateGradients', 'ClipByGlobalNorm', 'LearningRate', 'ApplyOptimizer']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..core.emitter import Emitter
from ..optim.transforms import clip_by_global_norm
from .optimizers import Optimizer
from .plan import F64, INT64, Layout, Learned, Plan, StateSpec
from .schedules import Schedule


class Algorithm(Protocol):
    """What a transform emits into (``algorithm.Algorithm``): one algorithm graph."""

    plan: Plan
    index: int
    e: Emitter
    #: What the algorithm learned so far.
    learned: Learned

    def learn(self, **learned: object) -> None:
        """Record what emitting learned (fields of ``Learned``)."""

    def bind(self, key: str, value: str) -> None:
        """Bind state variable ``key`` to ``value``."""

    def hyperparameter(self, hint: str, value: float) -> str:
        """A 0-D float64 setting of this algorithm graph, kept as state."""


@dataclass
class Step:
    """What flows along the chain in one algorithm graph."""

    #: d loss / d param for every trainable parameter, as transformed so far.
    grads: list[str]
    #: The learning rate of this update (a 0-D float64), once a transform set it.
    lr: str = ""


class Transform:
    """One link of the chain (see the module docstring)."""

    def init(self, layout: Layout) -> None:
        """Declare the state variables this transform keeps."""

    def update(self, algo: Algorithm, step: Step) -> Step | None:
        """Emit this transform into ``algo``; the step passed on, or None
        where the algorithm ends here."""
        raise NotImplementedError


@dataclass(frozen=True)
class AccumulateGradients(Transform):
    """k micro-batches per update, over two TrainingInfoProtos (see
    ``builder``): the others add their gradient into the sums and end; the
    final one goes on with the mean (sums + g) / n."""

    k: int

    def init(self, layout: Layout) -> None:
        for p in layout.params:
            var = layout.state[p]
            layout.accum[p] = layout.add_state(f"{p}.grad_accum", StateSpec("", var.elem_type, var.shape, "main", 0))
        layout.accum_count = layout.add_state("accum.count", StateSpec("", INT64, (), "main", 0))
        layout.accum_step = layout.add_state("accum.step", StateSpec("", INT64, (), "main", 0))

    def update(self, algo: Algorithm, step: Step) -> Step | None:
        if algo.index != algo.plan.final:
            self.add_into_sums(algo, step.grads)
            return None
        step.grads = self.mean_with_sums(algo, step.grads)
        return step

    @staticmethod
    def add_into_sums(algo: Algorithm, grads: list[str]) -> None:
        """sums = (accum.step == step ? sums : 0) + g;  count likewise + 1;  accum.step = step."""
        plan, e = algo.plan, algo.e
        e.hint = "accumulate"
        current = e.Equal(plan.accum_step, plan.step)
        for p, g in zip(plan.params, grads):
            kept = e.Where(current, plan.accum[p], e.const(0.0, like=g))
            algo.bind(plan.accum[p], e.Add(kept, g))
        count = e.Where(current, plan.accum_count, e.scalar_int(0))
        algo.bind(plan.accum_count, e.Add(count, e.scalar_int(1)))
        algo.bind(plan.accum_step, e.Identity(plan.step))

    @staticmethod
    def mean_with_sums(algo: Algorithm, grads: list[str]) -> list[str]:
        """g_mean = (sums + g) / (count + 1) when the sums belong to this update, else g."""
        plan, e = algo.plan, algo.e
        e.hint = "accumulate"
        current = e.Equal(plan.accum_step, plan.step)
        n = e.Add(e.Where(current, plan.accum_count, e.scalar_int(0)), e.scalar_int(1))
        out, totals = [], []
        for p, g in zip(plan.params, grads):
            kept = e.Where(current, plan.accum[p], e.const(0.0, like=g))
            total = e.Add(kept, g)
            totals.append(total)
            out.append(e.Div(total, e.Cast(n, to=e.dtype(g))))
        algo.learn(reduce_points=algo.learned.reduce_points + tuple(totals))
        return out


@dataclass(frozen=True)
class ClipByGlobalNorm(Transform):
    """g *= min(1, c / (||g||_2 + 1e-6)) over all gradients, in float64
    (``optim.transforms.clip_by_global_norm``).  c is a state variable
    (``Algorithm.hyperparameter``; metadata ``onnxtrain.clip_grad_norm``),
    settable through ``TrainingSession.clip_grad_norm``."""

    max_norm: float

    def update(self, algo: Algorithm, step: Step) -> Step:
        algo.e.hint = "clip"
        clip = algo.hyperparameter("clip_grad_norm", self.max_norm)
        algo.learn(clip_state=clip)
        step.grads = clip_by_global_norm(algo.e, step.grads, clip, F64)
        return step


@dataclass(frozen=True)
class LearningRate(Transform):
    """The base rate lr: a state variable (a 0-D float64 initializer of
    this algorithm graph, reset to ``lr`` by this TrainingInfoProto's
    initialization_binding, which is what makes it state per IR.md), not a
    Constant: ``TrainingSession.learning_rate`` changes it between steps
    without rebuilding, it is saved with a checkpoint, and the step reads it
    like any other state (one commit).  Metadata ``onnxtrain.learning_rate``
    names it."""

    lr: float

    def update(self, algo: Algorithm, step: Step) -> Step:
        algo.e.hint = "lr"
        step.lr = algo.hyperparameter("lr", self.lr)
        algo.learn(lr_state=step.lr, lr_value=step.lr)
        return step


@dataclass(frozen=True)
class ScaleBySchedule(Transform):
    """lr * schedule(step) as a 0-D float64 (``schedules``); the metadata's
    ``learning_rate.value`` names it (``TrainingSession.current_learning_rate``)."""

    schedule: Schedule

    def update(self, algo: Algorithm, step: Step) -> Step:
        algo.e.hint = "lr"
        plan = algo.plan
        if self.schedule.run_total:
            # The run's number of updates, set by fit when it starts (0 until then).
            total = algo.hyperparameter("schedule_total", 0.0)
            algo.learn(schedule_total=total)
            factor = self.schedule.emit(algo.e, plan.step, total)
        else:
            factor = self.schedule.emit(algo.e, plan.step)
        step.lr = algo.e.Mul(step.lr, factor)
        algo.learn(lr_value=step.lr)
        return step


@dataclass(frozen=True)
class ApplyOptimizer(Transform):
    """The optimizer's update of every parameter from the step's gradients
    and rate, its state in slots (``<param>.<slot>``), then ``step + 1``;
    every new value bound.  The end of every chain."""

    optimizer: Optimizer

    def init(self, layout: Layout) -> None:
        final = layout.final
        for p in layout.params:
            var = layout.state[p]
            layout.slots[p] = {}
            for slot, fill in self.optimizer.slots():
                layout.slots[p][slot] = layout.add_state(
                    f"{p}.{slot}", StateSpec("", var.elem_type, var.shape, final, final, fill=fill)
                )
        # The counter: in the main graph when two TrainingInfoProtos share it.
        home = "main" if final else 0
        layout.step = layout.add_state("step", StateSpec("", INT64, (), home, final))

    def update(self, algo: Algorithm, step: Step) -> None:
        plan, e = algo.plan, algo.e
        e.hint = "optimizer"
        state = {slot: [plan.slots[p][slot] for p in plan.params] for slot, _ in self.optimizer.slots()}
        new_params, new_state = self.optimizer.update(e, step.lr, plan.step, plan.params, step.grads, state)
        for p, value in zip(plan.params, new_params):
            algo.bind(p, value)
        for slot, values in new_state.items():
            for p, value in zip(plan.params, values):
                algo.bind(plan.slots[p][slot], value)
        e.hint = "counter"
        algo.bind(plan.step, e.Add(plan.step, e.scalar_int(1)))
        return None


def chain_for(optimizer: Optimizer, schedule: Schedule | None, clip_grad_norm: float | None,
              accumulate: int) -> tuple[Transform, ...]:
    """The chain the builder's arguments ask for (see the module docstring)."""
    chain: list[Transform] = []
    if accumulate > 1:
        chain.append(AccumulateGradients(accumulate))
    if clip_grad_norm is not None:
        chain.append(ClipByGlobalNorm(float(clip_grad_norm)))
    chain.append(LearningRate(optimizer.lr))
    if schedule is not None:
        chain.append(ScaleBySchedule(schedule))
    chain.append(ApplyOptimizer(optimizer))
    return tuple(chain)
