"""The BatchNorm-folding hint fires on evidence of folding only (issue 34, item 1).

Real PyTorch exports: tests/data/folding (scripts/make_folding_corpus.py, whose
manifest says which exports folded a BatchNorm: the torch model had more
BatchNorm modules than the export has BatchNormalization nodes), the exporter
corpus's ResNets and every language-model export of tests/data/llm (no
BatchNorm at all).  The hint is said by ``onnxtrain inspect``, by
``onnxtrain make-training`` and, as a FoldedBatchNormWarning, by
``build.training_model``."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnxtrain import build
from onnxtrain.builder.folding import FoldedBatchNormWarning, batchnorm_hint, folded_batchnorm
from onnxtrain.cli.app import main

DATA = Path(__file__).resolve().parents[1] / "data"
FOLDING = json.loads((DATA / "folding" / "manifest.json").read_text())["cases"]
#: file -> folded, for every export (ground truth: the manifests, and no BatchNorm in an LM).
TRUTH = {DATA / "folding" / c["file"]: c["folded"] for c in FOLDING}
TRUTH.update({DATA / "exporters" / f"resnet_tiny__{e}.onnx": e in ("dynamo", "torchscript")
              for e in ("dynamo", "dynamo_noopt", "torchscript", "torchscript_preserve")})
TRUTH.update({p: False for p in sorted((DATA / "llm").glob("*.onnx"))})
TRUTH.update({p: False for p in sorted((DATA / "exporters").glob("*.onnx")) if p not in TRUTH})


def hints(capsys, args) -> list[str]:
    main(args)
    captured = capsys.readouterr()
    return [line for line in (captured.out + captured.err).splitlines() if line.startswith("hint:")]


def test_the_corpus_has_both_kinds():
    folded = [c for c in FOLDING if c["folded"]]
    assert {c["exporter"] for c in folded} == {"dynamo", "torchscript"}
    assert {c["model"] for c in FOLDING if not c["folded"]} >= {"mlp", "cnn", "cnn_bn"}
    assert sum(TRUTH.values()) == len(folded) + 2


@pytest.mark.parametrize("path", sorted(TRUTH), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_inspect_hints_exactly_at_folded_exports(capsys, path):
    found = hints(capsys, ["inspect", str(path)])
    assert len(found) == (1 if TRUTH[path] else 0), found


@pytest.mark.parametrize("name, evidence", [
    # dynamo's default optimize=True: the rewriter's rule and the BatchNorm module's records
    ("cnn_bn__dynamo", ["FuseBatchNormIntoConv", "from BatchNorm2d '1'"]),
    # a Conv with its own bias: the bias keeps its name, the metadata still tells
    ("cnn_bn_bias__dynamo", ["FuseBatchNormIntoConv", "from BatchNorm2d '1'"]),
    ("mlp_bn__dynamo", ["FuseBatchNormIntoGemm", "from BatchNorm1d '1'"]),
    # TorchScript's constant folding: the bias is a computed constant
    ("cnn_bn__torchscript", ["'/0/Conv'", "its bias 'onnx::Conv_16'"]),
    # one BatchNorm folded, one kept: a BatchNormalization node does not hide the other
    ("cnn_bn_mixed__dynamo", ["FuseBatchNormIntoConv"]),
])
def test_the_hint_names_the_node_and_the_evidence(name, evidence):
    model = onnx.load(str(DATA / "folding" / f"{name}.onnx"))
    (entry,) = folded_batchnorm(model)
    for words in evidence:
        assert words in entry, (words, entry)
    hint = batchnorm_hint(model)
    assert "\n" not in hint and entry in hint
    for words in ("dynamo=True, optimize=False", "TrainingMode.PRESERVE", "dynamic batch"):
        assert words in hint


def test_the_dynamo_default_export_keeps_the_conv_bias_name():
    """The case the issue names: the eval-mode dynamo export whose Conv carries
    BatchNorm2d and FuseBatchNormIntoConv in its metadata, the bias its own name."""
    model = onnx.load(str(DATA / "folding" / "cnn_bn_bias__dynamo.onnx"))
    (conv,) = [n for n in model.graph.node if n.op_type == "Conv"]
    assert conv.input[2] == "0.bias"
    meta = {p.key: p.value for p in conv.metadata_props}
    assert "FuseBatchNormIntoConv" in meta["pkg.onnxscript.rewriter.rule_name"]
    assert "BatchNorm2d" in meta["pkg.torch.onnx.class_hierarchy"]
    assert batchnorm_hint(model)


def test_the_import_ort_model_of_a_pytorch_mlp_gets_no_hint(tmp_path):
    pytest.importorskip("flatbuffers")
    from onnxtrain.ort_training.convert import import_ort

    model = import_ort(DATA / "ort_training" / "adamw", tmp_path / "m.onnx")
    model.producer_name = "pytorch"  # artifacts made from a torch export say so
    assert batchnorm_hint(model) is None


@pytest.mark.parametrize("case", FOLDING, ids=lambda c: c["file"])
def test_training_model_warns_exactly_at_folded_exports(case):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build.training_model(str(DATA / "folding" / case["file"]), loss="cross_entropy")
    folded = [w for w in caught if issubclass(w.category, FoldedBatchNormWarning)]
    assert len(folded) == (1 if case["folded"] else 0), [str(w.message) for w in caught]
    if folded:
        assert folded[0].filename == __file__  # points at the caller's line
        assert "optimize=False" in str(folded[0].message)


@pytest.mark.parametrize("name, folded", [("cnn_bn__dynamo", True), ("cnn_bn__torchscript", True),
                                          ("cnn__dynamo", False), ("cnn_bn__dynamo_noopt", False)])
def test_make_training_says_it_too(capsys, tmp_path, name, folded):
    found = hints(capsys, ["make-training", str(DATA / "folding" / f"{name}.onnx"),
                           "-o", str(tmp_path / "t.onnx")])
    assert (tmp_path / "t.onnx").exists()
    assert len(found) == (1 if folded else 0)
    if folded:
        assert found[0] == batchnorm_hint(onnx.load(str(DATA / "folding" / f"{name}.onnx")))


def test_the_folded_model_still_trains():
    """The hint is advice: the folded export builds and trains."""
    from onnxtrain import TrainingSession

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FoldedBatchNormWarning)
        sess = TrainingSession(build.training_model(str(DATA / "folding" / "cnn_bn__dynamo.onnx")))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 6, 6)).astype(np.float32)
    y = rng.integers(0, 3, 4)
    assert np.isfinite(sess.fit(x, y, epochs=1, batch_size=4, progress=False)["loss"][0])
