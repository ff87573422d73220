"""Programs specialized to the shapes of their feeds, and their shape
arithmetic folded away.

A hand-written algorithm graph often declares a feed without a shape
(``make_tensor_value_info("target", FLOAT, None)``).  The backward of its
loss then decides broadcasting at run time: ``Shape``, ``Size``,
``ConstantOfShape``, ``Concat``, ``Equal``, ``NonZero`` and ``Reshape`` nodes
(``autodiff``'s dynamic unbroadcast) run at every step, around kernels that
may be as small as themselves.

``specialize(model, shapes)`` is the pass: given the shapes of the feeds a
program was first run with, it

1. declares those shapes on the program's inputs;
2. infers every value's type and static shape (``core.graph.infer_types``);
3. folds (``fold_constants``): ``Shape`` and ``Size`` of a value whose shape
   is now static, and every node of ``FOLDABLE`` whose inputs are all
   constants, become initializers (evaluated by ``onnx.reference``; only ops
   whose float results are correctly rounded, so folding is exact);
4. drops the no-ops that folding exposes (``drop_noops``): a ``Reshape`` or
   ``Expand`` to the shape its input already has, a ``ReduceSum`` over axes
   of size 1 only, an ``Identity``: their readers read the input instead;

and repeats 2-4 until nothing changes.  The result computes what the
original computes, bit for bit, for feeds of those shapes only.  It returns
None where nothing folds, so that such programs are not compiled twice.

``runtime.runner.ProgramRunner`` keys the specialized programs by the feed
shapes (``shape_key``), keeps at most ``MAX_SPECIALIZATIONS`` of each program
and runs the general program for shapes beyond those; ``ONNXTRAIN_SPECIALIZE=0``
turns specialization off.

>>> import numpy as np
>>> from onnx import TensorProto, helper
>>> g = helper.make_graph(
...     [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Reshape", ["x", "s"], ["r"]),
...      helper.make_node("Relu", ["r"], ["y"])],
...     "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
>>> m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
>>> [n.op_type for n in m.graph.node], [n.op_type for n in specialize(m, {"x": (2, 3)}).graph.node]
(['Shape', 'Reshape', 'Relu'], ['Relu'])
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..core.graph import DEFAULT_DOMAINS, infer_types, node_inputs, opset_version, prune, subgraphs

#: How many specializations of one program are kept (each one is a compiled
#: onnxruntime session); feeds of further shapes run the general program.
MAX_SPECIALIZATIONS = 8
#: Programs whose initializers hold more bytes than this in the model are not
#: specialized: a specialization is a copy of the model.
COPY_LIMIT = 1 << 26
#: Programs of more nodes than this are not specialized: shape inference and
#: the kernel choice over the whole program again cost about 1.7 ms a node
#: at the first step (the genai int4 decoder's training program, 6591 nodes:
#: 11 s against a 1.2 s step, and its contrib ops leave most shapes open).
MAX_NODES = 3000
#: A folded value of more elements than this stays a node (a constant that
#: large would cost memory for little time).
MAX_FOLDED_ELEMENTS = 1 << 12
#: The ops folded where all their inputs are constants: shape and index
#: arithmetic, data movement, and elementwise ops whose float results
#: are correctly rounded (so that numpy's answer is onnxruntime's).
FOLDABLE = frozenset(
    """Identity Cast Concat ConstantOfShape Reshape Squeeze Unsqueeze Flatten Gather Slice Expand
    Tile Transpose Range NonZero Equal Less Greater LessOrEqual GreaterOrEqual Not And Or Where
    Add Sub Mul Div Neg Abs Max Min ReduceProd Size Shape Sign""".split()
)
#: Rounds of infer-fold-drop at most (each round that changes nothing ends it).
MAX_ROUNDS = 6


def dynamic_feeds(inputs: Iterable[onnx.ValueInfoProto]) -> tuple[str, ...]:
    """The names of the inputs whose declared shape is not fully static (no
    shape, or a symbolic or unknown dimension): what a specialization fixes."""
    names = []
    for vi in inputs:
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type"):
            continue
        if not tt.HasField("shape") or any(not d.HasField("dim_value") for d in tt.shape.dim):
            names.append(vi.name)
    return tuple(names)


def shape_key(feeds: Mapping[str, np.ndarray], names: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The shapes of the feeds ``names`` (``dynamic_feeds``), in order: what
    a specialization is for."""
    return tuple(feeds[n].shape for n in names)


def in_model_bytes(model: onnx.ModelProto) -> int:
    """The bytes the model's initializers hold in the proto (external data not counted)."""
    return sum(t.ByteSize() for t in model.graph.initializer)


def specialize(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]]) -> onnx.ModelProto | None:
    """``model`` for inputs of exactly ``shapes`` (name -> dims), its shape
    arithmetic folded; None where nothing folds, the model is too large to
    copy (``COPY_LIMIT``) or too large to specialize at the first step for
    what it gains (``MAX_NODES``).  See the module docstring."""
    if in_model_bytes(model) > COPY_LIMIT or len(model.graph.node) > MAX_NODES:
        return None
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    for vi in g.input:
        if vi.name in shapes:
            tt = vi.type.tensor_type
            tt.ClearField("shape")
            tt.shape.SetInParent()
            for d in shapes[vi.name]:
                tt.shape.dim.add().dim_value = int(d)
    del g.value_info[:]  # (symbolic shapes inferred before: stale)
    changed = 0
    for _ in range(MAX_ROUNDS):
        _, static = infer_types(g, list(out.opset_import), out.ir_version, list(out.functions))
        n = fold_constants(g, static, opset_version(out.opset_import)) + drop_noops(g, static)
        if not n:
            break
        changed += n
    if not changed:
        return None
    outputs = [o.name for o in g.output]
    live = prune(list(g.node), outputs)
    del g.node[:]
    g.node.extend(live)
    used = set(outputs) | {i for n in live for i in node_inputs(n)}
    kept = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(kept)
    return out


def _static(shape: tuple | None) -> bool:
    return shape is not None and all(type(d) is int for d in shape)


def _constants(g: onnx.GraphProto) -> dict[str, np.ndarray]:
    """The small constants of ``g``: initializers that are not inputs, and Constant nodes."""
    inputs = {i.name for i in g.input}
    out = {}
    for t in g.initializer:
        if t.name not in inputs and int(np.prod(t.dims)) <= MAX_FOLDED_ELEMENTS:
            out[t.name] = numpy_helper.to_array(t)
    for n in g.node:
        if n.op_type == "Constant" and n.domain in DEFAULT_DOMAINS and n.attribute:
            a = n.attribute[0]
            if a.name == "value" and int(np.prod(a.t.dims)) <= MAX_FOLDED_ELEMENTS:
                out[n.output[0]] = numpy_helper.to_array(a.t)
    return out


def fold_constants(g: onnx.GraphProto, shapes: Mapping[str, tuple | None], opset: int) -> int:
    """Replace with initializers the nodes whose outputs are known before the
    run (see the module docstring, step 3); how many nodes went.  Graph
    outputs stay computed by their nodes."""
    consts = _constants(g)
    outputs = {o.name for o in g.output}
    folded: list[tuple[onnx.NodeProto, list[np.ndarray]]] = []
    for node in g.node:
        if node.domain not in DEFAULT_DOMAINS or node.op_type == "Constant" or subgraphs(node):
            continue
        if any(o in outputs for o in node.output) or not node.output:
            continue
        values = _evaluate(node, consts, shapes, opset)
        if values is None:
            continue
        for name, value in zip(node.output, values):
            consts[name] = value
        folded.append((node, values))
    if not folded:
        return 0
    gone = {id(n) for n, _ in folded}
    kept = [n for n in g.node if id(n) not in gone]
    del g.node[:]
    g.node.extend(kept)
    for node, values in folded:
        for name, value in zip(node.output, values):
            if name:
                g.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    return len(folded)


def _evaluate(node: onnx.NodeProto, consts: Mapping[str, np.ndarray],
              shapes: Mapping[str, tuple | None], opset: int) -> list[np.ndarray] | None:
    """``node``'s outputs when they are known before the run, else None."""
    op = node.op_type
    if op in ("Shape", "Size"):
        shape = shapes.get(node.input[0])
        if not _static(shape):
            return None
        if op == "Size":
            return [np.array(int(np.prod(shape, dtype=np.int64)), dtype=np.int64)]
        attrs = {a.name: a.i for a in node.attribute}
        start, end = attrs.get("start", 0), attrs.get("end", len(shape))
        return [np.array(shape, dtype=np.int64)[start:end]]
    if op not in FOLDABLE or any(i and i not in consts for i in node.input):
        return None
    values = _run_reference(node, consts, opset)
    if values is None or any(np.asarray(v).size > MAX_FOLDED_ELEMENTS for v in values):
        return None
    return values


def _run_reference(node: onnx.NodeProto, consts: Mapping[str, np.ndarray],
                   opset: int) -> list[np.ndarray] | None:
    """One node evaluated by onnx's reference implementation (None: it fails)."""
    from onnx.reference import ReferenceEvaluator

    inputs = [i for i in node.input if i]
    graph = helper.make_graph(
        [node], "fold",
        [helper.make_tensor_value_info(i, helper.np_dtype_to_tensor_dtype(consts[i].dtype), None)
         for i in dict.fromkeys(inputs)],
        [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in node.output if o])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    evaluator = None
    try:
        evaluator = ReferenceEvaluator(model)
        values = evaluator.run(None, {i: consts[i] for i in inputs})
    except Exception:  # an op or a case the reference does not take: left to run
        return None
    finally:
        if evaluator is not None:
            # Its nodes refer back to it (their log callback): a reference cycle
            # that would hold this graph until the cycle collector runs.
            evaluator.rt_nodes_ = []
    return [np.asarray(v) for v in values]


def drop_noops(g: onnx.GraphProto, shapes: Mapping[str, tuple | None]) -> int:
    """Let the readers of a no-op's output read its input instead (module
    docstring, step 4); how many nodes went.  Not where the output is a graph
    output or the input is a graph input read by nothing else."""
    outputs = {o.name for o in g.output}
    consts = {t.name: t for t in g.initializer}
    rename: dict[str, str] = {}
    kept = []
    for node in g.node:
        src = _noop_source(node, shapes, consts)
        if src is not None and node.output[0] not in outputs:
            rename[node.output[0]] = rename.get(src, src)
            continue
        kept.append(node)
    if not rename:
        return 0
    for node in kept:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
        for sub in subgraphs(node):
            _rename_captured(sub, rename)
    del g.node[:]
    g.node.extend(kept)
    return len(rename)


def _rename_captured(g: onnx.GraphProto, rename: Mapping[str, str]) -> None:
    for node in g.node:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
        for sub in subgraphs(node):
            _rename_captured(sub, rename)


def _noop_source(node: onnx.NodeProto, shapes: Mapping[str, tuple | None],
                 consts: Mapping[str, onnx.TensorProto]) -> str | None:
    """The input a no-op node passes on unchanged, or None."""
    if node.domain not in DEFAULT_DOMAINS or not node.input or len(node.output) != 1:
        return None
    op, x = node.op_type, node.input[0]
    if op == "Identity":
        return x
    shape = shapes.get(x)
    if not _static(shape):
        return None
    if op in ("Reshape", "Expand") and len(node.input) == 2 and node.input[1] in consts:
        target = numpy_helper.to_array(consts[node.input[1]]).tolist()
        if op == "Reshape" and list(shape) == target and 0 not in target:
            return x
        if op == "Expand" and len(target) <= len(shape) and all(
                t == 1 or t == s for t, s in zip(target[::-1], list(shape)[::-1])):
            return x
    if op == "ReduceSum" and len(node.input) == 2 and node.input[1] in consts:
        attrs = {a.name: a.i for a in node.attribute}
        axes = numpy_helper.to_array(consts[node.input[1]]).reshape(-1).tolist()
        if attrs.get("keepdims", 1) and axes and all(shape[a] == 1 for a in axes):
            return x  # a sum of one element is that element (onnxruntime copies it)
    return None
