"""Small graph passes over GraphProtos: dependencies, topological order, pruning,
type and shape inference.  Each function has one job."""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import TrainingModelError
from . import diskcache
from .fingerprint import code_digest, module_digest, onnx_build, standard_domains
from .walk import subgraphs

PREVIEW_DOMAIN = "ai.onnx.preview.training"
DEFAULT_DOMAINS = ("", "ai.onnx")


def graph_names(graph: onnx.GraphProto) -> set[str]:
    """Every value and node name of a graph and of its subgraphs: inputs,
    outputs, initializers (dense and sparse), value_info, node inputs, outputs
    and names.  Seed a ``NameGen`` with it (``NameGen.from_graph``) so that
    new names collide with none of them."""
    names: set[str] = set()
    stack = [graph]
    while stack:
        g = stack.pop()
        names.update(v.name for v in g.input)
        names.update(v.name for v in g.output)
        names.update(v.name for v in g.value_info)
        names.update(t.name for t in g.initializer)
        names.update(t.values.name for t in g.sparse_initializer)
        for n in g.node:
            names.update(n.input)
            names.update(n.output)
            names.add(n.name)
            stack.extend(subgraphs(n))
    names.discard("")
    return names


def identity_source(graph: onnx.GraphProto) -> Callable[[str], str]:
    """name -> the tensor it copies through a chain of Identity nodes (itself if none)."""
    identity_of = {
        n.output[0]: n.input[0]
        for n in graph.node
        if n.op_type == "Identity" and n.domain in DEFAULT_DOMAINS and n.input and n.output
    }

    def source(name: str) -> str:
        seen = set()
        while name in identity_of and name not in seen:
            seen.add(name)
            name = identity_of[name]
        return name

    return source


def outer_references(graph: onnx.GraphProto) -> set[str]:
    """Names a subgraph reads from enclosing scopes."""
    defined = {i.name for i in graph.input}
    defined |= {t.name for t in graph.initializer}
    defined |= {t.values.name for t in graph.sparse_initializer}
    used: set[str] = set()
    for node in graph.node:
        for name in node_inputs(node):
            if name not in defined:
                used.add(name)
        defined.update(o for o in node.output if o)
    used |= {o.name for o in graph.output if o.name not in defined}
    return used


def node_inputs(node: onnx.NodeProto) -> list[str]:
    """Every tensor a node reads: its inputs, the outer-scope names its subgraphs
    read, and, for a Gradient node, its y (it differentiates the graph up to y)."""
    names = [i for i in node.input if i]
    for g in subgraphs(node):
        names.extend(sorted(outer_references(g)))
    if node.op_type == "Gradient" and node.domain == PREVIEW_DOMAIN:
        for a in node.attribute:
            if a.name == "y":
                names.append(a.s.decode())
    return names


def read_counts(nodes: Sequence[onnx.NodeProto], graph_outputs: Iterable[str]) -> dict[str, int]:
    """How many times each tensor is read: by ``nodes`` (``node_inputs``) and
    as a graph output."""
    counts: dict[str, int] = {}
    for n in nodes:
        for i in node_inputs(n):
            counts[i] = counts.get(i, 0) + 1
    for o in graph_outputs:
        counts[o] = counts.get(o, 0) + 1
    return counts


def toposort(
    nodes: Sequence[onnx.NodeProto], available: Iterable[str], where: str = "graph"
) -> list[onnx.NodeProto]:
    """Stable topological order (Kahn).  Raises on cycles and undefined inputs."""
    producer: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for o in n.output:
            if o:
                producer[o] = i
    avail = set(available)
    deps: list[set[int]] = []
    users: list[list[int]] = [[] for _ in nodes]
    for i, n in enumerate(nodes):
        d: set[int] = set()
        for name in node_inputs(n):
            if name in producer:
                if producer[name] != i:
                    d.add(producer[name])
            elif name not in avail:
                raise TrainingModelError(
                    f"{where}: node {n.name or n.op_type!r} ({n.op_type}) reads {name!r}, "
                    "which no node, input or initializer defines"
                )
        deps.append(d)
        for j in d:
            users[j].append(i)
    ready = [i for i, d in enumerate(deps) if not d]
    heapq.heapify(ready)
    order: list[int] = []
    remaining = [len(d) for d in deps]
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for u in users[i]:
            remaining[u] -= 1
            if remaining[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(nodes):
        stuck = [nodes[i].name or nodes[i].op_type for i in range(len(nodes)) if remaining[i]]
        raise TrainingModelError(f"{where}: the nodes form a cycle (involving {stuck[:5]})")
    return [nodes[i] for i in order]


def prune(nodes: Sequence[onnx.NodeProto], outputs: Iterable[str]) -> list[onnx.NodeProto]:
    """Drop nodes that no requested output depends on (keeps order)."""
    producer = {o: n for n in nodes for o in n.output if o}
    live: set[int] = set()
    stack = [producer[o] for o in outputs if o in producer]
    while stack:
        n = stack.pop()
        if id(n) in live:
            continue
        live.add(id(n))
        for name in node_inputs(n):
            p = producer.get(name)
            if p is not None and id(p) not in live:
                stack.append(p)
    return [n for n in nodes if id(n) in live]


def upstream_values(producer: Mapping[str, onnx.NodeProto], outputs: Iterable[str]) -> set[str]:
    """``outputs`` and every value they are computed from (``producer``: value ->
    the node that makes it; ``node_inputs`` of each node on the way)."""
    seen: set[str] = set()
    stack = list(outputs)
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        n = producer.get(v)
        if n is not None:
            stack.extend(node_inputs(n))
    return seen


def keep_outputs(model: onnx.ModelProto, outputs: Sequence[str], where: str) -> None:
    """Cut ``model``'s main graph (in place) to ``outputs``, values it computes
    or takes in: the nodes they need, the inputs those read (an input nothing
    needs any more, a label, goes), the requested outputs typed as the graph
    declares them (else as shape inference finds them).  Initializers stay
    (an unread one is for the caller to drop)."""
    if isinstance(outputs, str) or not outputs:
        raise ValueError(f"{where}: outputs must be a non-empty list of value names, got {outputs!r}")
    graph = model.graph
    values = {o for n in graph.node for o in n.output if o} | {i.name for i in graph.input} | {
        t.name for t in graph.initializer}
    unknown = [o for o in outputs if o not in values]
    if unknown:
        raise ValueError(f"{where}: {unknown[0]!r} is not a value of the model's main graph "
                         f"(its outputs: {[o.name for o in graph.output]})")
    nodes = prune(list(graph.node), outputs)
    needed = set(outputs) | {i for n in nodes for i in node_inputs(n)}
    declared = {v.name: v for v in (*graph.value_info, *graph.input, *graph.output)}
    if any(not declared.get(o, onnx.ValueInfoProto()).type.HasField("tensor_type") for o in outputs):
        inferred = onnx.shape_inference.infer_shapes(model).graph
        declared = {v.name: v for v in (*inferred.value_info, *graph.input, *graph.output, *graph.value_info)}
    kept_outputs = []
    for name in outputs:
        vi = onnx.ValueInfoProto()
        if name in declared:
            vi.CopyFrom(declared[name])
        vi.name = name
        kept_outputs.append(vi)
    inputs = [i for i in graph.input if i.name in needed]
    value_info = [v for v in graph.value_info if v.name in needed and v.name not in outputs]
    for field, kept in (("node", nodes), ("input", inputs), ("output", kept_outputs), ("value_info", value_info)):
        kept = [_copy(x) for x in kept]  # (clearing the field would take the messages with it)
        graph.ClearField(field)
        getattr(graph, field).extend(kept)


def _copy(message):
    out = type(message)()
    out.CopyFrom(message)
    return out


def shape_of_type(tp: onnx.TypeProto) -> tuple | None:
    if not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return None
    dims = []
    for d in tp.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param") and d.dim_param:
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return tuple(dims)


def infer_types(
    graph: onnx.GraphProto,
    opset_imports: Sequence[onnx.OperatorSetIdProto],
    ir_version: int = 8,
    functions: Sequence[onnx.FunctionProto] = (),
) -> tuple[dict[str, int], dict[str, tuple | None]]:
    """Element types and static shapes of every value shape inference can reach.

    Large initializers and Constant nodes are replaced by their type before
    inference, so this costs time proportional to the node count, not to the
    weights."""
    model = _inference_model(graph, opset_imports, ir_version, functions)
    data = model.SerializeToString()
    # The answer is a function of these bytes and of what the steps below
    # read besides them: every initializer's type and dims, and the values
    # of the small ones (``constant_values``).  Memoized on disk (``_types_key``).
    key = _types_key(model, data, _initializer_facts(graph))
    if key is not None:
        known_types = _stored_types(key)
        if known_types is not None:
            return known_types
    dtypes, shapes = _infer_with_seeds(model, data)
    for t in graph.initializer:
        dtypes[t.name] = t.data_type
        shapes[t.name] = tuple(int(d) for d in t.dims)
    for node in graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    dtypes[node.output[0]] = a.t.data_type
                    shapes[node.output[0]] = tuple(int(d) for d in a.t.dims)
    _propagate_ranks(graph.node, shapes, dtypes, graph)
    if key is not None:
        _store_types(key, dtypes, shapes)
    return dtypes, shapes


def _inference_model(
    graph: onnx.GraphProto,
    opset_imports: Sequence[onnx.OperatorSetIdProto],
    ir_version: int,
    functions: Sequence[onnx.FunctionProto],
) -> onnx.ModelProto:
    """The model shape inference runs on: ``graph`` with its weights and large Constants as typed inputs."""
    model = onnx.ModelProto()  # built in place: the graph is copied once
    g = model.graph
    g.name = graph.name or "g"
    known = {v.name for v in graph.input}
    nodes = list(graph.node)
    big = [i for i, n in enumerate(nodes) if n.op_type == "Constant" and _large_constant(n)]
    stand_ins = []
    if big:
        # Only their type matters (values reach inference through 1-D integer
        # tensors alone, the rule for initializers below): typed inputs instead.
        for i in reversed(big):
            n = nodes[i]
            t = n.attribute[0].t
            if n.output[0] not in known:
                del nodes[i]
                stand_ins.append(helper.make_tensor_value_info(n.output[0], t.data_type, list(t.dims)))
                known.add(n.output[0])
    g.node.extend(nodes)
    g.input.extend(graph.input)
    g.input.extend(reversed(stand_ins))
    g.output.extend(graph.output)
    g.value_info.extend(graph.value_info)
    for t in graph.initializer:
        if t.data_type in (TensorProto.INT64, TensorProto.INT32) and len(t.dims) <= 1:
            g.initializer.append(t)  # small shape-like constants help inference
        if t.name not in known:
            g.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
            known.add(t.name)
    for st in graph.sparse_initializer:
        if st.values.name not in known:
            g.input.append(
                helper.make_tensor_value_info(st.values.name, st.values.data_type, list(st.dims))
            )
    model.opset_import.extend(opset_imports)
    model.ir_version = max(ir_version, 4)
    model.functions.extend(functions)
    return model


def _infer_with_seeds(model: onnx.ModelProto, data: bytes) -> tuple[dict[str, int], dict[str, tuple | None]]:
    """Shape inference on ``model`` (serialized: ``data``), again after declaring the outputs of the
    ops onnx cannot infer (ai.onnx.ml, onnxruntime's contrib ops)."""
    g = model.graph
    ig = _infer_in_place(model, data)
    dtypes, shapes = _collect(ig)
    seeded = _seed_ml_outputs(g.node, dtypes, shapes)
    if seeded:
        # onnx has no inference for most ai.onnx.ml ops: declare their outputs
        # (float, rank known) and infer again so the ops after them get types.
        g.value_info.extend(seeded)
        ig = _infer_in_place(model)
        dtypes, shapes = _collect(ig)
    for _ in range(len(g.node)):
        # Nor for onnxruntime's contrib ops (genai models): declare the outputs
        # whose input became known, infer again, until nothing changes.
        seeded = _seed_contrib_outputs(g.node, dtypes, shapes)
        if not seeded:
            break
        g.value_info.extend(seeded)
        ig = _infer_in_place(model)
        dtypes, shapes = _collect(ig)
    return dtypes, shapes


# ------------------------------------------------------------ the types cache
def _types_key(model: onnx.ModelProto, data: bytes, extra: bytes) -> bytes | None:
    """The disk-cache key of ``infer_types``'s answer for the inference model
    ``model`` (serialized: ``data``) and ``extra`` (what else it reads), or
    None when not cached (cache off; an op with a schema registered at
    run time)."""
    if not diskcache.enabled() or not standard_domains(model):
        return None
    return diskcache.make_key("infer", onnx_build(), code_digest(), module_digest(__name__), data, extra)


def _stored_types(key: bytes) -> tuple[dict[str, int], dict[str, tuple | None]] | None:
    """``(dtypes, shapes)`` stored under ``key``, or None."""
    entry = diskcache.read("infer", key)
    if entry is not None:
        try:
            obj = json.loads(entry[1])
            dtypes = {str(k): int(v) for k, v in obj["dtypes"].items()}
            shapes = {str(k): None if v is None else tuple(v) for k, v in obj["shapes"].items()}
            diskcache.count("infer.hit")
            return dtypes, shapes
        except Exception:  # verified bytes that do not decode: treat as corrupt
            diskcache.count("infer.corrupt")
            diskcache.remove(diskcache.entry_path("infer", key))
    diskcache.count("infer.miss")
    return None


def _store_types(key: bytes, dtypes: dict[str, int], shapes: dict[str, tuple | None]) -> None:
    payload = json.dumps({"dtypes": dtypes, "shapes": shapes}, separators=(",", ":")).encode()
    diskcache.write("infer", key, {"kind": "types"}, payload)


def _initializer_facts(graph: onnx.GraphProto) -> bytes:
    """Every initializer's name, type and dims, with the data of those
    ``constant_values`` reads (at most 1024 elements, stored in the model)."""
    facts = onnx.GraphProto()
    for t in graph.initializer:
        if _numel(t.dims) <= 1024 and t.data_location != TensorProto.EXTERNAL:
            facts.initializer.append(t)
        else:
            facts.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims)
    return facts.SerializeToString()


def _large_constant(node: onnx.NodeProto) -> bool:
    """A default-domain Constant whose ``value`` is a tensor of over 1024
    elements that is not a 1-D integer tensor (the values of those may
    reach shapes through data propagation)."""
    if node.domain not in DEFAULT_DOMAINS or len(node.attribute) != 1 or len(node.output) != 1:
        return False
    a = node.attribute[0]
    if a.name != "value" or a.type != onnx.AttributeProto.TENSOR or not node.output[0]:
        return False
    t = a.t
    if t.data_type in (TensorProto.INT64, TensorProto.INT32) and len(t.dims) <= 1:
        return False
    return _numel(t.dims) > 1024


#: Ops whose outputs have the rank of their first input.
_SAME_RANK = frozenset(
    """Identity Cast CastLike Neg Abs Relu Sigmoid Tanh Exp Log Sqrt Reciprocal Erf Sin Cos Tan
    Asin Acos Atan Sinh Cosh Asinh Acosh Atanh Softplus Softsign Elu Selu Celu LeakyRelu
    HardSigmoid HardSwish ThresholdedRelu Mish Gelu Floor Ceil Round Sign Clip Softmax
    LogSoftmax Hardmax Dropout Shrink CumSum CumProd Pad Tile Slice Split Trilu IsNaN IsInf Not
    LpNormalization MeanVarianceNormalization LRN InstanceNormalization LayerNormalization
    GroupNormalization RMSNormalization ReverseSequence Resize Swish
    ScatterElements ScatterND Scatter GatherElements""".split()
)
#: Broadcasting ops: the rank of the result is the largest input rank.
_BROADCAST = frozenset(
    """Add Sub Mul Div Pow Mod Where Max Min Sum Mean Equal Less Greater LessOrEqual
    GreaterOrEqual And Or Xor PRelu BitShift BitwiseAnd BitwiseOr BitwiseXor""".split()
)


def _seed_contrib_outputs(
    nodes: Sequence[onnx.NodeProto], dtypes: dict[str, int], shapes: dict[str, tuple | None]
) -> list[onnx.ValueInfoProto]:
    """Value infos for the outputs of onnxruntime's ops in ``_CONTRIB_SHAPES``
    (com.microsoft, and SimplifiedLayerNormalization in the default domain)
    that inference left untyped and whose input 0 it typed: input 0's
    element type, and the shape the table gives (dims of input 0 carried
    over, symbolic ones included, so that inference goes on with them)."""
    out = []
    for node in nodes:
        if node.domain not in ("com.microsoft", "", "ai.onnx") or node.op_type not in _CONTRIB_SHAPES or not node.input:
            continue
        x = node.input[0]
        if not x or not dtypes.get(x) or shapes.get(x) is None:
            continue
        for i, name in enumerate(node.output):
            if not name or dtypes.get(name):
                continue
            shape = _CONTRIB_SHAPES[node.op_type](i, tuple(shapes[x]), node)
            if shape is not None:
                out.append(helper.make_tensor_value_info(name, dtypes[x], list(shape)))
    return out


def _same(i: int, x: tuple, node: onnx.NodeProto, outputs: tuple = (0,)) -> tuple | None:
    return x if i in outputs else None


def _nbits_shape(i: int, x: tuple, node: onnx.NodeProto) -> tuple | None:
    """MatMulNBits: A [.., K] -> Y [.., N]."""
    n = next((a.i for a in node.attribute if a.name == "N"), None)
    return (*x[:-1], n) if x else x


def _attention_shape(i: int, x: tuple, node: onnx.NodeProto) -> tuple | None:
    """GroupQueryAttention: output 0 [B, S, N H] from the query [B, S, N H]
    (packed: [B, S, (N + 2 Nkv) H]); MultiHeadAttention: [B, S, ?] (the
    value's width); the present key/value: rank 4."""
    if i != 0:
        return (None,) * 4
    if len(x) != 3:
        return (None,) * len(x)
    width = None
    if node.op_type == "GroupQueryAttention":
        attrs = {a.name: a.i for a in node.attribute if a.name in ("num_heads", "kv_num_heads")}
        n, nkv, d = attrs.get("num_heads", 0), attrs.get("kv_num_heads", 0), x[2]
        packed = len(node.input) < 2 or not node.input[1]
        if not packed:
            width = d
        elif isinstance(d, int) and n and d % (n + 2 * nkv) == 0:
            width = d // (n + 2 * nkv) * n
    return (x[0], x[1], width)


#: onnxruntime's ops: (output index, input 0's dims, the node) -> that output's dims (None: unknown).
_CONTRIB_SHAPES = {
    "MatMulNBits": _nbits_shape,
    "SkipSimplifiedLayerNormalization": lambda i, x, a: _same(i, x, a, (0, 3)),
    "SkipLayerNormalization": lambda i, x, a: _same(i, x, a, (0, 3)),
    "SimplifiedLayerNormalization": _same,
    "GroupQueryAttention": _attention_shape,
    "MultiHeadAttention": _attention_shape,
    "RotaryEmbedding": _same,
    "FastGelu": _same, "QuickGelu": _same, "BiasGelu": _same, "Gelu": _same,
}


def _propagate_ranks(
    nodes: Sequence[onnx.NodeProto],
    shapes: dict[str, tuple | None],
    dtypes: dict[str, int],
    graph: onnx.GraphProto,
) -> None:
    """Fill in the rank (dims unknown) of tensors onnx shape inference left
    without a shape, from the ranks of their inputs.

    onnx loses even the rank after, e.g., a Split with runtime lengths or an
    If, while the gradient rules only need the rank.  A value gets a rank only
    when every input it depends on for the rank has one."""
    known = _Ranks(shapes, constant_values(graph))  # initializers and Constant nodes
    for n in nodes:
        if n.domain in ("", "ai.onnx") and n.op_type in ("Shape", "Concat") and n.output[0]:
            k = known.shape_tensor_length(n)
            if k is not None:
                shapes[n.output[0]] = (k,)
                continue
        missing = [o for o in n.output if o and shapes.get(o) is None and (o not in dtypes or dtypes[o])]
        if not missing or n.domain not in ("", "ai.onnx"):
            continue
        r, missing = known.output_rank(n, missing)
        if r is None:
            continue
        for o in missing:
            shapes[o] = (None,) * r


class _Ranks:
    """What ``_propagate_ranks`` knows of values: their shapes (filled in as it goes) and constants."""

    def __init__(self, shapes: dict[str, tuple | None], consts: dict[str, np.ndarray]) -> None:
        self.shapes = shapes
        self.consts = consts

    def rank(self, name: str) -> int | None:
        """The rank of ``name``, if known."""
        s = self.shapes.get(name)
        return None if s is None else len(s)

    def ints(self, name: str) -> list[int] | None:
        """The values of the constant ``name`` as ints, if it is one."""
        v = self.consts.get(name)
        return None if v is None else [int(i) for i in np.asarray(v).reshape(-1)]

    def length(self, name: str) -> int | None:
        """The static length of the 1-D ``name``, if known."""
        s = self.shapes.get(name)
        return s[0] if s is not None and len(s) == 1 and isinstance(s[0], int) else None

    def shape_tensor_length(self, n: onnx.NodeProto) -> int | None:
        """The length of the 1-D shape tensor a Shape or Concat ``n`` makes: the rank of what
        it reshapes to."""
        rank = self.rank
        k = None
        if n.op_type == "Shape" and rank(n.input[0]) is not None:
            attrs = {a.name: a.i for a in n.attribute}
            k = len(range(rank(n.input[0]))[attrs.get("start", 0) : attrs.get("end", None)])
        elif n.op_type == "Concat" and all(rank(i) == 1 for i in n.input):
            lengths = [self.length(i) for i in n.input]
            k = None if any(v is None for v in lengths) else sum(lengths)
        return k

    def output_rank(self, n: onnx.NodeProto, missing: list[str]) -> tuple[int | None, list[str]]:
        """The rank of ``n``'s ``missing`` outputs by its op's rule (None: unknown), and those
        outputs still missing after it."""
        rank = self.rank
        ins = [i for i in n.input if i]
        r: int | None = None
        op = n.op_type
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if op in _SAME_RANK and ins:
            r = rank(ins[0])
        elif op in _BROADCAST and ins:
            ranks = [rank(i) for i in ins]
            r = None if any(x is None for x in ranks) else max(ranks)
        elif op == "Concat":
            r = next((rank(i) for i in ins if rank(i) is not None), None)
        elif op == "Transpose":
            r = len(attrs["perm"]) if "perm" in attrs else rank(ins[0])
        elif op in ("Reshape", "ConstantOfShape", "Expand") and len(ins) >= 1:
            shape_in = ins[1] if op in ("Reshape", "Expand") else ins[0]
            s = self.shapes.get(shape_in)
            k = s[0] if s is not None and len(s) == 1 and isinstance(s[0], int) else None
            if op == "Expand" and k is not None:
                r0 = rank(ins[0])
                k = None if r0 is None else max(k, r0)
            r = k
        elif op in ("Squeeze", "Unsqueeze") and ins:
            r = self.squeeze_rank(op, ins, attrs)
        elif op == "MatMul" and len(ins) == 2:
            ra, rb = rank(ins[0]), rank(ins[1])
            if ra is not None and rb is not None and ra >= 2 and rb >= 2:
                r = max(ra, rb)
        elif op == "Gather" and len(ins) == 2:
            ra, rq = rank(ins[0]), rank(ins[1])
            r = None if ra is None or rq is None else ra + rq - 1
        elif op == "Shape":
            r = 1
        elif op == "BatchNormalization" and ins:
            # Y has x's rank; the running and saved statistics are per channel
            if rank(ins[0]) is not None and self.shapes.get(n.output[0]) is None:
                self.shapes[n.output[0]] = (None,) * rank(ins[0])
            r = 1
            missing = [o for o in missing if o != n.output[0]]
        return r, missing

    def squeeze_rank(self, op: str, ins: list[str], attrs: dict[str, object]) -> int | None:
        """The rank after a Squeeze or Unsqueeze of ``ins``: it moves by the number of axes."""
        # (they are distinct), so a runtime axes input of known length is enough: a
        # subgraph reading its axes from the enclosing scope sees only their type
        if "axes" in attrs:
            n_axes = len(attrs["axes"])
        elif len(ins) > 1:
            axes = self.ints(ins[1])
            n_axes = len(axes) if axes is not None else self.length(ins[1])
        else:
            n_axes = None  # Squeeze without axes: every size-1 dim, unknown here
        r0 = self.rank(ins[0])
        if r0 is not None and n_axes is not None:
            return r0 - n_axes if op == "Squeeze" else r0 + n_axes
        return None


def value_types(
    graph: onnx.GraphProto,
    opset_imports: Sequence[onnx.OperatorSetIdProto],
    functions: Sequence[onnx.FunctionProto] = (),
) -> dict[str, onnx.TypeProto]:
    """Full inferred TypeProtos (sequences and optionals too) of a graph's values."""
    g = onnx.GraphProto()
    g.CopyFrom(graph)
    model = helper.make_model(g, opset_imports=list(opset_imports))
    model.functions.extend(functions)
    ig = _infer(model, g)
    return {vi.name: vi.type for vi in list(ig.input) + list(ig.value_info) + list(ig.output)}


def _infer_in_place(model: onnx.ModelProto, data: bytes | None = None) -> onnx.GraphProto:
    """The graph onnx infers for ``model`` (``data``: its bytes, if at hand);
    the model's own graph where inference fails."""
    try:
        if data is None:
            data = model.SerializeToString()
        return onnx.shape_inference.infer_shapes(data, strict_mode=False, data_prop=True).graph
    except Exception:  # inference is best effort; rules fall back to runtime shapes
        return model.graph


def _infer(model: onnx.ModelProto, g: onnx.GraphProto) -> onnx.GraphProto:
    del model.graph.value_info[:]
    model.graph.value_info.extend(g.value_info)
    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True).graph
    except Exception:  # inference is best effort; rules fall back to runtime shapes
        return g


def _collect(ig: onnx.GraphProto) -> tuple[dict[str, int], dict[str, tuple | None]]:
    dtypes: dict[str, int] = {}
    shapes: dict[str, tuple | None] = {}
    for vi in list(ig.input) + list(ig.value_info) + list(ig.output):
        tt = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
        if tt is None:
            continue
        if tt.elem_type:
            dtypes.setdefault(vi.name, tt.elem_type)
        shapes.setdefault(vi.name, shape_of_type(vi.type))
    return dtypes, shapes


#: ai.onnx.ml ops whose float output has the shape of their input.
_ML_SAME_SHAPE = {"Scaler", "Normalizer", "Imputer", "Binarizer"}
#: ai.onnx.ml ops with a float [N, k] output (scores, predictions, features).
_ML_MATRIX = {"LinearRegressor", "SVMRegressor", "TreeEnsembleRegressor", "FeatureVectorizer",
              "TreeEnsemble"}


def _seed_ml_outputs(
    nodes: Sequence[onnx.NodeProto], dtypes: dict[str, int], shapes: dict[str, tuple | None]
) -> list[onnx.ValueInfoProto]:
    """Value infos for the float outputs of ai.onnx.ml ops inference left untyped."""
    out = []
    for node in nodes:
        if node.domain != "ai.onnx.ml" or not node.output or not node.output[0]:
            continue
        name = node.output[0]
        if name in dtypes:
            continue
        if node.op_type in _ML_SAME_SHAPE:
            shape = shapes.get(node.input[0])
            rank = None if shape is None else len(shape)
        elif node.op_type in _ML_MATRIX:
            rank = 2
        else:
            continue
        dims = None if rank is None else [None] * rank
        out.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, dims))
    return out


def overridable_inputs(graph: onnx.GraphProto) -> set[str]:
    """Graph inputs that also have an initializer: inputs with a default value.

    Unfed, the initializer is used; fed, the feed wins (IR.md: "When an
    initializer has the same name as a graph input, it specifies a default
    value for that input").  So their values are not known when building:
    a pass must never fold one as a constant."""
    inputs = {i.name for i in graph.input}
    if not inputs:
        return set()
    names = {t.name for t in graph.initializer} | {t.values.name for t in graph.sparse_initializer}
    return inputs & names


def constant_values(graph: onnx.GraphProto, max_size: int = 1024) -> dict[str, np.ndarray]:
    """Values of small Constant outputs and initializers, known when building
    (not those of inputs with a default: ``overridable_inputs``)."""
    out: dict[str, np.ndarray] = {}
    fed = overridable_inputs(graph)
    for t in graph.initializer:
        if t.name in fed:
            continue
        if _numel(t.dims) <= max_size and t.data_location != TensorProto.EXTERNAL:
            try:
                out[t.name] = numpy_helper.to_array(t)
            except (ValueError, TypeError):
                continue  # malformed data: validation reports it where it matters
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in DEFAULT_DOMAINS:
            for a in node.attribute:
                if (a.name == "value" and _numel(a.t.dims) <= max_size
                        and a.t.data_location != TensorProto.EXTERNAL):
                    out[node.output[0]] = numpy_helper.to_array(a.t)
                elif a.name == "value_ints":
                    out[node.output[0]] = np.asarray(list(a.ints), dtype=np.int64)
                elif a.name == "value_int":
                    out[node.output[0]] = np.asarray(a.i, dtype=np.int64)
    return out


def is_zero(values: dict[str, np.ndarray], name: str, positive: bool = False) -> bool:
    """Whether ``name`` is a one-element floating constant of ``values``
    (``constant_values``) equal to zero; +0.0 only with ``positive``."""
    v = values.get(name)
    if v is None or v.size != 1 or v.dtype.kind != "f":
        return False
    x = v.reshape(-1)[0]
    return bool(x == 0) and not (positive and np.signbit(x))


def _numel(dims) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def opset_version(opset_imports: Iterable[onnx.OperatorSetIdProto], domain: str = "") -> int:
    """The imported version of a domain (default domain: '' or 'ai.onnx'); 0 if
    the domain is not imported.  The one opset lookup of the package."""
    domains = DEFAULT_DOMAINS if domain in DEFAULT_DOMAINS else (domain,)
    for o in opset_imports:
        if o.domain in domains:
            return int(o.version)
    return 0


def batch_norm_training(node: onnx.NodeProto, opset: int) -> bool:
    """Whether a BatchNormalization node runs in training mode (batch
    statistics; the running ones updated as outputs 1 and 2): from opset 14
    its ``training_mode`` attribute says so, before it the extra outputs do."""
    if opset >= 14:
        return any(a.name == "training_mode" and a.i for a in node.attribute)
    return sum(1 for o in node.output if o) > 1
