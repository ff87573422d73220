"""Export the PyTorch-defined benchmark workloads (W5, W6) to ONNX.

    benchmarks/.venv-ort-training/bin/python benchmarks/export_models.py OUTDIR [W5 W6]

Run in an environment with torch, torchvision and transformers (run.py and
``workloads.py`` call it with ``benchmarks/.venv-ort-training``'s Python,
which ``setup_ort_training.sh`` equips with them).  For each workload it
builds the torch module (``torch_models.py``) from a fixed seed, gives every
weight and BatchNormalization statistic distinct values (below), and writes

- ``OUTDIR/<key>.onnx``: ``torch.onnx.export`` of the module in eval mode
  (TorchScript exporter, ``dynamo=False``; opset 17, IR 8 so that onnx 1.16
  and onnxruntime-training 1.19 load it; static shapes; no constant folding,
  so BatchNormalization stays a node of its own and weights keep their
  names).  Every trainer runs BatchNormalization in training mode itself
  (onnxtrain's builder with ``train_mode=True``, the hand-built model, ORT
  training's artifacts, torch's ``module.train()``);
- ``OUTDIR/<key>.json``: the export's torch and exporter versions.

The ONNX initializers are named as the module's ``state_dict`` keys (checked
here), so ``torch_models.build`` loads them back by name.

Distinct values: the TorchScript exporter stores equal initializers once and
reads the copies through Identity nodes; with torch's default init every
LayerNorm weight (ones), every bias initialised to zero and every
BatchNormalization statistic of one width would be one tensor, trained as one
by ORT training and the hand-built model.  So they are drawn afresh (small
random offsets), as W4's biases are.

``workloads.py`` keys its cache on this file's content: editing it re-exports.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

OPSET = 17
IR_VERSION = 8


def _distinct(module, seed: int) -> None:
    """Replace constant-initialised tensors (LayerNorm/BatchNorm affine parameters,
    zero biases, BatchNorm running statistics) with distinct values near them."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if not t.is_floating_point():
                continue
            if name.endswith("running_var"):
                t.copy_(1.0 + 0.2 * torch.rand(t.shape, generator=g))
            elif name.endswith("running_mean"):
                t.copy_(0.1 * (torch.rand(t.shape, generator=g) - 0.5))
            elif t.dim() == 1 and name.endswith("weight"):  # norm scales (ones)
                t.copy_(1.0 + 0.2 * (torch.rand(t.shape, generator=g) - 0.5))
            elif t.dim() == 1 and name.endswith("bias"):
                t.add_(0.04 * (torch.rand(t.shape, generator=g) - 0.5))


def _declare_layernorm_stats(model) -> None:
    """Give every LayerNormalization its optional Mean and InvStdDev outputs.

    ORT training's LayerNormalization gradient reads them (without them
    ``generate_artifacts`` fails in its gradient builder); declaring outputs
    no node reads changes nothing else (W4 declares them too)."""
    for node in model.graph.node:
        if node.op_type == "LayerNormalization" and len(node.output) == 1:
            node.output.extend([node.output[0] + "_mean", node.output[0] + "_invstd"])


def export(key: str, outdir: Path) -> None:
    import onnx
    import torch
    import torch_models
    from workloads import WORKLOADS

    w = WORKLOADS[key]
    module = torch_models.create(key, w.seed)
    _distinct(module, w.seed)
    module.eval()
    example = tuple(torch.from_numpy(a) for a in w.extra["example_inputs"]())
    path = outdir / f"{key}.onnx"
    tmp = path.with_suffix(".onnx.tmp")
    torch.onnx.export(
        module, example, str(tmp), dynamo=False, opset_version=OPSET,
        input_names=list(w.extra["inputs"]), output_names=[w.output],
        do_constant_folding=False, training=torch.onnx.TrainingMode.EVAL,
        export_params=True, keep_initializers_as_inputs=False,
    )
    model = onnx.load(str(tmp))
    model.ir_version = IR_VERSION
    _declare_layernorm_stats(model)
    state = {k: v for k, v in module.state_dict().items() if v.is_floating_point()}
    inits = [t.name for t in model.graph.initializer]
    unknown = [n for n in inits if n not in state]
    if unknown:
        raise SystemExit(f"{key}: initializers that are not state_dict entries: {unknown[:5]}")
    missing = [n for n, p in module.named_parameters() if n not in inits]
    if missing:
        raise SystemExit(f"{key}: parameters the export does not hold as initializers "
                         f"(shared or folded): {missing[:5]}")
    onnx.checker.check_model(model)
    onnx.save(model, str(tmp))
    tmp.replace(path)
    (outdir / f"{key}.json").write_text(json.dumps(
        {"torch": torch.__version__, "opset": OPSET, "ir_version": IR_VERSION,
         "exporter": "torch.onnx.export(dynamo=False)"}))


def main(argv: list[str]) -> int:
    # torchvision's registry wheel is a CUDA build: its compiled operator
    # registrations cannot load here; the model definitions are pure Python.
    sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("stub"))
    import warnings

    warnings.filterwarnings("ignore")
    outdir = Path(argv[0])
    outdir.mkdir(parents=True, exist_ok=True)
    for key in argv[1:] or ["W5", "W6"]:
        export(key, outdir)
        print(f"exported {key} -> {outdir / (key + '.onnx')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
