"""Evidence that an exporter folded a BatchNorm into the layer before it.

An eval-mode ``torch.onnx.export`` is made for inference: it may fuse each
BatchNorm into the Conv (or Linear) before it.  The fused model trains, but
not as PyTorch trains the model (no batch statistics, no running averages),
so the user is told, where the model is inspected and where it is built.
The hint fires on evidence of folding only, never on the producer's name:

- **dynamo** (``optimize=True``, its default): onnxscript's rewriter names
  the rule on the node it made, metadata ``pkg.onnxscript.rewriter.rule_name``
  ``FuseBatchNormIntoConv`` (``...IntoGemm``, ``...IntoConvTranspose``);
  the fused Conv/Gemm also carries the BatchNorm's records: its
  ``pkg.torch.onnx.class_hierarchy`` / ``namespace`` name the
  ``torch.nn.modules.batchnorm.BatchNorm2d`` module, and ``name_scopes``
  its path.  The bias keeps its name (a Conv's own bias) or gets a new one.
- **TorchScript** (eval mode): constant folding computes the Conv's bias
  from the BatchNorm, an initializer named ``onnx::Conv_N`` instead of the
  module's parameter (``0.bias``).

Exports that keep BatchNorm (``dynamo=True, optimize=False``, TorchScript's
``TrainingMode.PRESERVE``) and models that never had one give no evidence.

>>> from onnx import helper
>>> def conv_model(bias):
...     conv = helper.make_node("Conv", ["x", "0.weight", bias], ["y"], name="/0/Conv")
...     bias_tensor = helper.make_tensor(bias, onnx.TensorProto.FLOAT, [1], [0.0])
...     return helper.make_model(helper.make_graph([conv], "g", [], [], [bias_tensor]))
>>> folded_batchnorm(conv_model("onnx::Conv_16"))
["'/0/Conv': its bias 'onnx::Conv_16' is a constant the exporter computed"]
>>> folded_batchnorm(conv_model("0.bias"))
[]
"""

from __future__ import annotations

import re

import onnx

from .cache import warn
from .known_names import module_of

#: The ops an exporter folds a BatchNorm into.
_FUSED_INTO = {"Conv", "ConvTranspose", "Gemm", "MatMul"}
#: A torch BatchNorm module class in node metadata (BatchNorm1d/2d/3d, SyncBatchNorm, ...).
_BATCHNORM_CLASS = re.compile(r"torch\.nn\.modules\.batchnorm\.(\w*BatchNorm\w*)")

HINT_FIX = ("to fine-tune it as PyTorch does, export with dynamo=True, optimize=False (or "
            "dynamo=False, training=TrainingMode.PRESERVE) and a dynamic batch dimension "
            "(docs/compatibility.md)")


class FoldedBatchNormWarning(UserWarning):
    """``build.training_model`` on a model whose BatchNorms the exporter folded."""


def _metadata(node: onnx.NodeProto) -> dict[str, str]:
    return {p.key: p.value for p in node.metadata_props}


def _evidence(node: onnx.NodeProto, folded_constants: set[str]) -> list[str]:
    """What says that a BatchNorm was folded into ``node`` (empty: nothing)."""
    if node.op_type not in _FUSED_INTO or node.domain not in ("", "ai.onnx"):
        return []
    meta = _metadata(node)
    found = []
    rules = [r.strip() for r in meta.get("pkg.onnxscript.rewriter.rule_name", "").split(",")]
    fused = sorted({r for r in rules if r.startswith("FuseBatchNorm")})
    found += fused
    records = " ".join(meta.get(k, "") for k in ("pkg.torch.onnx.class_hierarchy", "namespace"))
    cls = _BATCHNORM_CLASS.search(records)
    if cls:
        module = module_of(node)
        found.append(f"from {cls.group(1)} {module!r}" if module else f"from a {cls.group(1)}")
    if node.op_type in ("Conv", "ConvTranspose") and len(node.input) > 2 and node.input[2] in folded_constants:
        found.append(f"its bias {node.input[2]!r} is a constant the exporter computed")
    return found


def folded_batchnorm(model: onnx.ModelProto) -> list[str]:
    """One entry per node that a BatchNorm was folded into: the node and the
    evidence (see the module doc); empty when there is none."""
    graph = model.graph
    # TorchScript names the tensors its constant folding computed onnx::<Op>_<n>.
    folded_constants = {t.name for t in graph.initializer if t.name.startswith("onnx::")}
    out = []
    for node in graph.node:
        found = _evidence(node, folded_constants)
        if found:
            out.append(f"{node.name or node.op_type!r}: {', '.join(found)}")
    return out


def batchnorm_hint(model: onnx.ModelProto) -> str | None:
    """The one-line hint for a model with folded BatchNorms, or None.

    >>> batchnorm_hint(onnx.ModelProto()) is None
    True
    """
    folded = folded_batchnorm(model)
    if not folded:
        return None
    more = f"; and {len(folded) - 1} more node(s)" if len(folded) > 1 else ""
    return (f"hint: the exporter folded BatchNorm into the layer before it (at {folded[0]}{more}), "
            "so it will not train as in PyTorch (no batch statistics, no running averages); "
            + HINT_FIX)


def warn_if_folded(model: onnx.ModelProto, stacklevel: int) -> None:
    """A FoldedBatchNormWarning with ``batchnorm_hint``'s text, if it has one."""
    hint = batchnorm_hint(model)
    if hint:
        warn("training_model: " + hint.removeprefix("hint: "), FoldedBatchNormWarning,
             stacklevel=stacklevel + 1)
