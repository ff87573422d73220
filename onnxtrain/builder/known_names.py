"""The names users know weights by, read from the exporter's own records.

torch's dynamo exporter stores ``x @ W.T`` as ``MatMul(x, val_41)`` with
``val_41`` a new, transposed initializer; the TorchScript exporter names it
``onnx::MatMul_343``.  Both record where each node came from:

- dynamo: node metadata ``pkg.torch.onnx.name_scopes``, the list of module
  paths down to the op (``[..., "model.layers.0.self_attn.q_proj",
  "linear"]``), and ``pkg.torch.onnx.fx_node``, which names the parameters
  the op read (``%p_model_layers_0_self_attn_q_proj_weight``);
- TorchScript: the node name, ``/model/layers.0/self_attn/q_proj/MatMul``.

``known_names`` gives such an initializer the PyTorch name of the parameter
it holds (``model.layers.0.self_attn.q_proj.weight``): the module read off
the node that multiplies with it (MatMul/Gemm/Conv weight: ``weight``; Gemm
or Conv bias, or an Add right after the product: ``bias``; the fx node's
parameter list decides where it names one).  Initializers whose names
already are dotted parameter names keep them.

``matches(entry, name, known)`` is how ``LoRA(targets=[...])`` and
``trainable=[...]`` entries select: the initializer's own name, its known
name, or a module path or suffix of it as peft matches ``target_modules``
(``"q_proj"`` selects every ``...q_proj.weight``).
"""

from __future__ import annotations

import ast
import re

import onnx

from ..core.graph import DEFAULT_DOMAINS

_PRODUCT_WEIGHT = {("MatMul", 1), ("MatMul", 0), ("Gemm", 0), ("Gemm", 1), ("Conv", 1),
                   ("ConvTranspose", 1)}
_PRODUCT_BIAS = {("Gemm", 2), ("Conv", 2), ("ConvTranspose", 2)}
_THROUGH = {"Transpose", "Identity", "Cast", "Reshape"}


def _scopes(node: onnx.NodeProto) -> list[str] | None:
    """The module paths of dynamo's ``name_scopes``, outermost first (None: no record)."""
    for p in node.metadata_props:
        if p.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = ast.literal_eval(p.value)
            except (ValueError, SyntaxError):
                return None
            return [s for s in scopes[:-1] if isinstance(s, str) and s]
    return None


def module_of(node: onnx.NodeProto) -> str | None:
    """The dotted module path a node was exported from, or None."""
    scopes = _scopes(node)
    if scopes is not None:
        return scopes[-1] if scopes else None
    if node.name.startswith("/") and node.name.count("/") >= 2:
        return ".".join(node.name.split("/")[1:-1]) or None
    return None


def fx_placeholders(node: onnx.NodeProto) -> list[str]:
    """The parameters (``p_...``) and buffers (``b_...``) that dynamo's record
    of ``node`` (``pkg.torch.onnx.fx_node``) says it read, in argument order:
    ``%p_model_norm_weight`` -> ``p_model_norm_weight``."""
    for p in node.metadata_props:
        if p.key == "pkg.torch.onnx.fx_node":
            return re.findall(r"%([pb]_\w+)", p.value)
    return []


def placeholder_name(node: onnx.NodeProto, placeholder: str) -> str:
    """The dotted PyTorch name of a placeholder ``node`` read: the deepest of
    its modules whose mangled path starts it, then the attribute
    (``p_model_layers_0_norm_weight`` read in ``model.layers.0.norm`` ->
    ``model.layers.0.norm.weight``); the mangled name when no module fits."""
    body = placeholder[2:]
    for module in reversed(_scopes(node) or []):
        mangled = module.replace(".", "_") + "_"
        if body.startswith(mangled) and len(body) > len(mangled):
            return f"{module}.{body[len(mangled):]}"
    return body


def _fx_params(node: onnx.NodeProto) -> list[str]:
    return [p[2:] for p in fx_placeholders(node) if p.startswith("p_")]


def _from_initializer(value: str, inits: set[str], producer: dict[str, onnx.NodeProto]) -> bool:
    """An initializer, possibly through Transpose/Identity/Cast/Reshape nodes."""
    for _ in range(4):
        if value in inits:
            return True
        n = producer.get(value)
        if n is None or n.op_type not in _THROUGH or not n.input:
            return False
        value = n.input[0]
    return value in inits


def known_names(graph: onnx.GraphProto) -> dict[str, str]:
    """initializer -> the PyTorch parameter name it holds, where the exporter's
    records tell (initializers with dotted names map to themselves)."""
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for n in graph.node:
        for i, x in enumerate(n.input):
            if x:
                readers.setdefault(x, []).append((n, i))
    inits = {t.name for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output if o}
    out: dict[str, str] = {}
    for t in graph.initializer:
        name = t.name
        if "." in name and not name.startswith("onnx::"):
            out[name] = name
            continue
        # Follow the value through layout ops to the node that uses it.
        frontier, seen = [name], set()
        found = None
        while frontier and found is None:
            v = frontier.pop()
            if v in seen:
                continue
            seen.add(v)
            for n, i in readers.get(v, ()):
                if n.domain not in DEFAULT_DOMAINS:
                    continue
                if n.op_type in _THROUGH and i == 0:
                    frontier.extend(o for o in n.output if o)
                    continue
                attr = None
                if (n.op_type, i) in _PRODUCT_WEIGHT:
                    attr = "weight"
                elif (n.op_type, i) in _PRODUCT_BIAS:
                    attr = "bias"
                elif n.op_type == "Add" and len(n.input) == 2:
                    other = n.input[1 - i]
                    prod = producer.get(other)
                    # a bias follows a product with a weight (x @ W), not q @ k^T
                    if prod is not None and prod.op_type in ("MatMul", "Gemm", "Conv") and any(
                            _from_initializer(x, inits, producer) for x in prod.input[:2]):
                        attr = "bias"
                module = module_of(n)
                if attr and module:
                    mangled = module.replace(".", "_") + "_"
                    listed = [p[len(mangled):] for p in _fx_params(n) if p.startswith(mangled)]
                    if listed and attr not in listed and len(listed) == 1:
                        attr = listed[0]
                    found = f"{module}.{attr}"
                    break
        if found is not None:
            out[name] = found
    return out


def matches(entry: str, name: str, known: dict[str, str]) -> bool:
    """Whether a user's ``entry`` selects initializer ``name``: its own name, its
    known name, or a trailing dotted part of the known name or of its module
    (``q_proj``, ``self_attn.q_proj``, ``q_proj.weight``)."""
    if entry == name:
        return True
    full = known.get(name)
    if not full:
        return False
    module = full.rsplit(".", 1)[0]
    return any(k == entry or k.endswith("." + entry) for k in (full, module))


def is_lm_head(name: str, known: dict[str, str], vocab_sizes: set[int], out_dim: int | None,
               feeds_output: bool) -> bool:
    """The output embedding of a language model: known as ``...lm_head.weight``,
    or a product producing a graph output whose width is the vocabulary size
    (the row count of a table an embedding lookup reads)."""
    full = known.get(name, "")
    if full.rsplit(".", 1)[0].split(".")[-1] in ("lm_head", "embed_out", "output_projection"):
        return True
    return feeds_output and out_dim is not None and out_dim in vocab_sizes
