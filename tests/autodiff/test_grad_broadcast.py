"""Gradients of binary ops whose *first* operand is the broadcast one.

The elementwise corpus mostly broadcasts the second operand; a rule that
forgets to sum the first operand's gradient back over the broadcast axes
(``dA = unbroadcast(dY * B, shape(A))``) would pass it.  These cases catch
that for Mul (and its neighbours), static and symbolic shapes alike."""

from __future__ import annotations

import numpy as np
import pytest
from grad_cases import Case, case_params, ins, normal, run_case

BCAST = dict(broadcasts=True, opsets=(9, 13, 18))

CASES = [
    Case("Mul-first-vector", "Mul", ins(a=normal(4), b=normal(2, 3, 4)), **BCAST),
    Case("Mul-first-column", "Mul", ins(a=normal(3, 1), b=normal(2, 3, 4)), **BCAST),
    Case("Mul-first-size1-lead", "Mul", ins(a=normal(1, 3, 4), b=normal(2, 3, 4)), **BCAST),
    Case("Mul-both", "Mul", ins(a=normal(1, 4), b=normal(3, 1)), **BCAST),
    Case("Mul-first-size1", "Mul", ins(a=normal(1), b=normal(2, 3)), **BCAST),
    Case("Add-first-vector", "Add", ins(a=normal(4), b=normal(3, 4)), **BCAST),
    Case("Div-first-vector", "Div", ins(a=normal(4), b=np.linspace(1.0, 2.0, 12).reshape(3, 4)),
         **BCAST),
]


@pytest.mark.parametrize("case, opset, symbolic", case_params(CASES))
def test_first_operand_broadcast_vjp(case, opset, symbolic):
    grads = run_case(case, opset, symbolic)
    # The first operand's gradient has its own (smaller) shape, not the output's.
    assert np.shape(grads["a"]) == np.shape(case.inputs(np.random.default_rng(20240521))["a"])
