"""Regenerate tests/data/folding/: small PyTorch exports with and without a folded BatchNorm.

What ``onnxtrain inspect``, ``make-training`` and ``build.training_model``
say about BatchNorm folding (``onnxtrain.builder.folding``) is tested on
these: real exports of tiny models (a few channels, seeded weights), each
in the configurations a user meets:

- ``dynamo``: ``torch.onnx.export(model.eval(), dynamo=True)`` with its
  default ``optimize=True`` (onnxscript's rewriter fuses BatchNorm into the
  Conv or Gemm before it and records the rule in the node's metadata);
- ``dynamo_noopt``: the same with ``optimize=False`` (BatchNorm kept);
- ``torchscript``: ``dynamo=False`` in eval mode (its constant folding
  fuses BatchNorm into a Conv, whose weight and bias become ``onnx::Conv_N``);
- ``torchscript_preserve``: ``dynamo=False, training=TrainingMode.PRESERVE``
  with the model in training mode (BatchNorm kept).

``manifest.json`` records, per file, whether the export folded a BatchNorm:
the ground truth, read from the torch model (it has BatchNorm modules) and
the export (fewer BatchNormalization nodes than modules).  Node metadata
``pkg.torch.onnx.stack_trace`` (source paths of the machine that exported)
is dropped to keep the files small; everything else is as exported.

    pip install torch==2.13.0 onnxscript
    python scripts/make_folding_corpus.py
"""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import onnx
import torch

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "folding"
nn = torch.nn


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))


def mlp_bn() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 3))


def cnn_bn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 36, 3))


def cnn_bn_bias() -> nn.Module:
    """A Conv with its own bias before the BatchNorm: dynamo keeps the bias's name."""
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 36, 3))


def cnn_bn_mixed() -> nn.Module:
    """One BatchNorm after a Conv (folded), one after a ReLU (kept)."""
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 36, 3))


#: model -> (factory, input shape, exporters)
CASES = {
    "mlp": (mlp, (4, 5), ("dynamo", "torchscript")),
    "mlp_bn": (mlp_bn, (4, 5), ("dynamo", "dynamo_noopt", "torchscript")),
    "cnn": (cnn, (2, 3, 6, 6), ("dynamo", "torchscript")),
    "cnn_bn": (cnn_bn, (2, 3, 6, 6), ("dynamo", "dynamo_noopt", "torchscript", "torchscript_preserve")),
    "cnn_bn_bias": (cnn_bn_bias, (2, 3, 6, 6), ("dynamo", "torchscript")),
    "cnn_bn_mixed": (cnn_bn_mixed, (2, 3, 6, 6), ("dynamo",)),
}


def export(model: nn.Module, x: torch.Tensor, exporter: str) -> onnx.ModelProto:
    if exporter.startswith("dynamo"):
        prog = torch.onnx.export(model.eval(), (x,), input_names=["x"], output_names=["logits"],
                                 dynamo=True, optimize=exporter == "dynamo", verbose=False,
                                 dynamic_shapes=({0: torch.export.Dim("batch")},))
        return prog.model_proto
    buf = io.BytesIO()
    options = dict(input_names=["x"], output_names=["logits"], dynamo=False,
                   dynamic_axes={"x": {0: "batch"}})
    if exporter == "torchscript_preserve":
        torch.onnx.export(model.train(), (x,), buf, training=torch.onnx.TrainingMode.PRESERVE,
                          do_constant_folding=False, **options)
    else:
        torch.onnx.export(model.eval(), (x,), buf, **options)
    return onnx.load_from_string(buf.getvalue())


def strip_stack_traces(proto: onnx.ModelProto) -> None:
    for node in proto.graph.node:
        kept = [p for p in node.metadata_props if p.key != "pkg.torch.onnx.stack_trace"]
        del node.metadata_props[:]
        node.metadata_props.extend(kept)


def main() -> None:
    warnings.filterwarnings("ignore")
    OUT.mkdir(parents=True, exist_ok=True)
    cases = []
    for name, (factory, shape, exporters) in CASES.items():
        torch.manual_seed(0)
        model = factory()
        x = torch.randn(*shape)
        modules = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        for exporter in exporters:
            proto = export(model, x, exporter)
            strip_stack_traces(proto)
            kept = sum(n.op_type == "BatchNormalization" for n in proto.graph.node)
            file = f"{name}__{exporter}.onnx"
            onnx.save(proto, str(OUT / file))
            cases.append({"file": file, "model": name, "exporter": exporter,
                          "batchnorm_modules": modules, "batchnorm_nodes": kept,
                          "folded": kept < modules})
            print(f"{file}: {modules} BatchNorm module(s), {kept} kept")
    import onnxscript

    versions = {"torch": torch.__version__, "onnxscript": onnxscript.__version__, "onnx": onnx.__version__}
    manifest = {"versions": versions, "cases": cases}
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
