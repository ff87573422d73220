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

``with_fused_kernels`` (the optional last step, ``passes.kernel_choice``)
replaces optimizer updates by the custom kernels of ``onnxtrain/kernels``,
bit for bit: the builder's Adam/AdamW (``fuse_adam_updates``) and the
lowered spec ops Adam, Momentum and Adagrad (``fuse_spec_optimizers``).
See docs/fused-kernels.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..core.graph import infer_types, node_inputs, overridable_inputs, read_counts, toposort
from ..errors import TrainingModelError


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
    producer = {o: n for n in nodes for o in n.output if o}
    uses = read_counts(nodes, (o.name for o in graph.output))
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
    graph: onnx.GraphProto, opset_imports: Sequence[onnx.OperatorSetIdProto], inferred=None
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
    uses = read_counts(nodes, (o.name for o in graph.output))
    types, shapes = inferred() if inferred else infer_types(graph, opset_imports)

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


# ------------------------------------------------- spec optimizer updates
#: Tensors with fewer elements than this (16 KiB of float32) share one
#: multi-tensor node per optimizer node (its variadic form): for them the
#: per-node cost of onnxruntime is a large part of the update.  Larger ones
#: get a node each, which onnxruntime runs as soon as that tensor's gradient
#: exists (while it is still in cache) instead of after the last gradient.
BATCH_BELOW = 4096


def _op(op_type: str, *args, keep: str | None = None):
    """Pattern: a default-domain node of ``op_type`` whose inputs match
    ``args`` (either order for Add and Mul); ``keep`` names its output as an
    output of the fused node (others may read it), else it is internal."""
    return ("op", op_type, args, keep)


def _tensor(var: str):
    """Pattern: any tensor, bound to ``var`` (the same name wherever ``var`` recurs)."""
    return ("tensor", var)


def _scalar(var: str):
    """Pattern: a tensor of one element (static shape), bound to ``var``."""
    return ("scalar", var)


def _ref(var: str, pattern):
    """Pattern: ``pattern`` the first time, then the very tensor it matched."""
    return ("ref", var, pattern)


def _alt(*patterns):
    """Pattern: the first of ``patterns`` that leads to a whole match."""
    return ("alt", patterns)


#: gr: the regularized gradient, nc*X + G where the lowering writes it
#: (norm_coefficient != 0, and the Gemm fusion did not fold it), else G.
_GR = _ref("GR", _alt(_op("Add", _op("Mul", _scalar("nc"), _tensor("X")), _tensor("G")), _tensor("G")))
_ADAM_STEP = _op(
    "Div",
    _op("Mul", _scalar("r"), _op("Add", _op("Mul", _scalar("alpha"), _tensor("V")),
                                 _op("Mul", _scalar("oma"), _GR), keep="V_new")),
    _op("Add",
        _op("Sqrt", _op("Add", _op("Mul", _scalar("beta"), _tensor("H")),
                        _op("Mul", _op("Mul", _scalar("omb"), _GR), _GR), keep="H_new")),
        _scalar("eps")),
)
_MOMENTUM_V = _ref("V1", _op("Add", _op("Mul", _scalar("alpha"), _tensor("V")),
                             _op("Mul", _scalar("beta"), _GR), keep="V_new"))
_ADAGRAD_STEP = _op(
    "Div",
    _op("Mul", _scalar("r"), _GR),
    _op("Add", _op("Sqrt", _op("Add", _tensor("H"), _op("Mul", _GR, _GR), keep="H_new")),
        _scalar("eps")),
)


@dataclass(frozen=True)
class _SpecKernel:
    """One fused op family: its pattern (rooted at the node writing X_new),
    scalar operands (in the kernel's order; nc and post optional), tensor
    inputs and outputs per optimized tensor."""

    op: str
    pattern: tuple
    scalars: tuple[str, ...]
    tensors: tuple[str, ...]
    outputs: tuple[str, ...]


#: Tried in this order: a larger pattern before one it contains.
_SPEC_KERNELS = (
    _SpecKernel("SpecAdam", _op("Mul", _scalar("post"), _op("Sub", _tensor("X"), _ADAM_STEP), keep="X_new"),
                ("alpha", "oma", "beta", "omb", "eps", "r", "nc", "post"), ("X", "G", "V", "H"),
                ("X_new", "V_new", "H_new")),
    _SpecKernel("SpecAdam", _op("Sub", _tensor("X"), _ADAM_STEP, keep="X_new"),
                ("alpha", "oma", "beta", "omb", "eps", "r", "nc", "post"), ("X", "G", "V", "H"),
                ("X_new", "V_new", "H_new")),
    _SpecKernel("Nesterov", _op("Sub", _tensor("X"), _op("Mul", _scalar("r"), _op(
                    "Add", _GR, _op("Mul", _scalar("alpha2"), _MOMENTUM_V))), keep="X_new"),
                ("alpha", "beta", "alpha2", "r", "nc"), ("X", "G", "V"), ("X_new", "V_new")),
    _SpecKernel("Momentum", _op("Sub", _tensor("X"), _op("Mul", _scalar("r"), _MOMENTUM_V), keep="X_new"),
                ("alpha", "beta", "r", "nc"), ("X", "G", "V"), ("X_new", "V_new")),
    _SpecKernel("Adagrad", _op("Sub", _tensor("X"), _ADAGRAD_STEP, keep="X_new"),
                ("eps", "r", "nc"), ("X", "G", "H"), ("X_new", "H_new")),
)
_OPTIONAL_SCALARS = ("nc", "post")
_SUFFIX = {TensorProto.FLOAT: "F32", TensorProto.DOUBLE: "F64"}


def fuse_spec_optimizers(
    graph: onnx.GraphProto, opset_imports: Sequence[onnx.OperatorSetIdProto], inferred=None
) -> int:
    """Replace the lowered per-tensor updates of the spec's Adam, Momentum
    (standard and Nesterov) and Adagrad by fused kernels (in place).

    ``optim/lower.py`` writes each optimized tensor's update as a chain of
    standard ops (Mul, Add, Sub, Div, Sqrt) over X, G, the state tensors and
    scalars it computes once per optimizer node (the learning rate, its bias
    correction, the attributes as Constants).  Each chain that matches one of
    ``_SPEC_KERNELS`` exactly becomes an operand of ``SpecAdam``,
    ``Momentum``, ``Nesterov`` or ``Adagrad`` (``F32``/``F64``), which computes
    the same IEEE operations in the same order: the scalars are the chain's
    own operands, so the values stay bit for bit the standard kernels'.

    Only exact matches are rewritten: X, G, the states and every value of the
    chain of one static shape (rank <= 8) and element type float or double;
    the scalars one element each; and nothing outside the chain reading its
    intermediates (the new X and states may have any readers).  Chains with
    the same scalar operands (one optimizer node) and fewer than
    ``BATCH_BELOW`` elements share one node; larger tensors get one each.
    Returns how many tensor updates were fused."""
    nodes = list(graph.node)
    roots = {k.pattern[1] for k in _SPEC_KERNELS}
    if not any(n.op_type in roots for n in nodes):
        return 0
    # Plain tuples: protobuf field access is slow, and patterns read each node often.
    view = [(n.op_type, n.domain, tuple(n.input), tuple(n.output)) for n in nodes]
    producer = {o: k for k, (_, _, _, outs) in enumerate(view) for o in outs if o}
    consumers: dict[str, list[int]] = {}
    for k, n in enumerate(nodes):
        for i in node_inputs(n):
            consumers.setdefault(i, []).append(k)
    graph_outputs = {o.name for o in graph.output}
    types: dict[str, int] = {}
    shapes: dict[str, tuple | None] = {}
    check_shapes = False  # off: a structural pre-pass, before any shape inference

    def static(name: str) -> tuple[int, ...] | None:
        s = shapes.get(name)
        return s if s is not None and all(isinstance(d, int) for d in s) else None

    def one_element(name: str) -> bool:
        if not check_shapes:
            return True
        s = static(name)
        return s is not None and math.prod(s) == 1

    def match(pattern, name: str, env: dict):
        """Every binding of ``pattern`` at ``name`` extending ``env`` (generator)."""
        kind = pattern[0]
        if kind in ("tensor", "scalar"):
            var = pattern[1]
            if var in env:
                if env[var] == name:
                    yield env
            elif kind == "tensor" or one_element(name):
                yield {**env, var: name}
        elif kind == "ref":
            var = pattern[1]
            if var in env:
                if env[var] == name:
                    yield env
            else:
                for found in match(pattern[2], name, env):
                    yield {**found, var: name}
        elif kind == "alt":
            for p in pattern[1]:
                yield from match(p, name, env)
        else:
            _, op_type, args, keep = pattern
            k = producer.get(name)
            if k is None:
                return
            node_op, domain, inputs, outputs = view[k]
            if (
                node_op != op_type
                or domain not in ("", "ai.onnx")
                or len(inputs) != len(args)
                or len(outputs) != 1
            ):
                return
            if keep is not None:
                if keep in env and env[keep] != name:
                    return
                env = {**env, keep: name}
            env = {**env, "__nodes": env.get("__nodes", ()) + (k,)}
            if op_type in ("Add", "Mul"):
                yield from match_all(args, inputs, env)
                yield from match_all(args[::-1], inputs, env)
            else:
                yield from match_all(args, inputs, env)

    def match_all(patterns, names, env):
        if not patterns:
            yield env
            return
        for found in match(patterns[0], names[0], env):
            yield from match_all(patterns[1:], names[1:], found)

    def valid(kernel: _SpecKernel, env: dict) -> bool:
        matched = set(env["__nodes"])
        kept = {env[o] for o in kernel.outputs}
        shape = static(env["X"])
        if shape is None or len(shape) > 8 or types.get(env["X"]) not in _SUFFIX:
            return False
        if any(static(env[t]) != shape for t in kernel.tensors):
            return False
        for k in matched:
            out = view[k][3][0]
            if static(out) != shape:
                return False  # a broadcast: not elementwise over X's shape
            if out not in kept and (
                out in graph_outputs or any(c not in matched for c in consumers.get(out, ()))
            ):
                return False  # an intermediate read elsewhere must stay computed
        return True

    def candidates(kernel: _SpecKernel):
        root = kernel.pattern[1]
        return [k for k, v in enumerate(view) if v[0] == root and len(v[3]) == 1]

    # Structure first: most programs have no optimizer chain, and then no
    # shape inference is spent on them.
    plausible = {
        id(kernel): [k for k in candidates(kernel) if next(match(kernel.pattern, view[k][3][0], {}), None)]
        for kernel in _SPEC_KERNELS
    }
    if not any(plausible.values()):
        return 0
    types, shapes = inferred() if inferred else infer_types(graph, opset_imports)
    check_shapes = True

    taken: set[int] = set()
    found: list[tuple[_SpecKernel, dict, int]] = []
    for kernel in _SPEC_KERNELS:
        for k in plausible[id(kernel)]:
            if k in taken:
                continue
            for env in match(kernel.pattern, view[k][3][0], {}):
                if valid(kernel, env) and not any(j in taken for j in env["__nodes"]):
                    taken.update(env["__nodes"])
                    found.append((kernel, env, k))
                    break
    if not found:
        return 0

    # Group: the same op, element type and scalar operands (one optimizer node).
    groups: dict[tuple, list[int]] = {}
    for k, (kernel, env, _) in enumerate(found):
        size = math.prod(static(env["X"]))
        scalars = tuple(env.get(s, "") for s in kernel.scalars)
        key = (kernel.op, types[env["X"]], scalars) if size < BATCH_BELOW else ("single", k)
        groups.setdefault(key, []).append(k)

    def rewrite(batches: list[list[int]]) -> list[onnx.NodeProto]:
        at: dict[int, onnx.NodeProto] = {}  # a batch sits where its last root was
        for batch in batches:
            kernel, env, root = found[batch[-1]]
            op = kernel.op + _SUFFIX[types[env["X"]]]
            inputs = [env.get(s, "") for s in kernel.scalars]
            outputs: list[str] = []
            for k in batch:
                _, e, _ = found[k]
                inputs += [e[t] for t in kernel.tensors]
                outputs += [e[o] for o in kernel.outputs]
            label = nodes[root].name or outputs[0]
            at[root] = helper.make_node(
                op, inputs, outputs, name=f"{label}/{op}" + ("_batched" if len(batch) > 1 else "_fused"),
                domain=KERNEL_DOMAIN,
            )
        out = [at.get(k, n) for k, n in enumerate(nodes) if k not in taken or k in at]
        available = [i.name for i in graph.input] + [t.name for t in graph.initializer]
        return toposort(out, available, where="fused program")

    try:
        ordered = rewrite(list(groups.values()))
    except TrainingModelError:
        # A batch that would feed itself (tensors of one optimizer node never
        # do): one node per tensor always keeps the graph acyclic.
        ordered = rewrite([[k] for k in range(len(found))])
    del graph.node[:]
    graph.node.extend(ordered)
    return len(found)


# ------------------------------------------------------ Adam's step size
_STEP_OPS = {TensorProto.FLOAT: "AdamStepSizeF32", TensorProto.DOUBLE: "AdamStepSizeF64"}


def fuse_adam_step_sizes(
    graph: onnx.GraphProto, opset_imports: Sequence[onnx.OperatorSetIdProto], inferred=None
) -> int:
    """Replace the spec Adam's step size, as ``optim/lower.py`` writes it in ten
    one-element kernels, by one ``AdamStepSize`` node (in place)::

        Where(Greater(t, zero),
              Div(Mul(r, Sqrt(Sub(one_h, Pow(beta, Cast(t))))),
                  Sub(one_v, Pow(alpha, Cast(t)))),
              r)

    On a small model these kernels are most of a step (issue 28's W3: 10 of
    19).  Matched exactly: every value float or double of one element (t and
    zero int64), the intermediates read by nothing else; the kernel does the
    same operations in the same order (optim_kernels.c), so the step size is
    bit for bit the standard kernels'.  Returns how many were fused."""
    nodes = list(graph.node)
    if not any(n.op_type == "Where" for n in nodes):
        return 0
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    consumers: dict[str, list[int]] = {}
    for k, n in enumerate(nodes):
        for i in node_inputs(n):
            consumers.setdefault(i, []).append(k)
    graph_outputs = {o.name for o in graph.output}

    def made_by(name: str, op_type: str, n_inputs: int) -> int | None:
        k = producer.get(name)
        if k is None:
            return None
        n = nodes[k]
        if n.op_type != op_type or n.domain not in ("", "ai.onnx") or len(n.input) != n_inputs or len(n.output) != 1:
            return None
        return k

    def chain_at(kw: int):
        """(chain node indices, kernel inputs, the Cast outputs) of a match at Where node kw."""
        cond, div, r = nodes[kw].input
        kg, kd = made_by(cond, "Greater", 2), made_by(div, "Div", 2)
        if kg is None or kd is None:
            return None
        t, zero = nodes[kg].input
        km, kv = made_by(nodes[kd].input[0], "Mul", 2), made_by(nodes[kd].input[1], "Sub", 2)
        if km is None or kv is None:
            return None
        a, b = nodes[km].input
        ks = made_by(b if a == r else a if b == r else "", "Sqrt", 1)
        kh = made_by(nodes[ks].input[0], "Sub", 2) if ks is not None else None
        if kh is None:
            return None
        (one_h, pow_h), (one_v, pow_v) = nodes[kh].input, nodes[kv].input
        kph, kpv = made_by(pow_h, "Pow", 2), made_by(pow_v, "Pow", 2)
        if kph is None or kpv is None:
            return None
        (beta, th), (alpha, tv) = nodes[kph].input, nodes[kpv].input
        kch, kcv = made_by(th, "Cast", 1), made_by(tv, "Cast", 1)
        if kch is None or kcv is None or nodes[kch].input[0] != t or nodes[kcv].input[0] != t:
            return None
        chain = {kw, kg, kd, km, kv, ks, kh, kph, kpv, kch, kcv}
        out = nodes[kw].output[0]
        for k in chain:
            o = nodes[k].output[0]
            if o != out and (o in graph_outputs or any(c not in chain for c in consumers.get(o, ()))):
                return None  # an intermediate read elsewhere must stay computed
        return chain, [r, t, one_h, beta, one_v, alpha, zero], (th, tv)

    found = [(kw, m) for kw, n in enumerate(nodes)
             if n.op_type == "Where" and n.domain in ("", "ai.onnx") and len(n.input) == 3
             and (m := chain_at(kw)) is not None]
    if not found:
        return 0
    types, shapes = inferred() if inferred else infer_types(graph, opset_imports)

    def one_element(name: str) -> bool:
        s = shapes.get(name)
        return s is not None and all(isinstance(d, int) for d in s) and math.prod(s) == 1

    rewritten: dict[int, onnx.NodeProto] = {}
    dropped: set[int] = set()
    for kw, (chain, inputs, casts) in found:
        et = types.get(inputs[0])
        if et not in _STEP_OPS or chain & dropped:
            continue
        floats = [inputs[0], *inputs[2:6], *casts]
        if any(types.get(x) != et for x in floats) or any(types.get(x) != TensorProto.INT64 for x in
                                                          (inputs[1], inputs[6])):
            continue
        if not all(one_element(x) for x in inputs):
            continue
        op = _STEP_OPS[et]
        out = nodes[kw].output[0]
        rewritten[kw] = helper.make_node(op, inputs, [out], name=f"{nodes[kw].name or out}/{op}",
                                         domain=KERNEL_DOMAIN)
        dropped |= chain
    if not rewritten:
        return 0
    kept = [rewritten.get(k, n) for k, n in enumerate(nodes) if k not in dropped or k in rewritten]
    del graph.node[:]
    graph.node.extend(kept)
    return len(rewritten)


def with_fused_kernels(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """A copy of ``model`` with its optimizer updates fused, and how many
    rewrites (0: ``model`` itself): the builder's Adam/AdamW updates
    (``fuse_adam_updates``), the lowered spec Adam, Momentum and Adagrad
    (``fuse_spec_optimizers``) and the spec Adam's step size
    (``fuse_adam_step_sizes``), and layer ops (``fuse_layers``: MaxPool with
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
    count = fuse_adam_updates(fused.graph, opsets, inferred)
    count += fuse_spec_optimizers(fused.graph, opsets, None if count else inferred)
    # (the step size's values are untouched by the rewrites above: the shared inference holds)
    count += fuse_adam_step_sizes(fused.graph, opsets, inferred)
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
