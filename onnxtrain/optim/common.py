"""What the three optimizer ops share: their signatures, and one helper that
splits a node's variadic inputs and outputs and reads its attributes.

Every optimizer node reads ``[R, T, X1..Xn, G1..Gn, V1..Vn(, H1..Hn)]`` and
writes the new value of each per-tensor state group in the same order, minus
the gradients: ``[X1_new..Xn_new, V1_new..Vn_new(, H1_new..Hn_new)]``.

>>> from onnx import helper
>>> node = helper.make_node("Adagrad", ["R", "T", "X", "G", "H"], ["X2", "H2"],
...                         domain="ai.onnx.preview.training", epsilon=1e-4)
>>> call = split_node(node, SIGNATURES["Adagrad"])
>>> call.inputs["H"], call.outputs["X"], call.attrs["epsilon"] == float(np.float32(1e-4))
(['H'], ['X2'], True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto, helper

from ..errors import TrainingModelError

#: An attribute without a default; the node must set it.
REQUIRED = None


@dataclass(frozen=True)
class Signature:
    """The variadic layout and attributes of one optimizer op."""

    op_type: str
    #: Per-tensor input groups after R and T, in order; "G" is the gradient.
    groups: tuple[str, ...]
    #: Attribute name -> default (a Python value) or REQUIRED.
    attrs: dict[str, Any]

    @property
    def state_groups(self) -> tuple[str, ...]:
        """The groups that get a new value (every group but the gradient)."""
        return tuple(g for g in self.groups if g != "G")


SIGNATURES: dict[str, Signature] = {
    "Adam": Signature(
        "Adam",
        ("X", "G", "V", "H"),
        {
            "alpha": 0.9,
            "beta": 0.999,
            "epsilon": 1e-6,
            "norm_coefficient": 0.0,
            "norm_coefficient_post": 0.0,
        },
    ),
    "Momentum": Signature(
        "Momentum",
        ("X", "G", "V"),
        {"alpha": REQUIRED, "beta": REQUIRED, "mode": REQUIRED, "norm_coefficient": REQUIRED},
    ),
    "Adagrad": Signature(
        "Adagrad",
        ("X", "G", "H"),
        {"decay_factor": 0.0, "epsilon": 1e-6, "norm_coefficient": 0.0},
    ),
}

#: Attributes whose value is a string; every other one is a float.
_STRING_ATTRS = frozenset({"mode"})


@dataclass
class OptimizerCall:
    """One optimizer node, split: R, T, per-group input and output names, attributes."""

    node: onnx.NodeProto
    where: str
    n: int
    r: str
    t: str
    #: Group ("X", "G", "V", "H") -> the n input names of that group.
    inputs: dict[str, list[str]]
    #: State group ("X", "V", "H") -> the n output names ('' where unused).
    outputs: dict[str, list[str]]
    attrs: dict[str, Any]

    def tensor_inputs(self, i: int) -> dict[str, str]:
        """The inputs of the i-th optimized tensor, by group."""
        return {group: names[i] for group, names in self.inputs.items()}

    def tensor_outputs(self, i: int) -> dict[str, str]:
        """The outputs of the i-th optimized tensor, by state group ('' where unused)."""
        return {group: names[i] for group, names in self.outputs.items()}


def describe(node: onnx.NodeProto) -> str:
    """How error messages name a node."""
    label = repr(node.name) if node.name else f"writing {list(node.output)[:3]}"
    return f"{node.op_type} node {label}"


def split_node(node: onnx.NodeProto, sig: Signature) -> OptimizerCall:
    """Split the variadic input and output lists of an optimizer node.

    With k groups, a node optimizing n tensors has 2 + k*n inputs and
    (k - 1)*n outputs.  Raises TrainingModelError on any other count, on an
    empty input name and on bad attributes."""
    where = describe(node)
    k = len(sig.groups)
    ins = list(node.input)
    per_tensor = len(ins) - 2
    if per_tensor <= 0 or per_tensor % k:
        layout = ", ".join(f"{g}1..{g}n" for g in sig.groups)
        raise TrainingModelError(
            f"{where}: expected 2 + {k}*n inputs [R, T, {layout}] for n >= 1 tensors, "
            f"found {len(ins)} inputs"
        )
    n = per_tensor // k
    for pos, name in enumerate(ins):
        if not name:
            raise TrainingModelError(f"{where}: input {pos} is empty; every input is required")
    outs = list(node.output)
    states = sig.state_groups
    if len(outs) != len(states) * n:
        layout = ", ".join(f"{g}{1 if n == 1 else '1..' + str(n)}_new" for g in states)
        raise TrainingModelError(
            f"{where}: its {len(ins)} inputs describe {n} tensor(s), which need "
            f"{len(states) * n} outputs [{layout}] ('' for unused ones), found {len(outs)}"
        )
    inputs = {g: ins[2 + j * n : 2 + (j + 1) * n] for j, g in enumerate(sig.groups)}
    outputs = {g: outs[j * n : (j + 1) * n] for j, g in enumerate(states)}
    return OptimizerCall(
        node=node,
        where=where,
        n=n,
        r=ins[0],
        t=ins[1],
        inputs=inputs,
        outputs=outputs,
        attrs=read_attributes(node, sig, where),
    )


def read_attributes(node: onnx.NodeProto, sig: Signature, where: str) -> dict[str, Any]:
    """The node's attributes as Python values, defaults filled in.

    Float attributes are stored as 32-bit floats in the model and read back
    exactly; a missing one takes the spec's default (as a Python float)."""
    values: dict[str, Any] = {}
    for a in node.attribute:
        if a.name not in sig.attrs:
            raise TrainingModelError(
                f"{where}: unknown attribute {a.name!r}; {sig.op_type} accepts "
                f"{sorted(sig.attrs)}"
            )
        expected = AttributeProto.STRING if a.name in _STRING_ATTRS else AttributeProto.FLOAT
        if a.type != expected:
            raise TrainingModelError(
                f"{where}: attribute {a.name!r} must be a "
                f"{AttributeProto.AttributeType.Name(expected)}, found "
                f"{AttributeProto.AttributeType.Name(a.type)}"
            )
        value = helper.get_attribute_value(a)
        values[a.name] = value.decode() if isinstance(value, bytes) else float(value)
    missing = [name for name, d in sig.attrs.items() if d is REQUIRED and name not in values]
    if missing:
        raise TrainingModelError(
            f"{where}: required attribute(s) {missing} missing; {sig.op_type} has no "
            "defaults for them"
        )
    for name, default in sig.attrs.items():
        values.setdefault(name, default)
    if sig.op_type == "Momentum" and values["mode"] not in ("standard", "nesterov"):
        raise TrainingModelError(
            f"{where}: attribute 'mode' must be 'standard' or 'nesterov', "
            f"found {values['mode']!r}"
        )
    return values


def constant(value: float, dtype: np.dtype) -> np.ndarray:
    """A 0-D array of ``dtype``: arithmetic on constants happens in X's type."""
    return np.asarray(value, dtype=dtype)
