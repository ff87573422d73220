"""The postconditions of the pass lists: what holds after their steps.

Every program a pass list makes (``pipeline.PASS_LISTS``,
``executed.EXECUTED``) is

- **SSA**: every name is defined once (an input, an initializer or one node
  output), subgraphs included;
- **topologically sorted**: every node reads only names defined before it.

That is checked on every result (``check_sound``: one walk of the graph).
With checks on (``checking``: ``check=True``, as the tests pass it, or the
environment variable ``ONNXTRAIN_CHECK_PASSES=1``) it is checked after
every step, with the step's own postcondition (``pipeline.POSTCONDITIONS``,
``executed.POSTCONDITIONS``: no Gradient node left after the expansion, no
dead node after the pruning, ...) and ``onnx.checker`` with strict shape
inference on the model as it stands (``check_valid``); before
``state_to_inputs`` the state variables a list's first step left out count
as defined.  Off by default: a program of L1's size would take about a
third longer to lower (tests/lower/test_pass_lists.py runs every list with
checks on over a representative set of models).

A broken postcondition is a bug of onnxtrain, not of the model:
``PassError`` names the program, the step and the rule.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import onnx

from ..errors import TrainingModelError
from ..io.model import check_graph_ssa


class PassError(RuntimeError):
    """A step of a pass list broke a postcondition (a bug of onnxtrain: the
    message names the program, the step and what does not hold)."""


#: The environment variable that turns the checks of every step on.
CHECK_ENV = "ONNXTRAIN_CHECK_PASSES"


def checking(check: bool | None) -> bool:
    """Whether to check every step: ``check``, or where None, ``ONNXTRAIN_CHECK_PASSES=1``."""
    return os.environ.get(CHECK_ENV) == "1" if check is None else bool(check)


def step_name(step: Callable) -> str:
    return getattr(step, "__name__", repr(step))


def check_sound(graph: onnx.GraphProto, where: str, defined_outside: Iterable[str] = ()) -> None:
    """SSA and topological order (``io.model.check_graph_ssa``), or PassError."""
    try:
        check_graph_ssa("graph", graph, {}, set(defined_outside))
    except TrainingModelError as exc:
        raise PassError(f"{where}: the graph is no longer SSA and sorted: {exc}") from None


def check_valid(model: onnx.ModelProto, where: str) -> None:
    """``onnx.checker`` with strict shape inference, or PassError."""
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as exc:  # the checker's and shape inference's own error types
        raise PassError(f"{where}: onnx.checker refuses the program: {exc}") from None


def check_condition(problem: str | None, where: str) -> None:
    """A step's own postcondition (``problem``: what does not hold, or None)."""
    if problem:
        raise PassError(f"{where}: {problem}")
