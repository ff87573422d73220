"""Chains of nodes that the reverse pass differentiates as one op: GELU.

Below opset 20, exporters write GELU as a handful of elementwise nodes,
each in its own spelling:

    (x * (Erf(x / sqrt 2) + 1)) * 0.5                           torch.onnx, erf
    (x * 0.5) * (1 + Tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))   GPT-2's "gelu_new"

Node by node, the backward pass reads the chain's inner values (x / sqrt 2,
Erf + 1, the Tanh, x * 0.5), so they stay alive from the forward pass until
the backward pass reaches them: three or four activations of the MLP's
width per layer.  GELU's own rule (``Gelu``, either ``approximate``) reads x
only and recomputes the rest in the backward pass.  With it, the inner
values die inside the forward pass, and onnxruntime fuses the forward
nodes into one where its fusion knows the spelling (torch.onnx's erf form).

``stand_ins`` finds such chains among the nodes a Gradient differentiates
and returns, for each chain's last node, a ``Gelu(x) -> y`` node that stands
for the whole chain in the reverse pass; the forward nodes stay as they
are.  A chain is a *region*: elementwise nodes whose only non-constant input
is x, whose constants are scalars, and whose inner values nothing outside
reads (the Gradient node neither: it reads its leaves and its y).  It is
taken when it computes GELU: evaluated in float64 at points over
[-8, 8], it agrees with the formula to a few units of its constants'
precision.  Anything else (x / 1.414, a scale left over, another
activation) is differentiated node by node, as before.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper

from ..core.graph import DEFAULT_DOMAINS

#: What a region may be made of, evaluated in float64.
_OPS = {
    "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide, "Pow": np.power,
    "Erf": np.vectorize(math.erf), "Tanh": np.tanh,
}
_CORES = ("Erf", "Tanh")
_MAX_NODES = 12  # GELU takes 5 to 9
_PROBES = np.linspace(-8.0, 8.0, 129)


def _gelu(x: np.ndarray, approximate: str) -> np.ndarray:
    if approximate == "tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1.0 + _OPS["Erf"](x / math.sqrt(2.0)))


class _Graph:
    """What the matcher reads: producers, readers, scalar constants, differentiated values."""

    def __init__(self, producer: dict[str, onnx.NodeProto], readers: dict[str, list[onnx.NodeProto]],
                 constants: dict[str, np.ndarray], active: set[str]) -> None:
        self.producer = producer
        self.readers = readers
        self.constants = constants
        self.active = active

    def scalar(self, name: str) -> np.ndarray | None:
        """The value of a one-element constant nothing differentiates."""
        v = self.constants.get(name)
        if v is None or v.size != 1 or v.dtype.kind not in "fiu" or name in self.active:
            return None
        return v.reshape(())

    def elementwise(self, name: str) -> onnx.NodeProto | None:
        """The node writing ``name``, if it is one a region may hold."""
        return _of_region(self.producer.get(name))

    def sole_reader(self, name: str) -> onnx.NodeProto | None:
        """The one node reading ``name``, if it is one a region may hold."""
        rs = self.readers.get(name, [])
        return _of_region(rs[0]) if len(rs) == 1 else None


def _of_region(n: onnx.NodeProto | None) -> onnx.NodeProto | None:
    return n if n is not None and n.op_type in _OPS and n.domain in DEFAULT_DOMAINS else None


def _region(g: _Graph, y: str, x: str) -> list[onnx.NodeProto] | None:
    """The nodes computing ``y`` from ``x`` and scalar constants alone, or None."""
    found: dict[int, onnx.NodeProto] = {}
    stack = [y]
    while stack:
        v = stack.pop()
        if v == x or g.scalar(v) is not None:
            continue
        n = g.elementwise(v)
        if n is None or len(found) >= _MAX_NODES:
            return None
        if id(n) not in found:
            found[id(n)] = n
            stack.extend(n.input)
    inner = [o for n in found.values() for o in n.output if o != y]
    if any(id(r) not in found for o in inner for r in g.readers.get(o, [])):
        return None
    return list(found.values())


def _evaluate(g: _Graph, y: str, x: str, probes: np.ndarray) -> np.ndarray:
    memo: dict[str, np.ndarray] = {x: probes}

    def value(v: str) -> np.ndarray:
        if v not in memo:
            c = g.scalar(v)
            if c is not None:
                memo[v] = np.float64(c)
            else:
                n = g.producer[v]
                memo[v] = _OPS[n.op_type](*(value(i) for i in n.input))
        return memo[v]

    with np.errstate(all="ignore"):
        return value(y)


def _which_gelu(g: _Graph, nodes: list[onnx.NodeProto], y: str, x: str) -> str | None:
    """'none' or 'tanh' when the region computes that GELU, else None."""
    eps = max((np.finfo(c.dtype).eps for n in nodes for i in n.input
               if (c := g.scalar(i)) is not None and c.dtype.kind == "f"), default=np.finfo(np.float32).eps)
    got = _evaluate(g, y, x, _PROBES)
    for approximate in ("none", "tanh"):
        if np.all(np.abs(got - _gelu(_PROBES, approximate)) <= 8 * eps * (1.0 + np.abs(_PROBES))):
            return approximate
    return None


def _candidates(g: _Graph, core: onnx.NodeProto) -> tuple[list[str], list[str]]:
    """(ys, xs) to try for the region around ``core``: the values below it
    along sole readers, farthest first; the non-constant values above it,
    nearest first."""
    ys, v = [], core.output[0]
    while len(ys) < 4 and (r := g.sole_reader(v)) is not None:
        v = r.output[0]
        ys.append(v)
    xs: list[str] = []
    level = [core]
    for _ in range(4):
        names = [i for n in level for i in n.input if i and g.scalar(i) is None and i not in xs]
        xs += list(dict.fromkeys(names))
        level = [p for i in names if (p := g.elementwise(i)) is not None]
    return ys[::-1], xs


def _match(g: _Graph, core: onnx.NodeProto) -> tuple[onnx.NodeProto, list[onnx.NodeProto]] | None:
    """(the stand-in, the region's nodes) of the GELU around ``core``, or None."""
    ys, xs = _candidates(g, core)
    for y in ys:
        for x in xs:
            nodes = _region(g, y, x) if x in g.active else None
            if nodes is None or all(n is not core for n in nodes):
                continue
            kind = _which_gelu(g, nodes, y, x)
            if kind is not None:
                tail = g.producer[y]
                return helper.make_node("Gelu", [x], [y], name=tail.name, approximate=kind), nodes
    return None


def stand_ins(relevant: list[onnx.NodeProto], producer: dict[str, onnx.NodeProto],
              readers: dict[str, list[onnx.NodeProto]], constants: dict[str, np.ndarray],
              active: set[str]) -> dict[int, onnx.NodeProto]:
    """For each GELU chain among ``relevant`` (see the module doc): the id of its
    last node, mapped to a ``Gelu`` node reading x and writing the chain's
    output.  ``producer`` and ``readers`` cover all the graph's nodes, the
    Gradient node included; ``active``: the values that depend on an x."""
    g = _Graph(producer, readers, constants, active)
    out: dict[int, onnx.NodeProto] = {}
    taken: set[int] = set()
    for core in relevant:
        if core.op_type in _CORES and core.domain in DEFAULT_DOMAINS and id(core) not in taken:
            found = _match(g, core)
            if found is not None:
                stand_in, nodes = found
                out[id(g.producer[stand_in.output[0]])] = stand_in
                taken |= {id(n) for n in nodes}
    return out
