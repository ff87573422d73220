"""Reading training artifacts: ONNX Runtime training's, or the ones ``artifacts`` writes.

- ``forward_model``: the forward pass + loss of a training or eval model, as a
  standard ONNX model whose inputs are the user inputs then the parameters
  (ORT's eval model already has this form; from ORT's training model the
  gradient and accumulation nodes, ``com.microsoft`` ops, are cut away);
- ``optimizer_config``: the optimizer an optimizer model describes (ORT's
  ``AdamWOptimizer`` / ``SGDOptimizerV2`` / ``InplaceClipGradNorm`` node
  attributes, or the settings our own optimizer models carry as metadata);
- ``eval_mode``: a model with Dropout off and BatchNormalization on its
  running statistics (the eval model's form); ``running_statistics``: the
  running statistics a training-mode forward pass updates.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import onnx
from onnx import helper

from ..core.graph import DEFAULT_DOMAINS, batch_norm_training, node_inputs, opset_version, prune
from ..core.names import NameGen
from .standard_model import OPTIMIZER_KEY, OptimizerConfig

#: metadata key marking the models ``artifacts.generate_artifacts`` writes
KIND_KEY = "ort_training.kind"
ACCUMULATED = "_grad.accumulation.out"
STANDARD = ("", "ai.onnx", "ai.onnx.ml")


def load(path: str | os.PathLike, what: str) -> onnx.ModelProto:
    """Load an .onnx artifact; refuse ORT's flatbuffer format with a clear error."""
    p = Path(os.fspath(path))
    if not p.is_file():
        raise FileNotFoundError(f"{what}: no such file: {p}")
    with open(p, "rb") as f:
        head = f.read(8)
    if p.suffix == ".ort" or head[4:8] == b"ORTM":
        raise NotImplementedError(
            f"{what}: {p.name} is in ONNX Runtime's .ort format, which onnxtrain does not read; "
            "generate the artifacts with ort_format=False (the .onnx files)")
    return onnx.load(os.fspath(p))


def metadata(model: onnx.ModelProto) -> dict[str, str]:
    return {p.key: p.value for p in model.metadata_props}


def is_ort_training_model(model: onnx.ModelProto) -> bool:
    return any(o.name.endswith(ACCUMULATED) for o in model.graph.output) or any(
        i.name == "lazy_reset_grad" for i in model.graph.input)


def forward_model(model: onnx.ModelProto, parameters: set[str]) -> onnx.ModelProto:
    """The forward pass + loss of ``model`` (see the module docstring).

    Raises NotImplementedError naming the op when what remains is not
    standard ONNX (then the eval model is the way)."""
    if not is_ort_training_model(model):
        return model
    graph = model.graph
    outputs = [o for o in graph.output if not o.name.endswith(ACCUMULATED)]
    needed = {o.name for o in outputs}
    nodes = prune(list(graph.node), needed)
    needed = set(needed) | {i for n in nodes for i in n.input if i}
    for node in nodes:
        if node.domain not in STANDARD:
            raise NotImplementedError(
                f"the forward pass of this training model uses {node.domain}:{node.op_type} "
                f"(node {node.name or node.output[0]!r}), which standard ONNX Runtime does not run")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    for field in ("node", "output", "input", "initializer", "value_info"):
        g.ClearField(field)
    g.node.extend(nodes)
    g.output.extend(outputs)
    g.input.extend(i for i in graph.input if i.name in needed or i.name in parameters)
    g.initializer.extend(t for t in graph.initializer if t.name in needed)
    g.value_info.extend(v for v in graph.value_info if v.name in needed)
    used = {n.domain for n in nodes}
    kept = [o for o in out.opset_import if o.domain in used or o.domain in ("", "ai.onnx")]
    del out.opset_import[:]
    out.opset_import.extend(kept)
    return out


def eval_mode(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` in inference mode, as ``generate_artifacts`` makes
    the eval model: Dropout without its ``training_mode`` input (so off),
    BatchNormalization with ``training_mode=0`` and its Y output alone (its
    running statistics read, not updated).  1.19.2 keeps BatchNormalization's
    other outputs, which its own loader then refuses ("should be 1 when
    Training_mode = False")."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    read = {i for n in graph.node for i in node_inputs(n)} | {o.name for o in graph.output}
    for node in graph.node:
        if node.domain not in DEFAULT_DOMAINS:
            continue
        if node.op_type == "Dropout" and len(node.input) > 2:
            del node.input[2:]
        elif node.op_type == "BatchNormalization" and len(node.output) > 1:
            used = [o for o in node.output[1:] if o in read]
            if used:
                raise ValueError(f"eval model: BatchNormalization {node.name or node.output[0]!r} has "
                                 f"its training-mode output {used[0]!r} read: it cannot be put in "
                                 "inference mode")
            del node.output[1:]
            for a in node.attribute:
                if a.name == "training_mode":
                    a.i = 0
    return out


def running_statistics(model: onnx.ModelProto) -> dict[str, str]:
    """The running mean and variance that ``model``'s training-mode
    BatchNormalization nodes update: input name (an initializer or a graph
    input of ``model``) -> the node output holding its new value.  Outputs
    the node leaves unnamed are named here (``model`` changes in place)."""
    graph = model.graph
    opset = opset_version(model.opset_import)
    fixed = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    names = NameGen.from_graph(graph)
    found: dict[str, str] = {}
    for node in graph.node:
        if (node.op_type != "BatchNormalization" or node.domain not in DEFAULT_DOMAINS
                or not batch_norm_training(node, opset)):
            continue
        for k in (1, 2):  # outputs 1, 2: new running mean, variance (inputs 3, 4)
            stat = node.input[k + 2] if len(node.input) > k + 2 else ""
            if stat not in fixed or stat in found:
                continue
            while len(node.output) <= k:
                node.output.append("")
            if not node.output[k]:
                node.output[k] = names.fresh(f"{stat}/running")
            found[stat] = node.output[k]
    return found


def optimizer_config(model: onnx.ModelProto) -> OptimizerConfig:
    """The optimizer ``model`` describes (see the module docstring)."""
    meta = metadata(model)
    if OPTIMIZER_KEY in meta:
        cfg = json.loads(meta[OPTIMIZER_KEY])
        cfg["betas"] = tuple(cfg["betas"])
        return OptimizerConfig(**cfg)
    cfg: OptimizerConfig | None = None
    max_norm = None
    for node in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "AdamWOptimizer":
            if attrs.get("adam_mode", 0) != 1:
                raise NotImplementedError(
                    f"AdamWOptimizer adam_mode={attrs.get('adam_mode', 0)} (PyTorch's form) is not "
                    "supported; artifacts.generate_artifacts writes adam_mode=1")
            cfg = OptimizerConfig(
                "AdamW", (float(attrs.get("alpha", 0.9)), float(attrs.get("beta", 0.999))),
                float(attrs.get("epsilon", 1e-8)), float(attrs.get("weight_decay", 0.0)),
                bool(attrs.get("correct_bias", 1)))
        elif node.op_type in ("SGDOptimizerV2", "SGDOptimizer"):
            cfg = OptimizerConfig("SGD")
        elif node.op_type == "InplaceClipGradNorm":
            max_norm = float(attrs.get("max_norm", 1.0))
    if cfg is None:
        ops = sorted({f"{n.domain}:{n.op_type}" if n.domain else n.op_type for n in model.graph.node})
        raise ValueError(f"not an optimizer model: no AdamWOptimizer or SGDOptimizerV2 node "
                         f"(found {ops})")
    cfg.max_norm = max_norm
    return cfg
