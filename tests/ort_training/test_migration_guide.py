"""docs/migrating-from-ort-training.md: its example runs as written, and its
scheduler numbers are those of the recorded runs."""

import re
from pathlib import Path

import numpy as np
import onnxruntime

DOC = Path(__file__).resolve().parents[2] / "docs" / "migrating-from-ort-training.md"


def _python_blocks():
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def test_example_runs_as_written(tmp_path, monkeypatch, capsys):
    (block,) = _python_blocks()
    monkeypatch.chdir(tmp_path)
    exec(compile(block, str(DOC), "exec"), {"__name__": "__doc_example__"})
    assert re.match(r"loss \d\.\d+ -> \d\.\d+", capsys.readouterr().out)
    assert {"training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint",
            "checkpoint_epoch1", "inference.onnx"} <= {p.name for p in (tmp_path / "art").iterdir()}
    sess = onnxruntime.InferenceSession(str(tmp_path / "art" / "inference.onnx"),
                                        providers=["CPUExecutionProvider"])
    assert sess.run(None, {"input": np.zeros((2, 4), np.float32)})[0].shape == (2, 3)


def test_scheduler_numbers_quoted(ort_runs):
    text = DOC.read_text()
    assert "0, 0.0167, 0.033, 0.05, 0.067, 0.083, 0" in text
    np.testing.assert_allclose(ort_runs["ort_scheduler_lrs"][:7],
                               [0, 0.0167, 0.0333, 0.05, 0.0667, 0.0833, 0], atol=1e-4)
