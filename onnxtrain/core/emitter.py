"""Emit ONNX nodes that are valid in one opset.

The emitter is the only place that knows how an op's signature changed across
opsets (ReduceSum's axes moved from an attribute to an input at opset 13,
Unsqueeze/Squeeze likewise, Split's sizes too, the other reductions at 18, ...).
Gradient rules and optimizer lowerings call it and never build NodeProtos by hand.

Every emitted node gets a fresh output name from the program's ``NameGen``.
The emitter also keeps a table of element types, seeded from shape inference of
the forward graph and extended for each emitted value where the type follows
from the op, so that rules can ask ``emit.dtype(name)``.

>>> from onnxtrain.core.names import NameGen
>>> e = Emitter(opset=17, names=NameGen(["x"]), dtypes={"x": 1})
>>> y = e.reduce_sum("x", axes=[0], keepdims=False)
>>> [n.op_type for n in e.nodes]
['Constant', 'ReduceSum']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import TrainingModelError
from .names import NameGen

FLOAT_TYPES = frozenset(
    {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}
)

# Ops whose output element type differs from their first input's.
_FIXED_OUTPUT_TYPE = {
    "Shape": TensorProto.INT64,
    "Size": TensorProto.INT64,
    "ArgMax": TensorProto.INT64,
    "ArgMin": TensorProto.INT64,
    "NonZero": TensorProto.INT64,
    "Equal": TensorProto.BOOL,
    "Less": TensorProto.BOOL,
    "LessOrEqual": TensorProto.BOOL,
    "Greater": TensorProto.BOOL,
    "GreaterOrEqual": TensorProto.BOOL,
    "Not": TensorProto.BOOL,
    "And": TensorProto.BOOL,
    "Or": TensorProto.BOOL,
    "Xor": TensorProto.BOOL,
    "IsNaN": TensorProto.BOOL,
    "IsInf": TensorProto.BOOL,
}


def np_dtype(elem_type: int) -> np.dtype:
    """The numpy dtype of an ONNX element type."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))


def elem_type(dtype: Any) -> int:
    """The ONNX element type of a numpy dtype."""
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


class Emitter:
    """Appends nodes for one opset of the default domain.

    ``emit.Op(a, b, attr=...)`` emits any op by name and returns its output name;
    ``outputs=k`` asks for k outputs (returned as a list).  The helper methods
    (``reduce_sum``, ``unsqueeze``, ``const`` ...) pick the right signature for
    ``self.opset``.
    """

    def __init__(
        self,
        opset: int,
        names: NameGen,
        dtypes: dict[str, int] | None = None,
        hint: str = "t",
        constants: dict[str, np.ndarray] | None = None,
    ) -> None:
        self.opset = opset
        #: Values known at build time (Constant outputs, small initializers).
        self.constants: dict[str, np.ndarray] = dict(constants or {})
        self.names = names
        self.dtypes: dict[str, int] = dict(dtypes or {})
        self.nodes: list[onnx.NodeProto] = []
        self.hint = hint
        #: Sequence-valued names (gradients of sequences) -> element type.
        self.sequence_types: dict[str, int] = {}
        #: Optional-valued names (gradients of optionals) -> element type.
        self.optional_types: dict[str, int] = {}
        #: What rules emitted once for every node that asks the same, by a key of
        #: their own (an attention mask all layers of a decoder share).
        self.memo: dict[tuple, Any] = {}

    # ------------------------------------------------------------------ core
    def op(
        self,
        op_type: str,
        inputs: Sequence[str | None],
        outputs: int | Sequence[str] = 1,
        domain: str = "",
        **attrs: Any,
    ) -> Any:
        """Emit one node. Missing optional inputs are given as '' or None."""
        ins = ["" if i is None else i for i in inputs]
        while ins and ins[-1] == "":
            ins.pop()
        if op_type == "Where" and self.opset < 9 and isinstance(outputs, int) and outputs == 1:
            return self._where_before_9(*ins)
        if isinstance(outputs, int):
            outs = [self.names.fresh(f"{self.hint}/{op_type}") for _ in range(outputs)]
            single = outputs == 1
        else:
            outs = list(outputs)
            single = False
        attrs = {k: v for k, v in attrs.items() if v is not None}
        node = helper.make_node(
            op_type,
            ins,
            outs,
            name=self.names.fresh(f"{self.hint}/{op_type}_node"),
            domain=domain,
            **attrs,
        )
        self.nodes.append(node)
        self._propagate_dtype(op_type, ins, outs, attrs)
        return outs[0] if single else outs

    def _where_before_9(self, cond: str, a: str, b: str) -> str:
        """Where(c, a, b) = a * c + b * (1 - c) with c cast to a's type (Where
        came in opset 9).  Unlike Where, an inf or NaN in the branch not
        taken leaks into the result; old-opset models accept that."""
        et = self.dtypes.get(a) or self.dtypes.get(b)
        if et is None:
            raise TrainingModelError(
                f"Where before opset 9 needs the element type of {a!r} or {b!r}"
            )
        c = self.Cast(cond, to=et)
        one = self.const(1.0, dtype=et)
        return self.Add(self.Mul(a, c), self.Mul(b, self.Sub(one, c)))

    def __getattr__(self, op_type: str) -> Any:
        if not op_type[:1].isupper():
            raise AttributeError(op_type)

        def emit(*inputs: str | None, outputs: int = 1, **attrs: Any) -> Any:
            return self.op(op_type, inputs, outputs=outputs, **attrs)

        return emit

    def _propagate_dtype(
        self, op_type: str, ins: list[str], outs: list[str], attrs: dict[str, Any]
    ) -> None:
        if op_type in _FIXED_OUTPUT_TYPE:
            t = _FIXED_OUTPUT_TYPE[op_type]
        elif op_type == "Cast":
            t = int(attrs["to"])
        elif op_type == "CastLike":
            t = self.dtypes.get(ins[1])
        elif op_type in ("Constant", "ConstantOfShape"):
            value = attrs.get("value")
            t = value.data_type if value is not None else TensorProto.FLOAT
        elif op_type == "Where":
            t = self.dtypes.get(ins[1])
        elif op_type in ("MaxPool",) and len(outs) > 1:
            if ins and ins[0] in self.dtypes:
                self.dtypes[outs[0]] = self.dtypes[ins[0]]
            self.dtypes[outs[1]] = TensorProto.INT64
            return
        else:
            t = self.dtypes.get(ins[0]) if ins and ins[0] else None
        if t is not None:
            for o in outs:
                self.dtypes.setdefault(o, t)

    def dtype(self, name: str) -> int:
        """Element type of ``name``; raises if nothing is known about it."""
        try:
            return self.dtypes[name]
        except KeyError:
            raise TrainingModelError(
                f"cannot determine the element type of tensor {name!r}"
            ) from None

    # ------------------------------------------------------------ constants
    def const(self, value: Any, dtype: Any = None, like: str | None = None) -> str:
        """A Constant holding ``value`` with ``dtype`` (an ONNX or numpy type) or
        the element type of the tensor ``like``."""
        if like is not None:
            et = self.dtype(like)
        elif dtype is None:
            et = elem_type(np.asarray(value).dtype)
        elif isinstance(dtype, int):
            et = dtype
        else:
            et = elem_type(dtype)
        arr = np.asarray(value, dtype=np_dtype(et))
        tensor = numpy_helper.from_array(arr, name=self.names.fresh(f"{self.hint}/c"))
        out = self.op("Constant", [], value=tensor)
        self.constants[out] = arr
        return out

    def ints(self, values: Sequence[int]) -> str:
        """A 1-D int64 Constant."""
        return self.const(np.asarray(list(values), dtype=np.int64))

    def scalar_int(self, value: int) -> str:
        """A 0-D int64 Constant."""
        return self.const(np.asarray(value, dtype=np.int64))

    def fill_like(self, x: str, value: float, dtype: int | None = None) -> str:
        """A tensor of x's shape filled with ``value`` (x's element type by default)."""
        if dtype is None and x not in self.dtypes and self.opset >= 15:
            # Type unknown at build time: make float ones, then take x's type at run time.
            return self.CastLike(self.fill_like(x, value, TensorProto.FLOAT), x)
        et = self.dtype(x) if dtype is None else dtype
        if self.opset >= 9:
            fill = numpy_helper.from_array(np.asarray([value], dtype=np_dtype(et)))
            return self.op("ConstantOfShape", [self.Shape(x)], value=fill)
        if dtype is not None and dtype != self.dtype(x):
            base = self.Cast(x, to=dtype)
        else:
            base = x
        # Opsets 7-8 lack ConstantOfShape: broadcast a scalar through Mul by zero.
        zero = self.Mul(base, self.const(0.0, dtype=et))
        return self.Add(zero, self.const(value, dtype=et)) if value else zero

    def zeros_like(self, x: str, dtype: int | None = None) -> str:
        return self.fill_like(x, 0.0, dtype)

    def ones_like(self, x: str, dtype: int | None = None) -> str:
        return self.fill_like(x, 1.0, dtype)

    def cast_to(self, x: str, et: int) -> str:
        """Cast unless x already has element type ``et``."""
        if self.dtypes.get(x) == et:
            return x
        return self.Cast(x, to=et)

    # ------------------------------------------------------------ reductions
    def reduce(
        self,
        op_type: str,
        x: str,
        axes: Sequence[int] | str | None,
        keepdims: bool = True,
    ) -> str:
        """Reduce* over ``axes``: a list of ints, a runtime int64 tensor name, or
        None for every axis.  An empty list reduces nothing (returns x)."""
        if axes is not None and not isinstance(axes, str) and len(axes) == 0:
            return x
        axes_as_input = self.opset >= (13 if op_type == "ReduceSum" else 18)
        kd = 1 if keepdims else 0
        if axes is None:
            return self.op(op_type, [x], keepdims=kd)
        if isinstance(axes, str):
            if not axes_as_input:
                raise TrainingModelError(
                    f"{op_type} over runtime axes needs opset >= "
                    f"{13 if op_type == 'ReduceSum' else 18}, model has {self.opset}"
                )
            return self.op(op_type, [x, axes], keepdims=kd, noop_with_empty_axes=1)
        if axes_as_input:
            return self.op(op_type, [x, self.ints(axes)], keepdims=kd)
        return self.op(op_type, [x], axes=list(axes), keepdims=kd)

    def reduce_sum(self, x: str, axes: Sequence[int] | str | None, keepdims: bool = True) -> str:
        return self.reduce("ReduceSum", x, axes, keepdims)

    def reduce_mean(self, x: str, axes: Sequence[int] | str | None, keepdims: bool = True) -> str:
        return self.reduce("ReduceMean", x, axes, keepdims)

    # ---------------------------------------------------------------- shapes
    def unsqueeze(self, x: str, axes: Sequence[int]) -> str:
        if self.opset >= 13:
            return self.Unsqueeze(x, self.ints(axes))
        return self.Unsqueeze(x, axes=list(axes))

    def squeeze(self, x: str, axes: Sequence[int]) -> str:
        if self.opset >= 13:
            return self.Squeeze(x, self.ints(axes))
        return self.Squeeze(x, axes=list(axes))

    def slice(
        self,
        x: str,
        starts: Sequence[int] | str,
        ends: Sequence[int] | str,
        axes: Sequence[int] | None = None,
        steps: Sequence[int] | None = None,
    ) -> str:
        """Slice with static or runtime starts/ends (runtime needs opset >= 10)."""
        if self.opset >= 10:
            s = starts if isinstance(starts, str) else self.ints(starts)
            e = ends if isinstance(ends, str) else self.ints(ends)
            a = None if axes is None else self.ints(axes)
            st = None if steps is None else self.ints(steps)
            return self.Slice(x, s, e, a, st)
        if isinstance(starts, str) or isinstance(ends, str) or steps is not None:
            raise TrainingModelError(
                f"Slice with runtime bounds or steps needs opset >= 10, model has {self.opset}"
            )
        return self.Slice(
            x, starts=list(starts), ends=list(ends), axes=None if axes is None else list(axes)
        )

    def shape_of(self, x: str, start: int = 0, end: int | None = None) -> str:
        """Shape(x)[start:end] as a 1-D int64 tensor."""
        if start == 0 and end is None:
            return self.Shape(x)
        if self.opset >= 15:
            return self.Shape(x, start=start, end=end)
        big = 2**62
        return self.slice(self.Shape(x), [start], [big if end is None else end], [0])

    def dim(self, x: str, axis: int) -> str:
        """Shape(x)[axis] as a 1-D int64 tensor of length 1 (axis may be negative)."""
        end = None if axis == -1 else axis + 1
        return self.shape_of(x, axis, end)

    def sign(self, x: str) -> str:
        """sign(x) in x's type: Sign from opset 9, before (x > 0) - (x < 0)."""
        if self.opset >= 9:
            return self.Sign(x)
        et = self.dtype(x)
        zero = self.const(0.0, dtype=et)
        return self.Sub(self.Cast(self.Greater(x, zero), to=et), self.Cast(self.Less(x, zero), to=et))

    def expand_to(self, v: str, x: str) -> str:
        """v broadcast to x's shape; v has x's rank, each dim 1 or x's.

        Expand from opset 8; at opset 7, Tile by Shape(x) / Shape(v) (a 0 in
        Shape(v) divides by 1 instead: 0 repeats of an empty axis)."""
        if self.opset >= 8:
            return self.Expand(v, self.Shape(x))
        sv = self.Shape(v)
        zero = self.Cast(self.Equal(sv, self.ints([0])), to=TensorProto.INT64)
        return self.Tile(v, self.Div(self.Shape(x), self.Add(sv, zero)))

    def concat(self, items: Sequence[str], axis: int = 0) -> str:
        if len(items) == 1:
            return items[0]
        return self.Concat(*items, axis=axis)

    def reshape(self, x: str, shape: Sequence[int] | str) -> str:
        s = shape if isinstance(shape, str) else self.ints(shape)
        return self.Reshape(x, s)

    def split(self, x: str, sizes: Sequence[int] | str, axis: int = 0,
              outputs: Sequence[str] | None = None) -> list[str]:
        """Split into pieces of the given sizes (a list, or a runtime int64 tensor
        name with a static number of pieces given by ``len`` of a list), named
        ``outputs`` when given."""
        if isinstance(sizes, str):
            raise TrainingModelError("split needs a static number of pieces")
        outs = list(outputs) if outputs is not None else len(sizes)
        if self.opset >= 13:
            return self.op("Split", [x, self.ints(sizes)], outputs=outs, axis=axis)
        return self.op("Split", [x], outputs=outs, axis=axis, split=list(sizes))

    def arange(self, n: str) -> str:
        """[0, 1, ..., n - 1] (int64) for a runtime length n given as a 1-element tensor.

        Range exists from opset 11; before it, the positions of the nonzeros of a
        tensor of n ones are the same numbers."""
        if self.opset >= 11:
            return self.Range(self.scalar_int(0), self.reshape(n, []), self.scalar_int(1))
        ones = self.op("ConstantOfShape", [n], value=numpy_helper.from_array(np.ones(1, np.int64)))
        return self.reshape(self.NonZero(ones), [-1])

    def slice_axis(self, x: str, start: str, end: str, axis: int) -> str:
        """x[start:end] along ``axis`` with runtime bounds (1-element int64 tensors).

        Slice takes runtime bounds from opset 10; before, Gather the positions."""
        if self.opset >= 10:
            return self.Slice(x, start, end, self.ints([axis]))
        return self.Gather(x, self.Add(self.arange(self.Sub(end, start)), start), axis=axis)

    def reshape_to(self, t: str, shape: str) -> str:
        """Reshape ``t`` to the literal runtime shape ``shape`` (a Shape() of some tensor).

        From opset 14 with allowzero=1: a 0 in ``shape`` is a zero-sized dim, never
        'copy this dim of t' (before 14, Reshape has only the copy reading)."""
        if self.opset >= 14:
            return self.Reshape(t, shape, allowzero=1)
        return self.Reshape(t, shape)

    def float_equal(self, a: str, b: str) -> str:
        """Boolean a == b for float tensors, valid in every opset.

        Equal accepts floats only from opset 11; before, a == b is not(a < b or a > b)."""
        if self.opset >= 11:
            return self.Equal(a, b)
        return self.Not(self.Or(self.Less(a, b), self.Greater(a, b)))

    def dft(self, x: str, axis: int | str, inverse: bool = False, onesided: bool = False) -> str:
        """DFT of x along ``axis`` (a static int, or a runtime 1-element int64
        tensor) over its own length: the axis is an attribute at opset 17, an
        input (possibly a runtime value) from 20."""
        flags = {"inverse": 1 if inverse else None, "onesided": 1 if onesided else None}
        if self.opset >= 20:
            a = self.scalar_int(axis) if isinstance(axis, int) else self.reshape(axis, [])
            return self.DFT(x, "", a, **flags)
        return self.DFT(x, axis=axis, **flags)

    def split_equal(self, x: str, parts: int, axis: int = 0) -> list[str]:
        """Split into ``parts`` equal pieces (Split-18 wants num_outputs, earlier
        ones split evenly by their output count)."""
        if parts == 1:
            return [x]
        extra = {"num_outputs": parts} if self.opset >= 18 else {}
        return self.op("Split", [x], outputs=parts, axis=axis, **extra)

    def scatter_elements(self, data: str, indices: str, updates: str, axis: int = 0) -> str:
        """ScatterElements (Scatter before opset 11; same semantics, no reduction)."""
        op = "ScatterElements" if self.opset >= 11 else "Scatter"
        return self.op(op, [data, indices, updates], axis=axis)

    def gemm(self, a: str, b: str, c: str | None = None, **attrs: Any) -> str:
        """Gemm with an optional C: before opset 11 C is required, so a zero
        C with beta=0 stands in for an absent one."""
        if c is None and self.opset < 11:
            c = self.const(0.0, like=a)
            attrs["beta"] = 0.0
        return self.Gemm(a, b, c, **attrs)

    def clip(self, x: str, lo: float, hi: float) -> str:
        """min(max(x, lo), hi) with constant bounds: Clip with bound inputs from
        opset 11; before, Max/Min (Clip-6 has float-only kernels in onnxruntime,
        Max/Min run every float type)."""
        lo_t, hi_t = self.const(lo, like=x), self.const(hi, like=x)
        if self.opset >= 11:
            return self.Clip(x, lo_t, hi_t)
        return self.Min(self.Max(x, lo_t), hi_t)

    def sum_all(self, items: Sequence[str]) -> str:
        """Add up gradient contributions of equal shape."""
        if len(items) == 1:
            return items[0]
        if items[0] in self.sequence_types:
            et = self.sequence_types[items[0]]
            total = items[0]
            for item in items[1:]:
                total = self.sequence_map(
                    [total, item], [et, et], lambda b, x, y: [b.Add(x, y)], [et]
                )[0]
            return total
        if items[0] in self.optional_types:
            et = self.optional_types[items[0]]
            total = self.sum_all([self.OptionalGetElement(i) for i in items])
            out = self.op("Optional", [total])
            self.optional_types[out] = et
            return out
        if len(items) == 2:
            return self.Add(items[0], items[1])
        return self.Sum(*items)

    # ------------------------------------------------------------ sequences
    def sequence_map(
        self,
        seqs: Sequence[str],
        elem_types: Sequence[int],
        body: Any,
        out_types: Sequence[int],
    ) -> list[str]:
        """SequenceMap (opset >= 17) over the sequences ``seqs`` (elements of
        ``elem_types``): ``body(emitter, *element names)`` emits the body and
        returns its outputs, one per ``out_types``.  Returns the output
        sequences, which are recorded as sequence-valued."""
        if self.opset < 17:
            raise TrainingModelError(
                f"gradients of sequences need SequenceMap (opset >= 17); the model has opset {self.opset}"
            )
        sub = Emitter(self.opset, self.names, hint=f"{self.hint}/map")
        ins = [self.names.fresh(f"{self.hint}/map_in") for _ in seqs]
        for name, et in zip(ins, elem_types):
            sub.dtypes[name] = et
        outs = list(body(sub, *ins))
        graph_outs = []
        for o, et in zip(outs, out_types):
            if o in ins:  # a body output must be produced by a node
                o = sub.Identity(o)
            graph_outs.append(helper.make_tensor_value_info(o, et, None))
        graph = helper.make_graph(
            sub.nodes,
            self.names.fresh(f"{self.hint}/map_body"),
            [helper.make_tensor_value_info(n, et, None) for n, et in zip(ins, elem_types)],
            graph_outs,
        )
        results = [self.names.fresh(f"{self.hint}/SequenceMap") for _ in out_types]
        self.op("SequenceMap", list(seqs), outputs=results, body=graph)
        for r, et in zip(results, out_types):
            self.sequence_types[r] = et
        return results

    def zeros_like_sequence(self, seq: str, et: int) -> str:
        """A sequence of zero tensors shaped like the elements of ``seq``."""
        fill = numpy_helper.from_array(np.zeros(1, dtype=np_dtype(et)))
        return self.sequence_map(
            [seq], [et], lambda b, x: [b.op("ConstantOfShape", [b.Shape(x)], value=fill)], [et]
        )[0]
