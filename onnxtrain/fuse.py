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
from onnx import TensorProto, helper, numpy_helper

from .graph import infer_types, node_inputs, toposort


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


# ----------------------------------------------------------------- Adam update
#: Domain of the fused kernels of ``onnxtrain/kernels`` (an onnxruntime
#: custom-op library, registered by the executor).
KERNEL_DOMAIN = "ai.onnxtrain.kernels"
_ADAM_OPS = {TensorProto.FLOAT: "AdamUpdateF32", TensorProto.DOUBLE: "AdamUpdateF64"}


def fuse_adam_updates(
    graph: onnx.GraphProto, opset_imports: Sequence[onnx.OperatorSetIdProto]
) -> int:
    """Replace every per-parameter Adam/AdamW update by one fused kernel (in place).

    The pattern is the update ``build.Adam``/``build.AdamW`` write, with any
    operand order of the commutative ops and scalars of one element::

        m' = b1*m + c1*g
        v' = b2*v + c2*(g*g)
        p' = [p*decay] - step * (m' / (Sqrt(v') + eps))

    It becomes ``AdamUpdateF32/F64(p, g, m, v, b1, c1, b2, c2, eps, step,
    decay) -> p', m', v'`` (decay is a constant 1 where the pattern has none),
    which computes the same IEEE operations in the same order in one pass.

    Only exact matches are rewritten: float32/float64 tensors of one static
    shape with more than one element, and intermediates that nothing else
    reads (m' and v' may have other readers).  Returns how many updates."""
    nodes = list(graph.node)
    if not any(n.op_type == "Sqrt" for n in nodes):
        return 0
    producer = {o: n for n in nodes for o in n.output if o}
    uses: dict[str, int] = {}
    for n in nodes:
        for i in node_inputs(n):
            uses[i] = uses.get(i, 0) + 1
    for o in graph.output:
        uses[o.name] = uses.get(o.name, 0) + 1
    types, shapes = infer_types(graph, opset_imports)

    def static(name: str) -> tuple[int, ...] | None:
        s = shapes.get(name)
        return s if s is not None and all(isinstance(d, int) for d in s) else None

    def is_scalar(name: str) -> bool:
        s = static(name)
        return s is not None and int(np.prod(s, dtype=np.int64)) == 1

    def made_by(name: str, op_type: str, single_use: bool = True) -> onnx.NodeProto | None:
        n = producer.get(name)
        if (
            n is None
            or n.op_type != op_type
            or n.domain not in ("", "ai.onnx")
            or len(n.input) != (1 if op_type == "Sqrt" else 2)
            or (single_use and uses.get(name) != 1)
        ):
            return None
        return n

    def scaled(name: str) -> tuple[str, str, onnx.NodeProto] | None:
        """(scalar, tensor, node) of a single-use Mul(scalar, tensor)."""
        n = made_by(name, "Mul")
        if n is None:
            return None
        a, b = n.input
        if is_scalar(a) and not is_scalar(b):
            return a, b, n
        if is_scalar(b) and not is_scalar(a):
            return b, a, n
        return None

    def either(name: str, match):
        """Match a commutative binary op: match(first, second) on both orders."""
        for x, y in ((0, 1), (1, 0)):
            found = match(name[x], name[y])
            if found is not None:
                return found
        return None

    def second_moment(vn: str):
        """v' = b2*v + c2*(g*g) -> (b2, v, c2, g, nodes)."""
        add = made_by(vn, "Add", single_use=False)
        if add is None:
            return None

        def match(t_v: str, t_g: str):
            sv, sg = scaled(t_v), scaled(t_g)
            if sv is None or sg is None:
                return None
            sq = made_by(sg[1], "Mul")
            if sq is None or sq.input[0] != sq.input[1]:
                return None
            return sv[0], sv[1], sg[0], sq.input[0], [add, sv[2], sg[2], sq]

        return either(add.input, match)

    def first_moment(mn: str, g: str):
        """m' = b1*m + c1*g -> (b1, m, c1, nodes)."""
        add = made_by(mn, "Add", single_use=False)
        if add is None:
            return None

        def match(t_m: str, t_g: str):
            sm, sg = scaled(t_m), scaled(t_g)
            if sm is None or sg is None or sg[1] != g or sm[1] == g:
                return None
            return sm[0], sm[1], sg[0], [add, sm[2], sg[2]]

        return either(add.input, match)

    def update(sub: onnx.NodeProto):
        """p' = pd - step * (m' / (Sqrt(v') + eps)) -> the fused node's operands."""
        if sub.op_type != "Sub" or sub.domain not in ("", "ai.onnx") or len(sub.input) != 2:
            return None
        pd, x = sub.input
        step_mul = made_by(x, "Mul")
        if step_mul is None:
            return None

        def match_step(step: str, q: str):
            div = made_by(q, "Div")
            return None if div is None or not is_scalar(step) else (step, div)

        found = either(step_mul.input, match_step)
        if found is None:
            return None
        step, div = found
        mn, den = div.input
        den_add = made_by(den, "Add")
        if den_add is None:
            return None

        def match_den(s: str, eps: str):
            sq = made_by(s, "Sqrt")
            return None if sq is None or not is_scalar(eps) else (sq, eps)

        found = either(den_add.input, match_den)
        if found is None:
            return None
        sqrt, eps = found
        vn = sqrt.input[0]
        second = second_moment(vn)
        if second is None:
            return None
        b2, v, c2, g, v_nodes = second
        first = first_moment(mn, g)
        if first is None:
            return None
        b1, m, c1, m_nodes = first
        p, decay, p_nodes = pd, None, []
        decayed = scaled(pd)
        if decayed is not None:
            decay, p, p_nodes = decayed[0], decayed[1], [decayed[2]]
        shape = static(sub.output[0])
        et = types.get(p)
        if (
            shape is None
            or int(np.prod(shape, dtype=np.int64)) <= 1
            or any(static(t) != shape for t in (p, g, m, v, mn, vn))
            or et not in _ADAM_OPS
            or len({p, g, m, v}) != 4
        ):
            return None
        matched = [sub, step_mul, div, den_add, sqrt, *v_nodes, *m_nodes, *p_nodes]
        return et, [p, g, m, v, b1, c1, b2, c2, eps, step, decay], [sub.output[0], mn, vn], matched

    taken: set[str] = {t.name for t in graph.initializer} | {i.name for i in graph.input}
    taken |= set(producer)
    ones: dict[int, str] = {}

    def one(et: int) -> str:
        if et not in ones:
            name, k = "adam_fused/one", 0
            while name in taken:
                k += 1
                name = f"adam_fused/one_{k}"
            taken.add(name)
            graph.initializer.append(
                numpy_helper.from_array(np.array(1, dtype=helper.tensor_dtype_to_np_dtype(et)), name)
            )
            ones[et] = name
        return ones[et]

    removed: set[int] = set()
    replaced: dict[int, onnx.NodeProto] = {}
    for node in nodes:
        if id(node) in removed:
            continue
        found = update(node)
        if found is None or any(id(n) in removed for n in found[3]):
            continue
        et, inputs, outputs, matched = found
        if inputs[-1] is None:
            inputs[-1] = one(et)
        replaced[id(node)] = helper.make_node(
            _ADAM_OPS[et], inputs, outputs, name=(node.name or outputs[0]) + "/adam_fused",
            domain=KERNEL_DOMAIN,
        )
        removed.update(id(n) for n in matched)
    if not replaced:
        return 0
    out = [replaced[id(n)] if id(n) in replaced else n for n in nodes if id(n) not in removed or id(n) in replaced]
    available = [i.name for i in graph.input] + [t.name for t in graph.initializer]
    del graph.node[:]
    graph.node.extend(toposort(out, available, where="fused program"))
    return len(replaced)


def with_fused_kernels(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """A copy of ``model`` with its Adam updates fused, and how many (0: ``model`` itself)."""
    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    count = fuse_adam_updates(fused.graph, list(fused.opset_import))
    if not count:
        return model, 0
    fused.opset_import.append(helper.make_opsetid(KERNEL_DOMAIN, 1))
    return fused, count
