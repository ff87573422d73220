"""Peephole fusions on a program before it is compiled.

One job: fold a scaled update of a Gemm product into the Gemm itself.

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
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .graph import infer_types, node_inputs


def _scalars(graph: onnx.GraphProto) -> dict[str, float]:
    """Scalar values known when building: Constants, scalar initializers, and
    Casts / arithmetic of known scalars (a tiny constant folder)."""
    known: dict[str, float] = {}
    for t in graph.initializer:
        if len(t.dims) == 0 or (len(t.dims) == 1 and t.dims[0] == 1):
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
    producer = {o: n for n in nodes for o in n.output if o}
    uses: dict[str, int] = {}
    for n in nodes:
        for i in node_inputs(n):
            uses[i] = uses.get(i, 0) + 1
    for o in graph.output:
        uses[o.name] = uses.get(o.name, 0) + 1
    scalars = _scalars(graph)
    shapes: dict | None = None
    removed: set[int] = set()
    replaced: dict[int, onnx.NodeProto] = {}
    count = 0

    def through_identities(name: str) -> tuple[str, list[onnx.NodeProto]]:
        """Follow single-use Identity nodes back to the real producer."""
        chain = []
        while True:
            p = producer.get(name)
            if p is None or p.op_type != "Identity" or uses.get(name) != 1:
                return name, chain
            chain.append(p)
            name = p.input[0]

    def term(name: str) -> tuple[str, float, onnx.NodeProto | None]:
        """(base, scale, Mul node or None) of a possibly scaled tensor."""
        mul = producer.get(name)
        if mul is not None and mul.op_type == "Mul" and mul.domain in ("", "ai.onnx") and uses.get(name) == 1:
            a, b = mul.input
            if b in scalars and a not in scalars:
                return a, scalars[b], mul
            if a in scalars and b not in scalars:
                return b, scalars[a], mul
        return name, 1.0, None

    for node in nodes:
        if node.op_type not in ("Add", "Sub") or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
            continue
        sign = -1.0 if node.op_type == "Sub" else 1.0
        (x0, s0, m0), (x1, s1, m1) = term(node.input[0]), term(node.input[1])
        for (gx, gs, gm, gsign), (xx, xs, xm, xsign) in (
            ((x1, s1, m1, sign), (x0, s0, m0, 1.0)),
            ((x0, s0, m0, 1.0), (x1, s1, m1, sign)),
        ):
            gx, identities = through_identities(gx)
            gemm = producer.get(gx)
            if (
                gemm is None
                or gemm.op_type != "Gemm"
                or len([i for i in gemm.input if i]) != 2
                or uses.get(gx) != 1
                or id(gemm) in removed
                or xx == gx
            ):
                continue
            if shapes is None:
                _, shapes = infer_types(graph, opset_imports)
            sg, sx = shapes.get(gx), shapes.get(xx)
            if sg is None or sg != sx or not all(isinstance(d, int) for d in sg):
                continue  # C must have the product's exact shape
            attrs = {a.name: helper.get_attribute_value(a) for a in gemm.attribute}
            alpha = float(attrs.get("alpha", 1.0)) * gs * gsign
            beta = xs * xsign  # the Gemm had no C, so its own beta played no part
            if float(np.float32(alpha)) != alpha or float(np.float32(beta)) != beta:
                continue  # Gemm's alpha/beta are float32 attributes: no silent rounding
            fused = helper.make_node(
                "Gemm",
                [gemm.input[0], gemm.input[1], xx],
                [node.output[0]],
                name=(gemm.name or "gemm") + "/fused_update",
                alpha=alpha,
                beta=beta,
                transA=int(attrs.get("transA", 0)),
                transB=int(attrs.get("transB", 0)),
            )
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
