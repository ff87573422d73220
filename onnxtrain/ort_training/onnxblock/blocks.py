"""Building blocks: each adds standard ONNX nodes to the current base model.

A block is called with value names and returns the name(s) of what it adds.
``Block`` is the base class of custom blocks: override ``build`` and use
other blocks (or ``self.base``, the model being built) in it.

>>> import onnx
>>> from onnx import helper, TensorProto
>>> from onnxtrain.ort_training.onnxblock import model_accessor
>>> g = helper.make_graph([], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])], [])
>>> with model_accessor.base(helper.make_model(g)) as h:
...     y = Mul()("x", Constant(2.0)())
>>> [n.op_type for n in h.model.graph.node]
['Mul']
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod

import onnx
from onnx import TensorProto, helper

from . import model_accessor as accessor


def fresh(hint: str) -> str:
    """A name not yet used in the model being built (``model_accessor.current``)."""
    return accessor.current().fresh(hint)


class Block(ABC):
    """Base class of all blocks (see the module docstring)."""

    def __init__(self, temp_file_name: str = "temp.onnx") -> None:
        self.base: onnx.ModelProto | None = None

    @abstractmethod
    def build(self, *args, **kwargs):
        """Add nodes on top of the given value names; return the new name(s)."""

    def __call__(self, *args, **kwargs):
        self.base = accessor.current().model
        return self.build(*args, **kwargs)

    # helpers for subclasses
    def _node(self, op_type: str, inputs, hint: str, **attrs) -> str:
        out = fresh(hint)
        self.base.graph.node.append(helper.make_node(op_type, list(inputs), [out],
                                                     name=fresh(op_type), **attrs))
        return out


class _BinaryOp(Block):
    _op = ""

    def build(self, input_name1: str, input_name2: str) -> str:
        return self._node(self._op, [input_name1, input_name2], f"{self._op.lower()}_output")


class Add(_BinaryOp):
    _op = "Add"


class Sub(_BinaryOp):
    _op = "Sub"


class Mul(_BinaryOp):
    _op = "Mul"


class Div(_BinaryOp):
    _op = "Div"


class Pow(Block):
    """x ** exponent (a float constant)."""

    def __init__(self, exponent: float) -> None:
        super().__init__()
        self._exponent = exponent

    def build(self, pow_input_name: str) -> str:
        return self._node("Pow", [pow_input_name, Constant(self._exponent)()], "pow_output")


class _UnaryOp(Block):
    _op = ""

    def __init__(self, **attributes) -> None:
        super().__init__()
        self._attributes = attributes

    def build(self, input_name: str) -> str:
        return self._node(self._op, [input_name], f"{self._op.lower()}_output", **self._attributes)


class ReduceMean(_UnaryOp):
    _op = "ReduceMean"

    def __init__(self, keepdims: bool = True) -> None:
        super().__init__(keepdims=int(keepdims))


class ReduceSum(_UnaryOp):
    _op = "ReduceSum"

    def __init__(self, keepdims: bool = True) -> None:
        super().__init__(keepdims=int(keepdims))


class Sigmoid(_UnaryOp):
    _op = "Sigmoid"


class Log(_UnaryOp):
    _op = "Log"


class Neg(_UnaryOp):
    _op = "Neg"


class Abs(_UnaryOp):
    _op = "Abs"


class Exp(_UnaryOp):
    _op = "Exp"


class Relu(_UnaryOp):
    _op = "Relu"


class Constant(Block):
    """A float32 initializer of shape [1] holding ``value_float``; returns its name."""

    def __init__(self, value_float: float) -> None:
        super().__init__()
        self._value = value_float

    def build(self) -> str:
        name = fresh("initializer")
        self.base.graph.initializer.append(
            helper.make_tensor(name, TensorProto.FLOAT, [1], [float(self._value)]))
        return name


class PassThrough(Block):
    """Returns its inputs unchanged (a loss of None in generate_artifacts)."""

    def build(self, *input_names):
        return input_names[0] if len(input_names) == 1 else tuple(input_names)


class InputLike(Block):
    """A new graph input ``input_name`` with the type of the value ``like``."""

    def __init__(self, like: str) -> None:
        super().__init__()
        self._like = like

    def build(self, input_name: str | None = None) -> str:
        found = value_info(self.base, self._like)
        if found is None:
            raise LookupError(f"Could not find input or output with name {self._like}")
        vi = copy.deepcopy(found)
        vi.name = input_name or fresh("input")
        self.base.graph.input.append(vi)
        return vi.name


def value_info(model: onnx.ModelProto, name: str) -> onnx.ValueInfoProto | None:
    """The declared (or inferred) type of the value ``name``, or None."""
    g = model.graph
    for vi in (*g.input, *g.output, *g.value_info):
        if vi.name == name:
            return vi
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # noqa: BLE001 - a partial model may not infer
        return None
    for vi in (*inferred.output, *inferred.value_info):
        if vi.name == name:
            return vi
    return None


def exists(model: onnx.ModelProto, name: str) -> bool:
    g = model.graph
    return any(v.name == name for v in (*g.input, *g.initializer)) or any(
        name in n.output for n in g.node)
