"""Which weights LoRA can adapt, and which ``targets=None`` takes: the 2-D
floating weights read only as MatMul/Gemm operands, less a language model's
output head (peft's convention).  Used by ``lora`` to place adapters and by
``parameters`` to show each weight's part in ``build.parameter_choices``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import onnx
from onnx import helper

from ..core.emitter import FLOAT_TYPES
from ..core.graph import DEFAULT_DOMAINS, identity_source, node_inputs
from .known_names import is_lm_head, known_names


# ------------------------------------------------------------------ target selection
@dataclass
class Use:
    """One MatMul/Gemm read of a weight: node position, operand index, orientation."""

    position: int
    operand: int  # 0 (W on the left) or 1 (W on the right)
    transposed: bool  # W stored [out, in]


def attribute(node: onnx.NodeProto, name: str, default: Any) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def eligible_targets(graph: onnx.GraphProto) -> tuple[dict[str, list[Use]], dict[str, str]]:
    """(eligible weight -> its uses, other 2-D floating initializer -> why not).

    A weight is eligible when it is a 2-D floating-point initializer, not a
    graph input or output, and every read of it (through Identity chains)
    is a MatMul/Gemm operand 0 or 1 whose other operand is not an
    initializer, with the same orientation (``transposed``) in every use."""
    source = identity_source(graph)
    inits = {t.name: t for t in graph.initializer}
    floats2d = {n for n, t in inits.items() if t.data_type in FLOAT_TYPES and len(t.dims) == 2}
    uses: dict[str, list[Use]] = {n: [] for n in floats2d}
    why: dict[str, str] = {}
    for o in list(graph.output) + list(graph.input):
        name = source(o.name)
        if name in floats2d:
            why.setdefault(name, "it is a graph input or output")
    for position, n in enumerate(graph.node):
        kind = n.op_type if n.domain in DEFAULT_DOMAINS else f"{n.domain}.{n.op_type}"
        if kind == "Identity":
            continue
        explicit = list(n.input)
        for idx, name in enumerate(node_inputs(n)):
            w = source(name)
            if w not in floats2d:
                continue
            if idx >= len(explicit) or kind not in ("MatMul", "Gemm") or idx > 1:
                why.setdefault(w, f"it is read by {kind} node {n.name or kind!r} (input {idx}), "
                                  "not as a MatMul/Gemm weight")
                continue
            other = source(explicit[1 - idx])
            if other in inits:
                why.setdefault(w, f"{kind} node {n.name or kind!r} multiplies it with initializer "
                                  f"{other!r}, not with an activation")
                continue
            if kind == "MatMul":
                transposed = idx == 0
            else:
                flag = bool(attribute(n, "transA" if idx == 0 else "transB", 0))
                transposed = (idx == 0) != flag
            uses[w].append(Use(position, idx, transposed))
    out = {}
    for w in floats2d:
        if w in why:
            continue
        if not uses[w]:
            why[w] = "no MatMul or Gemm reads it"
            continue
        if len({u.transposed for u in uses[w]}) > 1:
            why[w] = "its MatMul/Gemm uses read it in both orientations"
            continue
        out[w] = uses[w]
    return out, why


def default_targets(graph: onnx.GraphProto, eligible: Mapping[str, Any],
                    known: Mapping[str, str] | None = None,
                    out_features: Mapping[str, int] | None = None) -> tuple[list[str], dict[str, str]]:
    """(the targets ``targets=None`` takes, in initializer order; eligible
    weights it leaves out -> why): every eligible weight but a language
    model's output head, as peft's ``all-linear`` (see ``known_names.is_lm_head``).
    ``out_features``: the output width of targets whose initializer is not
    the weight matrix itself (QLoRA's codes)."""
    known = dict(known_names(graph) if known is None else known)
    source = identity_source(graph)
    inits = {t.name: t for t in graph.initializer}
    vocab = {int(inits[source(n.input[0])].dims[0]) for n in graph.node
             if n.op_type == "Gather" and n.domain in DEFAULT_DOMAINS and n.input
             and source(n.input[0]) in inits and len(inits[source(n.input[0])].dims) == 2
             and inits[source(n.input[0])].data_type in FLOAT_TYPES}
    outputs = {o.name for o in graph.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)

    def reaches_output(value: str, depth: int = 0) -> bool:
        if value in outputs:
            return True
        return depth < 3 and any(
            n.op_type in ("Add", "Reshape", "Cast", "Identity", "Transpose", "Squeeze")
            and reaches_output(n.output[0], depth + 1) for n in readers.get(value, ()) if n.output)

    chosen, skipped = [], {}
    candidates = [t.name for t in graph.initializer if t.name in eligible]
    for w in candidates:
        use = eligible[w][0]
        node = graph.node[use.position]
        if out_features and w in out_features:  # quantized codes: their own layout
            out_dim = out_features[w]
        else:
            dims = list(inits[w].dims)
            out_dim = dims[0] if use.transposed else dims[1]
        head = is_lm_head(w, known, vocab, out_dim, any(reaches_output(o) for o in node.output))
        if head and len(candidates) > 1:
            skipped[w] = "the output head of a language model (peft's default leaves it out)"
        else:
            chosen.append(w)
    # reaches_output calls itself through its closure cell: a cycle that would
    # keep this graph alive until the cycle collector runs.  Done with it:
    reaches_output = None  # noqa: F841
    return chosen, skipped
