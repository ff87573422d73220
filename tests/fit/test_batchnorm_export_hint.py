"""PyTorch exports without BatchNormalization.  ``onnxtrain inspect`` hints in one line
when a PyTorch export has no BatchNormalization (the recorded exporter corpus:
the same tiny ResNet folded by eval-mode exports and kept by
``optimize=False`` / ``TrainingMode.PRESERVE``), and the README and
``docs/compatibility.md`` show how to export for fine-tuning."""

from __future__ import annotations

from pathlib import Path

import pytest

from onnxtrain.builder.folding import HINT_FIX, batchnorm_hint
from onnxtrain.cli.app import main

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "data" / "exporters"


def inspect(capsys, path) -> list[str]:
    main(["inspect", str(path)])
    return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("exporter, hinted", [
    ("dynamo", True), ("torchscript", True),                   # BatchNorm folded into Conv
    ("dynamo_noopt", False), ("torchscript_preserve", False),  # BatchNorm kept
])
def test_inspect_hints_at_a_pytorch_export_without_batchnorm(capsys, exporter, hinted):
    path = CORPUS / f"resnet_tiny__{exporter}.onnx"
    if not path.exists():
        pytest.skip("exporter corpus not present")
    lines = inspect(capsys, path)
    hints = [line for line in lines if line.startswith("hint:")]
    import onnx

    assert hints == ([batchnorm_hint(onnx.load(str(path)))] if hinted else [])


def test_no_hint_for_other_producers(capsys):
    lines = inspect(capsys, CORPUS / "mlp_digits__skl2onnx.onnx")
    assert not [line for line in lines if line.startswith("hint:")]


def test_the_hint_names_both_ways_to_keep_batchnorm():
    for words in ("dynamo=True, optimize=False", "TrainingMode.PRESERVE", "dynamic batch"):
        assert words in HINT_FIX
    assert "\n" not in HINT_FIX


@pytest.mark.parametrize("doc", ["README.md", "docs/compatibility.md"])
def test_the_docs_show_a_pytorch_export_for_fine_tuning(doc):
    text = (ROOT / doc).read_text()
    for words in ("optimize=False", "TrainingMode.PRESERVE", "torch.export.Dim(\"batch\")",
                  "pad on the right", "-100", "opset"):
        assert words in text, (doc, words)


def test_the_compatibility_doc_matches_its_generator():
    import ast

    tree = ast.parse((ROOT / "scripts" / "compatibility.py").read_text())
    guide = next(node.value.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and getattr(node.targets[0], "id", None) == "EXPORT_GUIDE")
    assert guide.strip() in (ROOT / "docs" / "compatibility.md").read_text()
