"""Exporter constants that look like weights: positional tables, attention
masks and batch-broadcast copies.

Exporters fold computations on constants into initializers: RoPE's cos/sin
tables for the traced length (``[1, 1, T, D]``), sinusoidal position tables
(Whisper), an all-zero additive attention mask (ViT's dynamo export), a
class token expanded over the batch.  None of them is a parameter of the
source model, and training one breaks the model (a mask moved off 0 / -inf,
a position table no longer a rotation, each batch row's copy of a token
trained apart).  ``constant_reasons`` finds them, by their uses and values:

- **"positional"**:
  - two tensors of one shape with ``C**2 + S**2 == 1`` everywhere (to 1e-5),
    neither of them constant: a cos/sin pair (RoPE tables, folded or
    ``cos_cache``/``sin_cache``);
  - one tensor ``[..., T, D]`` whose halves or even/odd columns form such a
    pair (a sinusoidal table: ``[sin(t w), cos(t w)]``);
  - a cos/sin cache input of ``GroupQueryAttention`` or ``RotaryEmbedding``
    (com.microsoft or ONNX), whatever its values;
  - the angles of such tables, whatever their values (stored externally in a
    large export): a tensor read, through shape-only ops, by ``Cos`` and
    ``Sin`` nodes and nothing else (torch's dynamo export of a Llama folds
    ``positions x inverse frequencies`` into one);
  - RoPE's inverse frequencies, which a dynamic-shape export keeps to build
    the tables in the graph: ``base**(-2i/d)`` (a geometric sequence from 1
    down) or a tensor named ``...inv_freq``.
- **"mask"**: an operand of an ``Add``/``Sub`` whose result goes (through
  Cast/Reshape/Where) into ``Softmax`` and whose other operand is attention
  scores (computed from a MatMul of two activations, q @ k^T, through
  scaling): a mask of any values, all-zero included; or ``Attention``'s
  ``attn_mask`` input.
- **"broadcast"**: a tensor of rank >= 2 whose slices along axis 0 are all
  equal and not constant: a value expanded over the batch (ViT's class
  token expanded for the traced batch size).

Values are read only for tensors that no MatMul/Gemm/Conv reads as a weight,
that are stored in the model (not external) and have at most 4M elements.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from ..core.graph import DEFAULT_DOMAINS, identity_source

#: (domain, op_type, input index) -> reason, for inputs that are constants whatever their values.
CONSTANT_INPUTS = {
    ("", "Attention", 3): "mask",
    ("", "RotaryEmbedding", 1): "positional",
    ("", "RotaryEmbedding", 2): "positional",
    ("com.microsoft", "RotaryEmbedding", 2): "positional",
    ("com.microsoft", "RotaryEmbedding", 3): "positional",
    ("com.microsoft", "GroupQueryAttention", 7): "positional",
    ("com.microsoft", "GroupQueryAttention", 8): "positional",
}

_PRODUCTS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum"}
_PASS = {"Cast", "Reshape", "Expand", "Unsqueeze", "Squeeze", "Slice", "Identity"}
_MAX_ELEMENTS = 1 << 22
_TOL = 1e-5


def _domain(node: onnx.NodeProto) -> str:
    return "" if node.domain in DEFAULT_DOMAINS else node.domain


def _values(t: onnx.TensorProto) -> np.ndarray | None:
    """The tensor's values in its own type (each test widens what it needs to
    float64: most weights fail a test on their first elements)."""
    size = int(np.prod(t.dims)) if t.dims else 1
    if size > _MAX_ELEMENTS or t.data_location == onnx.TensorProto.EXTERNAL:
        return None
    try:
        return numpy_helper.to_array(t)
    except Exception:  # unreadable storage: judged by its uses alone
        return None


def _wide(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float64, copy=False)


def _on_circle(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = _wide(a), _wide(b)
    return bool(np.all(np.abs(a * a + b * b - 1.0) <= _TOL))


#: Elements ``_unit_circle`` tests before the whole tensors.
_PROBE = 16


def _unit_circle(a: np.ndarray, b: np.ndarray) -> bool:
    """cos/sin of angles that vary: a**2 + b**2 == 1 everywhere, neither constant
    (a norm's ones beside a bias of zeros is no positional table).  The first
    elements are tested alone first: what fails there fails everywhere."""
    if a.shape != b.shape or a.size <= 1 or not _on_circle(a.flat[:_PROBE], b.flat[:_PROBE]):
        return False
    return bool(np.ptp(_wide(a)) > 0) and bool(np.ptp(_wide(b)) > 0) and _on_circle(a, b)


def _sinusoidal(x: np.ndarray) -> bool:
    """Halves or even/odd columns of the last axis are a cos/sin pair."""
    if x.ndim < 2 or x.shape[-1] < 2 or x.shape[-1] % 2 or x.shape[-2] < 2:
        return False
    h = x.shape[-1] // 2
    return _unit_circle(x[..., :h], x[..., h:]) or _unit_circle(x[..., 0::2], x[..., 1::2])


def _frequencies(x: np.ndarray, name: str) -> bool:
    """RoPE's inverse frequencies, kept as a buffer when the exporter computes the
    tables in the graph (dynamic sequence length): ``base**(-2i/d)``, a geometric
    sequence from 1 down, or a tensor named ``inv_freq`` (scaled variants)."""
    if any(d != 1 for d in x.shape[:-1]) or x.size < 2:
        return False
    if name.rsplit(".", 1)[-1] == "inv_freq":
        return True
    v = _wide(x.reshape(-1))
    if abs(v[0] - 1.0) > 1e-6 or not np.all(v > 0):
        return False
    ratio = v[1:] / v[:-1]
    return bool(np.all(ratio < 1.0) and np.all(np.abs(ratio - ratio[0]) <= 1e-4 * ratio[0]))


def _broadcast_copy(x: np.ndarray) -> bool:
    """Every row equal to the first (the second row tested first), which varies."""
    if x.ndim < 2 or x.shape[0] < 2:
        return False
    first = x[0]
    if first.size <= 1 or not np.array_equal(x[1], first):
        return False
    return bool(np.all(x == first)) and bool(np.ptp(_wide(first)) > 0)


def constant_reasons(graph: onnx.GraphProto, names: list[str]) -> dict[str, str]:
    """name -> reason for those of ``names`` (floating initializers of ``graph``)
    that are exporter constants (see the module docstring)."""
    uses = _Uses(graph)
    out, product_weight = _input_reasons(graph, set(names), uses.source)
    for name in names:
        if name not in out and name not in product_weight:
            copies = [name] + [n.output[0] for n in graph.node
                               if n.op_type == "Identity" and uses.source(n.input[0]) == name]
            if any(uses.reaches_score_add(c) for c in copies):
                out[name] = "mask"
            elif uses.end_readers(name) == {"Cos", "Sin"}:
                out[name] = "positional"
    values = {n: v for n in names if n not in out and n not in product_weight
              and (v := _values(uses.inits[n])) is not None}
    for name, x in values.items():
        if _sinusoidal(x) or _frequencies(x, name):
            out[name] = "positional"
        elif _broadcast_copy(x):
            out[name] = "broadcast"
    _cos_sin_pairs(values, out)
    return out


def _input_reasons(graph: onnx.GraphProto, wanted: set[str], source) -> tuple[dict[str, str], set[str]]:
    """The reasons of ``wanted`` initializers read where a constant goes (CONSTANT_INPUTS),
    and those read by a product (MatMul, Gemm, Conv...), which are weights."""
    out: dict[str, str] = {}
    product_weight: set[str] = set()
    for n in graph.node:
        for i, x in enumerate(n.input):
            w = source(x)
            if w not in wanted:
                continue
            reason = CONSTANT_INPUTS.get((_domain(n), n.op_type, i))
            if reason:
                out.setdefault(w, reason)
            if n.op_type in _PRODUCTS and _domain(n) == "":
                product_weight.add(w)
    return out, product_weight


class _Uses:
    """Who reads and who makes each value of a graph, and the walks over them that find masks and angles."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.source = identity_source(graph)
        self.inits = {t.name: t for t in graph.initializer}
        self.readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
        for n in graph.node:
            for i, x in enumerate(n.input):
                if x:
                    self.readers.setdefault(x, []).append((n, i))
        self.producer = {o: n for n in graph.node for o in n.output if o}

    def feeds_softmax(self, value: str, depth: int = 0) -> bool:
        """``value`` goes into a Softmax (through Cast/Reshape/Where...)."""
        for n, _ in self.readers.get(value, ()):
            if n.op_type == "Softmax":
                return True
            if depth < 3 and n.op_type in _PASS | {"Where"} and n.output:
                if self.feeds_softmax(n.output[0], depth + 1):
                    return True
        return False

    def is_scores(self, value: str, depth: int = 0) -> bool:
        """Computed from a product of two activations (attention scores, q @ k^T),
        not from a product with a weight (x @ W, whose bias is a parameter)."""
        n = self.producer.get(value)
        if n is None:
            return False
        if n.op_type == "MatMul":
            return all(self.source(x) not in self.inits for x in n.input)
        if depth < 4 and n.op_type in ("Mul", "Div", "Cast", "Add", "Sub", "Reshape", "Tanh"):
            return any(self.is_scores(x, depth + 1) for x in n.input if x and self.source(x) not in self.inits)
        return False

    def reaches_score_add(self, value: str, depth: int = 0) -> bool:
        """``value`` is added to attention scores on their way to a Softmax: a mask."""
        for n, i in self.readers.get(value, ()):
            if n.op_type in ("Add", "Sub") and len(n.input) == 2:
                other = self.source(n.input[1 - i])
                if self.is_scores(other) and self.feeds_softmax(n.output[0]):
                    return True
            elif depth < 3 and n.op_type in _PASS and i == 0 and n.output:
                if self.reaches_score_add(n.output[0], depth + 1):
                    return True
        return False

    def end_readers(self, value: str, depth: int = 0) -> set[str]:
        """The op types that read ``value``, looking through shape-only ops."""
        ops: set[str] = set()
        for n, _ in self.readers.get(value, ()):
            if n.op_type in _PASS and depth < 4 and n.output:
                ops |= self.end_readers(n.output[0], depth + 1)
            else:
                ops.add(n.op_type)
        return ops


def _cos_sin_pairs(values: dict[str, np.ndarray], out: dict[str, str]) -> None:
    """Mark the cos/sin pairs among ``values`` "positional" in ``out``: only tensors within
    [-1, 1] that vary, grouped by shape, a first-element test before the full one
    (models hold hundreds of norm vectors)."""
    by_shape: dict[tuple, list[str]] = {}
    for n, x in values.items():
        if n not in out and x.size > 1 and float(np.abs(x).max()) <= 1.0 + _TOL and float(np.ptp(x)) > 0:
            by_shape.setdefault(x.shape, []).append(n)
    for group in by_shape.values():
        for k, a in enumerate(group):
            for b in group[k + 1:]:
                first = float(values[a].flat[0]) ** 2 + float(values[b].flat[0]) ** 2
                if abs(first - 1.0) <= _TOL and _unit_circle(values[a], values[b]):
                    out.setdefault(a, "positional")
                    out.setdefault(b, "positional")
