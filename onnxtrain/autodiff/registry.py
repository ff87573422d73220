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

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..core.emitter import Emitter
from ..errors import GradientError, TrainingModelError

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


@functools.lru_cache(maxsize=None)
def _schema_defaults(op_type: str, opset: int, domain: str) -> dict[str, Any]:
    """{attribute: default value} of the schema of ``op_type`` in force at ``opset``."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, domain)
    except onnx.defs.SchemaError:
        return {}
    out = {}
    for name, a in schema.attributes.items():
        if a.default_value.type != onnx.AttributeProto.UNDEFINED:
            out[name] = helper.get_attribute_value(a.default_value)
    return out


def schema_default(node: onnx.NodeProto, opset: int, name: str) -> Any:
    """The schema default of attribute ``name`` of ``node`` (an op of the default
    domain, ``opset`` being that domain's version), or None where the schema
    gives none.  Ops of other domains get None: their opset is not known here."""
    if node.domain not in ("", "ai.onnx"):
        return None
    value = _schema_defaults(node.op_type, opset, "").get(name)
    return list(value) if isinstance(value, list) else value


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
        readers: dict[str, list[onnx.NodeProto]] | None = None,
        may_replace: bool = True,
    ) -> None:
        self.node = node
        #: Whether the rule may replace its forward node (``replace_forward``).
        self.may_replace = may_replace
        self._readers = readers or {}
        self.emit = emit
        self.shapes = shapes
        self._needs = list(needs)
        self._fresh = names_in_use
        self._active = active
        self._subgraph_vjp = subgraph_vjp
        self._attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        #: Gradients of implicit inputs (outer-scope names read by subgraphs).
        self.implicit_grads: dict[str, list[str]] = {}
        #: Set by ``replace_forward``: the emitted names standing for the node's outputs.
        self.replacement: list[str] | None = None

    # ------------------------------------------------- control flow support
    @property
    def implicit_inputs(self) -> list[str]:
        """Outer-scope names the node's subgraphs read (If branches, Loop/Scan bodies)."""
        from ..core.graph import outer_references, subgraphs

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
        """Attribute value (strings decoded).  When the node does not set it:
        ``default`` if given, else the default the ONNX schema of this op at
        the model's opset declares (None where the schema has none)."""
        v = self._attrs.get(name)
        if v is None:
            v = default if default is not None else schema_default(self.node, self.opset, name)
        if isinstance(v, bytes):
            return v.decode()
        if isinstance(v, list) and v and isinstance(v[0], bytes):
            return [s.decode() for s in v]
        return v

    def has_attr(self, name: str) -> bool:
        """Whether the node sets attribute ``name`` itself."""
        return name in self._attrs

    def readers(self, name: str) -> list[onnx.NodeProto]:
        """The forward nodes that read ``name`` (empty where the engine did not say)."""
        return list(self._readers.get(name, ()))

    def selected_by_where(self, name: str) -> bool:
        """Whether a ``Where`` reads ``name`` as a value, directly or through
        Cast/Identity nodes: the pattern of a masked softmax, which replaces
        the rows it masks (NaN rows included) by a constant."""
        seen: set[str] = set()
        stack = [name]
        while stack:
            t = stack.pop()
            if t in seen:
                continue
            seen.add(t)
            for n in self._readers.get(t, ()):
                if n.domain not in ("", "ai.onnx"):
                    continue
                if n.op_type == "Where" and t in n.input[1:]:
                    return True
                if n.op_type in ("Cast", "Identity", "CastLike") and n.input[0] == t:
                    stack.extend(o for o in n.output if o)
        return False

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

    def replace_forward(self, outputs: Sequence[str]) -> None:
        """Replace the forward node by nodes the rule emitted: ``outputs[i]``
        (the same value, computed by those nodes) stands for its output i.

        For a fused op whose backward needs what it computes inside (an
        attention's probabilities): the rule emits that computation once, the
        backward reads it, and the fused kernel no longer runs.  Every output
        the node has is given; the node's output names stay defined (through
        Identity), so its readers and the graph's outputs are unchanged."""
        given = [o for o in self.node.output if o]
        if not self.may_replace:
            raise GradientError(f"{self.node.op_type} rule: its forward node may not be replaced here")
        if len(outputs) < len(self.node.output) or any(o and not r for o, r in zip(self.node.output, outputs)):
            raise GradientError(f"{self.node.op_type} rule: replace_forward needs a name for each of {given}")
        self.replacement = list(outputs)

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

    def unbroadcast(
        self,
        dx: str,
        like: str,
        out: str | None = None,
        *,
        out_dims: Sequence[Dim] | None = None,
        like_dims: Sequence[Dim] | None = None,
        like_shape: str | None = None,
        runtime_from: int = 9,
    ) -> str:
        """Sum ``dx`` (a broadcast of ``like``) down to the shape of ``like``:
        the one broadcasting reduction every rule uses.

        ``dx`` has the dims ``out_dims`` (default: the static shape of ``out``,
        itself defaulting to the node's first output) and ``like`` the dims
        ``like_dims`` (default: its static shape); ``like_shape`` is like's
        runtime shape when ``like`` is not laid out as ``like_dims`` (default:
        Shape(like)).  Axes that ``like`` lacks are summed away and axes where it
        has size 1 are summed with keepdims.  Static dims decide where they
        can (a known size > 1, or a result of size 1, is never broadcast);
        otherwise the axes are found at run time: ReduceSum over runtime axes
        from opset 13, a per-axis Where/Gather from opset 9 (see
        ``_unbroadcast_by_axis``), and a clear refusal before that.
        ``runtime_from`` raises that opset floor: the matrix-product rules keep
        refusing opset 9 (10), as they always have; the per-axis form would
        serve them there too."""
        if out_dims is None:
            out_dims = self.shape(out if out is not None else self.outputs[0])
        if like_dims is None:
            like_dims = self.shape(like)
        if out_dims is None or like_dims is None:
            return self._unbroadcast_dynamic(dx, like, like_shape)
        lead = len(out_dims) - len(like_dims)
        if lead < 0:
            raise TrainingModelError(
                f"gradient of {self.node.op_type} node {self.node.name!r}: {like!r} has more "
                "dimensions than the gradient flowing into it"
            )
        certain: list[int] = list(range(lead))
        doubtful: list[int] = []
        for i, d in enumerate(like_dims):
            o = out_dims[lead + i]
            if d is not None and d == o:
                continue  # same static size or same symbol
            if d == 1:
                certain.append(lead + i)
            elif isinstance(d, int) or o == 1:
                continue  # a known size > 1 is never broadcast; a size-1 result means size 1
            else:
                doubtful.append(i)
        e = self.emit
        if doubtful:
            if e.opset >= 13:
                return self._unbroadcast_dynamic(dx, like, like_shape)
            return self._unbroadcast_by_axis(dx, like, lead, certain, doubtful, like_shape, runtime_from)
        if not certain:
            return dx
        if certain == list(range(lead)):
            # only leading axes go: one reduction that drops them
            return e.reduce_sum(dx, certain, keepdims=False)
        red = e.reduce_sum(dx, certain, keepdims=True)
        if lead:
            red = e.squeeze(red, list(range(lead)))
        return red

    def _unbroadcast_by_axis(
        self,
        dx: str,
        like: str,
        lead: int,
        certain: list[int],
        doubtful: list[int],
        like_shape: str | None,
        runtime_from: int = 9,
    ) -> str:
        """Before opset 13 (no runtime ReduceSum axes): reduce the axes known to
        be broadcast (``certain``); for each doubtful axis a (``doubtful`` counts
        like's axes), whose size s in x is 1 or the full size n, take
        Where(s == 1, Expand(sum_a(dx)), dx)  and then keep its first s entries
        along a with a Gather of arange(s), built from NonZero(ConstantOfShape(s))
        so that it exists from opset 9 on."""
        e = self.emit
        floor = max(9, runtime_from)  # no Where, ConstantOfShape or NonZero before 9
        if doubtful and e.opset < floor:
            raise TrainingModelError(
                f"gradient of {self.node.op_type} node {self.node.name!r}: whether {like!r} is "
                f"broadcast along axes {[lead + i for i in doubtful]} is decided at run time, which "
                f"needs opset >= {floor}; the model has opset {e.opset} < {floor} (give the input a "
                "static shape or upgrade the model)"
            )
        cur = e.reduce_sum(dx, certain, keepdims=True) if certain else dx
        x_shape = like_shape if like_shape is not None else e.Shape(like)
        one = numpy_helper.from_array(np.ones(1, dtype=np.int64))
        for i in doubtful:
            axis = lead + i
            summed = e.Expand(e.reduce_sum(cur, [axis], keepdims=True), e.Shape(cur))
            size = e.slice(x_shape, [i], [i + 1], [0])
            cur = e.Where(e.Equal(size, e.ints([1])), summed, cur)
            arange = e.reshape(e.NonZero(e.op("ConstantOfShape", [size], value=one)), [-1])
            cur = e.Gather(cur, arange, axis=axis)
        return e.Reshape(cur, x_shape)

    def _unbroadcast_dynamic(self, dx: str, like: str, like_shape: str | None = None) -> str:
        """Every axis decided at run time (opset >= 13): pad like's shape with
        leading ones and sum every axis where it has size 1."""
        e = self.emit
        if e.opset < 13:
            raise TrainingModelError(
                f"gradient of {self.node.op_type} node {self.node.name!r}: the ranks of "
                f"{like!r} and of the broadcast result are unknown, and opset {e.opset} < 13 "
                "has no ReduceSum over runtime axes"
            )
        sx = like_shape if like_shape is not None else e.Shape(like)
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
