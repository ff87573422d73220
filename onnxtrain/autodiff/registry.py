"""The gradient rule registry and the context a rule works in.

A rule maps the gradients of a node's outputs to the gradients of its inputs
(a vector-Jacobian product).  Rules live next to their registration, one per op:

    @vjp("Sqrt")
    def sqrt_vjp(ctx, dy):
        '''y = sqrt(x)  ->  dx = dy / (2 y)'''
        (y,) = ctx.outputs
        return (ctx.emit.Div(dy, ctx.emit.Mul(ctx.const(2.0, like=y), y)),)

A rule receives one gradient per node output (``None`` where no gradient
flows into that output) and returns one entry per node input (``None`` for
inputs that get no gradient: integer indices, shapes, or inputs whose
gradient nobody asked for, see ``ctx.needs``).  Rules emit nodes only through
``ctx.emit``, which knows the model's opset.

``no_grad(...)`` registers ops whose outputs carry no gradient at all
(Shape, comparisons, ArgMax, Floor, ...).  ``refuse(op, reason)`` registers ops
that are known but not differentiable; using them under a Gradient is an error.
An op without any registration is an error too: never a silent zero.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..emitter import Emitter
from ..errors import TrainingModelError

Dim = int | str | None
Shape = tuple[Dim, ...]


@dataclass(frozen=True)
class Rule:
    """One registration: ``kind`` is 'vjp', 'zero' or 'refused'."""

    op_type: str
    domain: str
    kind: str
    fn: Callable[..., Sequence[str | None]] | None = None
    reason: str = ""
    #: Inputs whose values the outputs do not depend on (CastLike's ``like``):
    #: the rule may return None for them even when they are differentiated.
    nondiff: frozenset[int] = frozenset()


class Registry:
    """Maps (domain, op_type) to a Rule."""

    def __init__(self) -> None:
        self._rules: dict[tuple[str, str], Rule] = {}

    def add(self, rule: Rule) -> None:
        key = (rule.domain, rule.op_type)
        if key in self._rules:
            raise ValueError(f"gradient rule for {rule.op_type!r} registered twice")
        self._rules[key] = rule

    def get(self, domain: str, op_type: str) -> Rule | None:
        if domain == "ai.onnx":
            domain = ""
        return self._rules.get((domain, op_type))

    def rules(self) -> list[Rule]:
        return sorted(self._rules.values(), key=lambda r: (r.domain, r.op_type))


REGISTRY = Registry()


def vjp(
    *op_types: str, domain: str = "", nondiff: Sequence[int] = ()
) -> Callable[[Callable], Callable]:
    """Register the decorated function as the gradient rule of ``op_types``.

    A rule returns None for an input only if that input gets no gradient by
    nature (an integer, a shape) or is listed in ``nondiff`` (the outputs do
    not depend on its values).  The engine refuses any other None for an
    input the differentiated output depends on: never a silent zero."""

    def register(fn: Callable) -> Callable:
        for op in op_types:
            REGISTRY.add(Rule(op, domain, "vjp", fn, nondiff=frozenset(nondiff)))
        return fn

    return register


def no_grad(*op_types: str, domain: str = "") -> None:
    """Register ops whose outputs are piecewise constant or discrete: no gradient flows."""
    for op in op_types:
        REGISTRY.add(Rule(op, domain, "zero"))


def refuse(op_type: str, reason: str, domain: str = "") -> None:
    """Register an op that cannot be differentiated, with the reason shown to users."""
    REGISTRY.add(Rule(op_type, domain, "refused", reason=reason))


class VJPContext:
    """What a rule sees of its node and of the program being built."""

    def __init__(
        self,
        node: onnx.NodeProto,
        emit: Emitter,
        shapes: dict[str, Shape | None],
        needs: Sequence[bool],
        names_in_use: Callable[[str], str],
        active: frozenset[str] | set[str] = frozenset(),
        subgraph_vjp: Callable[..., tuple[list[onnx.NodeProto], list[str]]] | None = None,
    ) -> None:
        self.node = node
        self.emit = emit
        self.shapes = shapes
        self._needs = list(needs)
        self._fresh = names_in_use
        self._active = active
        self._subgraph_vjp = subgraph_vjp
        self._attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        #: Gradients of implicit inputs (outer-scope names read by subgraphs).
        self.implicit_grads: dict[str, list[str]] = {}

    # ------------------------------------------------- control flow support
    @property
    def implicit_inputs(self) -> list[str]:
        """Outer-scope names the node's subgraphs read (If branches, Loop/Scan bodies)."""
        from ..graph import outer_references, subgraphs

        names: set[str] = set()
        for g in subgraphs(self.node):
            names |= outer_references(g)
        return sorted(names)

    def needs_name(self, name: str) -> bool:
        """Whether a gradient is wanted for ``name`` (explicit or implicit input)."""
        return name in self._active

    def accumulate(self, name: str, dx: str) -> None:
        """Contribute ``dx`` to the gradient of an implicit input ``name``."""
        self.implicit_grads.setdefault(name, []).append(dx)

    def vjp_of_graph(
        self,
        nodes: Sequence[onnx.NodeProto],
        outputs: Sequence[str],
        cotangents: Sequence[str | None],
        wrt: Sequence[str],
        types: dict[str, tuple[int, tuple | None]],
    ) -> tuple[list[onnx.NodeProto], list[str]]:
        """Nodes computing sum_k <outputs[k], cotangents[k]> differentiated w.r.t.
        ``wrt``: returns (nodes, gradient names, one per wrt).

        ``nodes`` is a subgraph body (copied, not modified) whose free names
        are typed by ``types`` (name -> (elem_type, shape)); the result
        recomputes that body's forward pass, then its backward pass, and reads
        the cotangents and free names from the enclosing scope."""
        if self._subgraph_vjp is None:
            raise TrainingModelError("subgraph differentiation is not available here")
        return self._subgraph_vjp(self.emit, nodes, outputs, cotangents, wrt, types)

    # ------------------------------------------------------------ the node
    @property
    def opset(self) -> int:
        return self.emit.opset

    @property
    def inputs(self) -> list[str]:
        """Forward input names ('' for an absent optional input)."""
        return list(self.node.input)

    @property
    def outputs(self) -> list[str]:
        """Forward output names ('' for an absent optional output)."""
        return list(self.node.output)

    def input(self, i: int) -> str | None:
        """Input i, or None when absent."""
        return self.node.input[i] if i < len(self.node.input) and self.node.input[i] else None

    def attr(self, name: str, default: Any = None) -> Any:
        """Attribute value (strings decoded), or ``default`` when absent."""
        v = self._attrs.get(name, default)
        if isinstance(v, bytes):
            return v.decode()
        if isinstance(v, list) and v and isinstance(v[0], bytes):
            return [s.decode() for s in v]
        return v

    def needs(self, i: int) -> bool:
        """Whether the gradient of input i is wanted."""
        return i < len(self._needs) and self._needs[i]

    def forward_output(self, i: int) -> str:
        """Make sure the forward node produces its optional output i and return
        its name (e.g. MaxPool's Indices, SoftmaxCrossEntropyLoss's log_prob).

        This adds an output to the forward node rather than recomputing it."""
        out = list(self.node.output)
        while len(out) <= i:
            out.append("")
        if not out[i]:
            out[i] = self._fresh(f"{self.node.name or self.node.op_type}/out{i}")
            del self.node.output[:]
            self.node.output.extend(out)
        return out[i]

    # -------------------------------------------------------------- types
    def dtype(self, name: str) -> int:
        return self.emit.dtype(name)

    def shape(self, name: str) -> Shape | None:
        """Static shape from inference: ints for known dims, strings for symbolic
        ones, None for unknown ones; None when even the rank is unknown."""
        return self.shapes.get(name)

    def rank(self, name: str) -> int | None:
        s = self.shapes.get(name)
        return None if s is None else len(s)

    def require_rank(self, name: str) -> int:
        r = self.rank(name)
        if r is None:
            raise TrainingModelError(
                f"gradient of {self.node.op_type} node {self.node.name!r} needs the rank "
                f"of {name!r}, which shape inference could not determine"
            )
        return r

    # ---------------------------------------------------------- shortcuts
    def const(self, value: Any, like: str | None = None, dtype: Any = None) -> str:
        return self.emit.const(value, dtype=dtype, like=like)

    def zeros_like(self, x: str) -> str:
        return self.emit.zeros_like(x)

    def ones_like(self, x: str) -> str:
        return self.emit.ones_like(x)

    def unbroadcast(self, dx: str, like: str, out: str | None = None) -> str:
        """Sum ``dx`` (shaped like the broadcast result ``out``, default: the
        node's first output) down to the shape of ``like``.

        Static shapes decide where they can; otherwise the axes are computed at
        run time (opset >= 13), so symbolic dimensions are fine."""
        out = out if out is not None else self.outputs[0]
        sx, sy = self.shape(like), self.shape(out)
        if sx is not None and sy is not None and len(sy) >= len(sx):
            lead = len(sy) - len(sx)
            axes: list[int] | None = list(range(lead))
            for i, dxi in enumerate(sx):
                dyi = sy[lead + i]
                if dxi == dyi and dxi is not None:
                    continue  # same static size or same symbol
                if dxi == 1:
                    axes.append(lead + i)
                elif dxi is None or dyi is None or isinstance(dxi, str) or isinstance(dyi, str):
                    axes = None  # cannot tell statically
                    break
                # else: dxi == dyi handled above; different known ints > 1 cannot broadcast
            if axes is not None:
                if not axes:
                    return dx
                if axes == list(range(lead)):
                    # only leading axes go: one reduction that drops them
                    return self.emit.reduce_sum(dx, axes, keepdims=False)
                red = self.emit.reduce_sum(dx, axes, keepdims=True)
                if lead:
                    red = self.emit.squeeze(red, list(range(lead)))
                return red
            if self.emit.opset < 13:
                return self._unbroadcast_by_axis(dx, like, sx, sy)
        return self._unbroadcast_dynamic(dx, like)

    def _unbroadcast_by_axis(self, dx: str, like: str, sx: Shape, sy: Shape) -> str:
        """Before opset 13 (no runtime ReduceSum axes): reduce the axes known to
        be broadcast; for each doubtful axis a, whose size s in x is 1 or the
        full size n, take  Where(s == 1, Expand(sum_a(dx)), dx)  and then keep
        its first s entries along a with a Gather of arange(s), built from
        NonZero(ConstantOfShape(s)) so that it exists from opset 9 on."""
        e = self.emit
        lead = len(sy) - len(sx)
        certain = list(range(lead))
        doubtful = []
        for i, dxi in enumerate(sx):
            dyi = sy[lead + i]
            if dxi == dyi and dxi is not None:
                continue
            if dxi == 1:
                certain.append(lead + i)
            else:
                doubtful.append(i)
        if doubtful and e.opset < 9:  # no Where, ConstantOfShape or NonZero yet
            raise TrainingModelError(
                f"gradient of {self.node.op_type} node {self.node.name!r}: whether {like!r} is "
                f"broadcast along axes {[lead + i for i in doubtful]} is decided at run time, which "
                f"needs opset >= 9, model has {e.opset} (give the input a static shape or upgrade "
                "the model)"
            )
        cur = e.reduce_sum(dx, certain, keepdims=True) if certain else dx
        x_shape = e.Shape(like)
        one = numpy_helper.from_array(np.ones(1, dtype=np.int64))
        for i in doubtful:
            axis = lead + i
            summed = e.Expand(e.reduce_sum(cur, [axis], keepdims=True), e.Shape(cur))
            size = e.slice(x_shape, [i], [i + 1], [0])
            cur = e.Where(e.Equal(size, e.ints([1])), summed, cur)
            arange = e.reshape(e.NonZero(e.op("ConstantOfShape", [size], value=one)), [-1])
            cur = e.Gather(cur, arange, axis=axis)
        return e.Reshape(cur, x_shape)

    def _unbroadcast_dynamic(self, dx: str, like: str) -> str:
        e = self.emit
        if e.opset < 13:
            raise TrainingModelError(
                f"gradient of {self.node.op_type} node {self.node.name!r}: the ranks of "
                f"{like!r} and of the broadcast result are unknown, and opset {e.opset} < 13 "
                "has no ReduceSum over runtime axes"
            )
        sx = e.Shape(like)
        sdx = e.Shape(dx)
        pad = e.Sub(e.Size(sdx), e.Size(sx))
        ones = e.op(
            "ConstantOfShape",
            [e.reshape(pad, [1])],
            value=numpy_helper.from_array(np.ones(1, dtype=np.int64)),
        )
        sx_padded = e.Concat(ones, sx, axis=0)
        # Reduce over every axis where x has size 1: summing a size-1 axis of dx is harmless.
        axes = e.reshape(e.NonZero(e.Equal(sx_padded, e.ints([1]))), [-1])
        red = e.reduce_sum(dx, axes, keepdims=True)
        return e.Reshape(red, sx)
