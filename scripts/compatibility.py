"""Write docs/compatibility.md: exporter x model -> grad / train / export status.

Runs with only onnxtrain and onnxruntime installed (no torch, no scikit-learn):
it reads the committed corpus in tests/data/exporters/ and runs the checks of
tests/builder/test_exporter_corpus.py on every case::

    python scripts/compatibility.py            # rewrites docs/compatibility.md

Each cell is "pass", "fail" with the first line of the error, or where the
framework's training has no counterpart in the export "n/a" (grad) and
"partial" (train: only the sanity checks ran); the notes say why.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "compatibility.md"

#: How to export a PyTorch model for fine-tuning (written into the doc as is).
EXPORT_GUIDE = """
## Exporting a PyTorch model for fine-tuning

An eval-mode `torch.onnx.export` is made for inference: the dynamo exporter's
default `optimize=True`, like TorchScript's constant folding, folds each
BatchNormalization into the Conv before it. The folded model trains, but not
as PyTorch does (no batch statistics, no running averages: the fused rows
above). `onnxtrain inspect`, `onnxtrain make-training` and `build.training_model`
(a `FoldedBatchNormWarning`) say so in one line when the export shows a fold:
a node that onnxscript's `FuseBatchNormInto*` rule made, a Conv or Gemm that
carries a BatchNorm module's records (`class_hierarchy`, `name_scopes`), or a
Conv whose bias TorchScript computed (`onnx::Conv_N`). A model that never had
a BatchNorm gets no hint. To fine-tune like PyTorch:

- **Keep BatchNormalization**: `dynamo=True, optimize=False` (model in eval
  mode), or `dynamo=False, training=torch.onnx.TrainingMode.PRESERVE` with the
  model in training mode (`model.train()`). `build.training_model` then trains
  on batch statistics and updates the running averages (`batchnorm_var="auto"`
  follows PyTorch's unbiased variance for a `pytorch` producer).
- **Make the batch dimension dynamic**: `dynamic_shapes=({0: torch.export.Dim("batch")},)`
  with dynamo, `dynamic_axes={"x": {0: "batch"}}` with TorchScript, and
  export with a batch of 2 or more. A fixed batch dimension makes `fit` drop the
  last partial batch (`drop_last=True`, with a note).

```python
import torch

net.eval()
torch.onnx.export(net, (torch.randn(4, 3, 32, 32),), "net.onnx", dynamo=True, optimize=False,
                  input_names=["x"], output_names=["logits"],
                  dynamic_shapes=({0: torch.export.Dim("batch")},))
```

Language models:

- **Opset**: keep torch's default (20 for the dynamo exporter in torch 2.13):
  plain ops, each with a gradient rule here. Opset 23 writes the `Attention`
  and `RMSNormalization` ops; 24 decomposes RMSNorm again. T5 fails in the
  dynamo exporter (view/stride); `dynamo=False` exports it.
- **Dynamic sizes**: batch and sequence dimensions both dynamic
  (`{0: Dim("batch"), 1: Dim("seq")}` for `input_ids` and `attention_mask`).
- **Padding side**: pad on the right for training, so that each sequence's
  tokens keep positions 0, 1, ... (left padding shifts them unless the model
  takes `position_ids`), and set the labels of padding to -100: the
  cross-entropy's `ignore_index`, which the loss skips. Feed `attention_mask`
  when the model has it as an input. The labels are `[B, T]` class indices; the
  builder finds the vocabulary axis of `[B, T, V]` logits itself.
- **Fresh models**: the dynamo exporter stores equal weights once (a fresh
  Llama's RMSNorm weights, all ones: one initializer read by five nodes). Its
  node records name the parameter each node read, so the builder gives each its
  own initializer again, named after its module (`build.parameter_choices`
  notes it in `tie`); a parameter used twice stays one
  (`tests/builder/test_tied_exports.py`, made by `scripts/make_tied_exports.py`).
"""


def load_checks():
    spec = importlib.util.spec_from_file_location("exporter_corpus", ROOT / "tests" / "builder" / "test_exporter_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def status(fn, *args, not_comparable=(), partial: str = "n/a") -> str:
    """"pass", ``partial`` (the check stopped at NotComparable), or "fail: <first line>"."""
    try:
        fn(*args)
    except not_comparable:
        return partial
    except Exception as exc:  # any failure is a cell of the table, not a crash
        text = str(exc).strip().splitlines()
        first = next((line.strip() for line in text if line.strip()), type(exc).__name__)
        return f"fail: {first[:140]}".replace("|", "\\|")
    return "pass"


def notes(case: dict) -> str:
    parts = list(case.get("reference_notes") or [])
    if case.get("not_comparable"):
        parts.append(f"not comparable with {case['framework']}: {case['not_comparable']}")
    return "; ".join(parts).replace("|", "\\|")


def main() -> int:
    checks = load_checks()
    import onnx
    import onnxruntime

    import onnxtrain

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in checks.CASES:
            nc = (checks.NotComparable,)
            rows.append((case["exporter"], case["model"],
                         status(checks.check_gradients, case, not_comparable=nc),
                         status(checks.check_training, case, not_comparable=nc, partial="partial"),
                         status(checks.check_export, case, Path(tmp)), notes(case)))
    versions = checks.MANIFEST["versions"]
    lines = [
        "# Exporter compatibility",
        "",
        "Generated by `python scripts/compatibility.py` from the exporter corpus in",
        "`tests/data/exporters/` (regenerated by `scripts/make_exporter_corpus.py`,",
        "which needs the `exporters` extra). Checked by `tests/builder/test_exporter_corpus.py`:",
        "",
        "- **grad**: gradients of the built training model at the starting weights against",
        "  the framework's float64 gradients;",
        "- **train**: `build.training_model` with its defaults (cross-entropy or mse,",
        "  `Adam(lr=1e-3)`) trains 5 steps like the framework's own optimizer (losses,",
        "  parameters, BatchNormalization running statistics) and trains only its parameters;",
        "- **export**: `sess.export(path)` runs in plain onnxruntime with the session's",
        "  outputs and the framework's trained model's.",
        "",
        "Exporters change the parameterisation in eval mode: they fuse Conv+BatchNorm,",
        "fold position embeddings for the traced length into constants and give each",
        "use of a tied weight its own initializer. The reference is then PyTorch",
        "training the model as exported (fused, untied: see the notes). Where no",
        "PyTorch model has the export's parameters (a token-type embedding broadcast",
        "into one copy per position), grad is `n/a` and train is `partial`: 5 default",
        "steps give finite losses, train every surviving parameter and no constant.",
        "",
        "Exporters: `dynamo` is `torch.onnx.export(..., dynamo=True)` (its default,",
        "`optimize=True`), `dynamo_noopt` adds `optimize=False`, `torchscript` is",
        "`dynamo=False`, `torchscript_preserve` adds `training=TrainingMode.PRESERVE`",
        "(model in training mode). `skl2onnx` is `to_onnx(model, X)`; `_opset9` adds",
        "`target_opset=9`, `_black_op` forbids the `ai.onnx.ml` linear ops",
        "(standard MatMul/Add), `_nozipmap` sets `options={id(model): {'zipmap': False}}`.",
        "",
        "| exporter | model | grad | train | export | notes |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {e} | {m} | {g} | {t} | {x} | {n} |" for e, m, g, t, x, n in rows]
    lines += ["", *EXPORT_GUIDE.strip("\n").splitlines()]
    lines += [
        "",
        "## Versions",
        "",
        "Corpus generated with: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
        "",
        f"Table computed with: onnxtrain {getattr(onnxtrain, '__version__', '?')}, "
        f"onnx {onnx.__version__}, onnxruntime {onnxruntime.__version__}.",
        "",
    ]
    DOC.write_text("\n".join(lines))
    failed = sum(cell.startswith("fail") for row in rows for cell in row[2:5])
    print(f"wrote {DOC} ({len(rows)} models, {failed} failing checks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
