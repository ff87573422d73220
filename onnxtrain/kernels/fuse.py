"""Peephole fusions on a program before it is compiled.

``fuse_gemm_updates`` folds a scaled update of a Gemm product into the Gemm
itself:

    s1 * X  +/-  s2 * Gemm(A, B)     (s1, s2 scalar constants, X shaped like the product)
    ->  Gemm(A, B, C=X, alpha=+/- s2 * alpha, beta=s1)

This is exactly the SGD step on a weight whose gradient is a Gemm
(``W - lr * Gemm(h, dZ, transA=1)``) and the momentum update
(``alpha * V + beta * G``): the update then costs no pass over the weight
beyond the Gemm's own write.  onnxruntime fuses none of this itself.

The fused program computes the same values up to float rounding (one fused
multiply-add instead of separate Mul/Sub kernels).  Gemm's alpha and beta are
float32 attributes, so the fusion applies only where the folded scalars are
exactly representable in float32 (always for float32 models; a float64 model
with lr = 0.1 keeps its exact unfused update).

``with_fused_kernels`` (``lower.executed.optimizer_kernels``, a step of the
executed lists) replaces optimizer updates by the custom kernels of
``onnxtrain/kernels``, bit for bit: every call of an update rule that names a kernel
(``fuse_rule_calls``: found by name, see ``onnxtrain.optim.rules``), and the
layer rewrites.  See docs/fused-kernels.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..core.graph import infer_types, node_inputs, overridable_inputs, read_counts, toposort
from ..core.names import NameGen
from ..errors import TrainingModelError
from ..optim import rules


def _scalars(graph: onnx.GraphProto) -> dict[str, float]:
    """Scalar values known when building: Constants, scalar initializers, and
    Casts / arithmetic of known scalars (a tiny constant folder)."""
    known: dict[str, float] = {}
    fed = overridable_inputs(graph)  # (their values come at run time)
    for t in graph.initializer:
        if t.name not in fed and (len(t.dims) == 0 or (len(t.dims) == 1 and t.dims[0] == 1)):
            known[t.name] = float(numpy_helper.to_array(t).reshape(-1)[0])
    for n in graph.node:
        if n.domain not in ("", "ai.onnx"):
            continue
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value" and int(np.prod(a.t.dims)) == 1:
                    known[n.output[0]] = float(numpy_helper.to_array(a.t).reshape(-1)[0])
                elif a.name == "value_float":
                    known[n.output[0]] = float(a.f)
        elif n.op_type == "Identity" and n.input and n.input[0] in known:
            known[n.output[0]] = known[n.input[0]]
        elif n.op_type == "Cast" and n.input and n.input[0] in known:
            to = next((a.i for a in n.attribute if a.name == "to"), 0)
            try:
                dtype = helper.tensor_dtype_to_np_dtype(to)
            except (KeyError, TypeError, ValueError):
                continue
            known[n.output[0]] = float(np.asarray(known[n.input[0]]).astype(dtype))
        elif n.op_type in ("Mul", "Div", "Add", "Sub") and all(i in known for i in n.input):
            a, b = (known[i] for i in n.input)
            value = {"Mul": a * b, "Add": a + b, "Sub": a - b, "Div": a / b if b else None}[n.op_type]
            if value is not None:
                known[n.output[0]] = value
    return known


def fuse_gemm_updates(
    graph: onnx.GraphProto, opset_imports: Sequence[onnx.OperatorSetIdProto]
) -> int:
    """Apply the fusion everywhere it is valid (in place); returns how many."""
    nodes = list(graph.node)
    terms = _Terms(graph, nodes)
    shapes: dict | None = None
    removed: set[int] = set()
    replaced: dict[int, onnx.NodeProto] = {}
    count = 0
    for node in nodes:
        if node.op_type not in ("Add", "Sub") or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
            continue
        sign = -1.0 if node.op_type == "Sub" else 1.0
        (x0, s0, m0), (x1, s1, m1) = terms.term(node.input[0]), terms.term(node.input[1])
        for (gx, gs, gm, gsign), (xx, xs, xm, xsign) in (
            ((x1, s1, m1, sign), (x0, s0, m0, 1.0)),
            ((x0, s0, m0, 1.0), (x1, s1, m1, sign)),
        ):
            gx, identities = terms.through_identities(gx)
            gemm = terms.producer.get(gx)
            if (
                gemm is None
                or gemm.op_type != "Gemm"
                or len([i for i in gemm.input if i]) != 2
                or terms.uses.get(gx) != 1
                or id(gemm) in removed
                or xx == gx
            ):
                continue
            if shapes is None:
                _, shapes = infer_types(graph, opset_imports)
            sg, sx = shapes.get(gx), shapes.get(xx)
            if sg is None or sg != sx or not all(isinstance(d, int) for d in sg):
                continue  # C must have the product's exact shape
            fused = _fused_gemm(gemm, gs * gsign, xx, xs * xsign, node.output[0])
            if fused is None:
                continue
            replaced[id(node)] = fused
            removed.add(id(gemm))
            for m in [gm, xm, *identities]:
                if m is not None:
                    removed.add(id(m))
            count += 1
            break
    if count:
        # The fused Gemm sits where the Add/Sub was: after both operands exist.
        out = [replaced.get(id(n), n) for n in nodes if id(n) not in removed]
        del graph.node[:]
        graph.node.extend(out)
    return count


class _Terms:
    """The operands of an update as the fusion sees them: producers, read counts and known scalars."""

    def __init__(self, graph: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> None:
        self.producer = {o: n for n in nodes for o in n.output if o}
        self.uses = read_counts(nodes, (o.name for o in graph.output))
        self.scalars = _scalars(graph)

    def through_identities(self, name: str) -> tuple[str, list[onnx.NodeProto]]:
        """Follow single-use Identity nodes back to the real producer."""
        chain = []
        while True:
            p = self.producer.get(name)
            if p is None or p.op_type != "Identity" or self.uses.get(name) != 1:
                return name, chain
            chain.append(p)
            name = p.input[0]

    def term(self, name: str) -> tuple[str, float, onnx.NodeProto | None]:
        """(base, scale, Mul node or None) of a possibly scaled tensor."""
        mul = self.producer.get(name)
        if mul is not None and mul.op_type == "Mul" and mul.domain in ("", "ai.onnx") and self.uses.get(name) == 1:
            a, b = mul.input
            if b in self.scalars and a not in self.scalars:
                return a, self.scalars[b], mul
            if a in self.scalars and b not in self.scalars:
                return b, self.scalars[a], mul
        return name, 1.0, None


def _fused_gemm(gemm: onnx.NodeProto, scale: float, c: str, beta: float, output: str) -> onnx.NodeProto | None:
    """``gemm`` (no C) times ``scale`` plus ``beta * c`` as one Gemm writing ``output``,
    or None where its alpha or beta would not be exact in float32."""
    attrs = {a.name: helper.get_attribute_value(a) for a in gemm.attribute}
    alpha = float(attrs.get("alpha", 1.0)) * scale
    # (the Gemm had no C, so its own beta played no part)
    if float(np.float32(alpha)) != alpha or float(np.float32(beta)) != beta:
        return None  # Gemm's alpha/beta are float32 attributes: no silent rounding
    return helper.make_node(
        "Gemm",
        [gemm.input[0], gemm.input[1], c],
        [output],
        name=(gemm.name or "gemm") + "/fused_update",
        alpha=alpha,
        beta=beta,
        transA=int(attrs.get("transA", 0)),
        transB=int(attrs.get("transB", 0)),
    )


# ------------------------------------------------------------- update rules
#: Domain of the fused kernels of ``onnxtrain/kernels`` (an onnxruntime
#: custom-op library, registered by the executor).
KERNEL_DOMAIN = "ai.onnxtrain.kernels"
_SUFFIX = {TensorProto.FLOAT: "F32", TensorProto.DOUBLE: "F64"}
#: Tensors with fewer elements than this (16 KiB of float32) share one
#: multi-tensor node per set of scalar operands (one optimizer node): for
#: them the per-node cost of onnxruntime is a large part of the update.
#: Larger ones get a node each, which onnxruntime runs as soon as that
#: tensor's gradient exists (while it is still in cache) instead of after
#: the last gradient.
BATCH_BELOW = 4096


@dataclass
class _Fusion:
    """One call about to become (part of) a kernel node."""

    op: str
    inputs: list[str]  # the kernel's scalars, then this call's tensors
    n_scalars: int
    outputs: list[str]
    #: Nodes it replaces: the call's, and a WeightDecay call it took in.
    dropped: tuple[int, ...]
    root: int  # the call's last node: where the kernel node goes
    batch: tuple  # calls with one key share a node


def fuse_rule_calls(
    graph: onnx.GraphProto, opset_imports: Sequence[onnx.OperatorSetIdProto], inferred=None
) -> int:
    """Replace every intact call of an update rule that names a fused kernel
    (``optim.rules``: ``find_calls``, ``FusedKernel``) by that kernel (in place).

    The call is found by its nodes' names and checked against the rule's own
    body; its operands become the kernel's inputs in the kernel's order.  A
    kernel with a ``decay`` slot also takes in the ``WeightDecay`` call
    (``nc x + g``) that feeds its gradient, where nothing else reads that sum.
    The kernel computes the same IEEE operations in the same order, so the
    values are bit for bit the standard ops'.

    Only where the kernel applies: operands of the call's element type (int64
    where the rule says so), tensors of one static shape of rank <= 8, scalars
    of one element, results of the tensors' shape.  Multi-tensor kernels
    update every tensor under ``BATCH_BELOW`` elements with the same scalar
    operands in one node.  Returns how many calls were replaced."""
    nodes = list(graph.node)
    if not any(n.name.startswith(rules.PREFIX) for n in nodes):
        return 0
    graph_outputs = {o.name for o in graph.output}
    calls = rules.find_calls(nodes, graph_outputs)
    if not any(c.rule.kernel is not None for c in calls):
        return 0
    types, shapes = inferred() if inferred else infer_types(graph, opset_imports)
    readers: dict[str, set[int]] = {}
    for k, n in enumerate(nodes):
        for i in node_inputs(n):
            readers.setdefault(i, set()).add(k)
    decays = {c.outputs["g_new"]: c for c in calls if c.rule.name == "WeightDecay"}
    defaults = _Defaults(graph)

    fusions: list[_Fusion] = []
    for k, call in enumerate(calls):
        kernel = call.rule.kernel
        size = _kernel_size(call, types, shapes) if kernel is not None else None
        if size is None:
            continue
        operands, dropped = dict(call.operands), set(call.nodes)
        decay = decays.get(operands.get("g", "")) if kernel.decay else None
        if (decay is not None and decay.operands["x"] == operands.get("x")
                and decay.outputs["g_new"] not in graph_outputs
                and readers.get(decay.outputs["g_new"], set()) <= dropped
                and _kernel_size(decay, types, shapes) == size):
            operands[kernel.decay] = decay.operands["nc"]
            operands["g"] = decay.operands["g"]
            dropped |= set(decay.nodes)
        scalars = [operands.get(s) or (defaults.get(kernel.defaults[s], call.et) if s in kernel.defaults else "")
                   for s in kernel.scalars]
        op = kernel.op + _SUFFIX[call.et]
        batch = (op, tuple(scalars)) if kernel.multi_tensor and size < BATCH_BELOW else ("single", k)
        tensors = [operands[t] for t in call.rule.tensors]
        inputs = tensors + scalars if kernel.tensors_first else scalars + tensors
        fusions.append(_Fusion(op, inputs, 0 if kernel.tensors_first else len(scalars),
                               [call.outputs[o] for o in call.rule.outputs], tuple(dropped), max(call.nodes),
                               batch))
    if not fusions:
        return 0
    batches: dict[tuple, list[_Fusion]] = {}
    for f in fusions:
        batches.setdefault(f.batch, []).append(f)
    defaults.add_to(graph)
    try:
        ordered = _rewrite(graph, nodes, list(batches.values()))
    except TrainingModelError:
        # A batch that would feed itself (tensors of one optimizer node never
        # do): one node per tensor always keeps the graph acyclic.
        ordered = _rewrite(graph, nodes, [[f] for f in fusions])
    del graph.node[:]
    graph.node.extend(ordered)
    return len(fusions)


def _kernel_size(call: rules.Call, types: dict, shapes: dict) -> int | None:
    """Elements per tensor of ``call`` where its kernel can run it (0 for a
    rule of scalars only), else None (see ``fuse_rule_calls``)."""
    rule = call.rule
    for name, value in call.operands.items():
        if types.get(value) != (TensorProto.INT64 if name in rule.integer else call.et):
            return None
    if call.et not in _SUFFIX:
        return None

    def static(name: str) -> tuple[int, ...] | None:
        s = shapes.get(name)
        return tuple(s) if s is not None and all(isinstance(d, int) for d in s) else None

    if any(static(call.operands[s]) is None or math.prod(static(call.operands[s])) != 1
           for s in rule.scalars if s in call.operands):
        return None
    if not rule.tensors:
        return 0
    shape = static(call.operands[rule.tensors[0]])
    if shape is None or len(shape) > 8:
        return None
    if any(static(call.operands[t]) != shape for t in rule.tensors):
        return None
    if any(static(v) != shape for v in call.outputs.values()):
        return None  # a scalar broadcast the result
    return math.prod(shape)


class _Defaults:
    """One-element initializers holding a kernel's default operands (Adam's decay 1)."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.names: NameGen | None = None
        self.made: dict[tuple[float, int], onnx.TensorProto] = {}

    def get(self, value: float, et: int) -> str:
        key = (value, et)
        if key not in self.made:
            if self.names is None:
                self.names = NameGen.from_graph(self.graph)
            self.made[key] = numpy_helper.from_array(
                np.array(value, dtype=helper.tensor_dtype_to_np_dtype(et)), self.names.fresh("kernel_default"))
        return self.made[key].name

    def add_to(self, graph: onnx.GraphProto) -> None:
        graph.initializer.extend(self.made.values())


def _rewrite(graph: onnx.GraphProto, nodes: list[onnx.NodeProto],
             batches: list[list[_Fusion]]) -> list[onnx.NodeProto]:
    """``nodes`` with each batch one kernel node, where its last call ended."""
    at: dict[int, onnx.NodeProto] = {}
    dropped: set[int] = set()
    for batch in batches:
        first = batch[0]
        inputs = first.inputs[: first.n_scalars]
        outputs: list[str] = []
        for f in batch:
            inputs += f.inputs[f.n_scalars:]
            outputs += f.outputs
            dropped.update(f.dropped)
        root = max(f.root for f in batch)
        at[root] = helper.make_node(
            first.op, inputs, outputs, domain=KERNEL_DOMAIN,
            name=f"{outputs[0]}/{first.op}" + ("_batched" if len(batch) > 1 else "_fused"),
        )
    out = [at.get(k, n) for k, n in enumerate(nodes) if k not in dropped or k in at]
    available = [i.name for i in graph.input] + [t.name for t in graph.initializer]
    available += [t.values.name for t in graph.sparse_initializer]
    return toposort(out, available, where="fused program")


def with_fused_kernels(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """A copy of ``model`` with its optimizer updates fused, and how many
    rewrites (0: ``model`` itself): the calls of update rules that name a
    kernel (``fuse_rule_calls``: the builder's Adam/AdamW, the spec's Adam and
    its step size, Momentum and Adagrad, ...), and layer ops (``fuse_layers``: MaxPool with
    Indices and its overlapping scatter, Relu's gradient; ``fuse_conv``: a
    weight gradient's column matrix, a strided input gradient's col2im;
    ``fuse_norm``: BatchNormalization's gradient).
    The layer rewrites are planned first, while onnx can still infer every
    shape of the program."""
    from . import conv as conv  # (they take this module's KERNEL_DOMAIN)
    from . import layers as layers
    from . import norm as norm

    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    opsets = list(fused.opset_import)
    # One shape inference for every plan made on the unchanged graph.
    inferred = layers.shared_inference(fused.graph, opsets)
    pools = layers.max_pool_plan(fused.graph, opsets, inferred)
    relus = layers.relu_grad_plan(fused.graph, opsets, inferred)
    cols = conv.im2col_plan(fused.graph, opsets, inferred)
    strided = conv.col2im_plan(fused.graph, opsets, inferred)
    norms = norm.bn_grad_plan(fused.graph, opsets, inferred)
    scatters = layers.scatter_plan(fused.graph, opsets, inferred)
    count = fuse_rule_calls(fused.graph, opsets, inferred)
    count += layers.fuse_max_pools(fused.graph, pools, KERNEL_DOMAIN)
    count += layers.fuse_relu_grads(fused.graph, relus, KERNEL_DOMAIN)
    count += conv.fuse_im2cols(fused.graph, cols, KERNEL_DOMAIN)
    count += conv.fuse_col2ims(fused.graph, strided, KERNEL_DOMAIN)
    count += norm.fuse_bn_grads(fused.graph, norms, KERNEL_DOMAIN)
    count += layers.fuse_scatters(fused.graph, scatters, KERNEL_DOMAIN)
    if not count:
        return model, 0
    fused.opset_import.append(helper.make_opsetid(KERNEL_DOMAIN, 1))
    return fused, count
