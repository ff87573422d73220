"""Issue 34, item 7: the smaller things.

"trained 1 epoch (1 step)"; History.plot's legend covers no curve; the
README's torch block says ``pip install torch onnxscript`` and the README says
how long the tests take; ModelCheckpoint overwrites as Keras's does while the
CLI refuses, and both are documented.  (The '/proc' wording is checked in
test_papercuts_outputs.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from models import gemm_inference

from onnxtrain import History, ModelCheckpoint, TrainingSession, build, checkpoint_epoch
from onnxtrain.cli.app import main

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ plurals
@pytest.mark.parametrize("epochs, rows, said", [(1, 16, "trained 1 epoch (1 step) in "),
                                                (2, 32, "trained 2 epochs (4 steps) in ")])
def test_the_train_summary_counts_in_words(capsys, tmp_path, epochs, rows, said):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", X=rng.standard_normal((rows, 4)).astype(np.float32),
             y=rng.integers(0, 3, rows))
    onnx.save(build.training_model(gemm_inference(4, 3)), str(tmp_path / "t.onnx"))
    assert main(["train", str(tmp_path / "t.onnx"), "--data", str(tmp_path / "d.npz"), "--epochs",
                 str(epochs), "--batch-size", "16", "-o", str(tmp_path / "o.onnx"),
                 "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith(said) for line in lines), lines


# ------------------------------------------------------------------ the plot's legend
def test_the_plot_legend_covers_no_curve(tmp_path):
    """The digits demo's curves: the loss falls to 0.1 while the accuracy climbs
    to 0.97; placed inside, the legend covered the accuracy (right axis)."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = History()
    loss = [1.82, 0.90, 0.45, 0.30, 0.22, 0.18, 0.15, 0.13, 0.12, 0.10]
    acc = [0.43, 0.81, 0.90, 0.92, 0.94, 0.95, 0.96, 0.97, 0.97, 0.97]
    for e in range(10):
        h.append(e, {"loss": loss[e], "accuracy": acc[e], "val_loss": 1.34 - 0.1 * min(e, 9),
                     "val_accuracy": 0.68 + 0.02 * e}, 1.0)
    ax = h.plot()
    fig = ax.figure
    fig.savefig(tmp_path / "history.png")  # lays the figure out as it is shown
    renderer = fig.canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    points = np.concatenate([line.get_transform().transform(line.get_xydata())
                             for axes in fig.axes for line in axes.get_lines()])
    assert len(points) == 40
    inside = [p for p in points if legend.contains(*p)]
    assert not inside, f"the legend covers {len(inside)} point(s)"
    for axes in fig.axes:  # nor the lines between the points: it is outside every plot area
        assert not legend.overlaps(axes.get_window_extent(renderer).shrunk(0.999, 0.999))
    assert fig.bbox.contains(legend.x0, legend.y0) and fig.bbox.contains(legend.x1, legend.y1)
    plt.close(fig)


# ------------------------------------------------------------------ the README
def readme() -> str:
    return (ROOT / "README.md").read_text()


def test_the_torch_block_names_onnxscript():
    block = next(b for b in re.findall(r"^```python\n(.*?)^```", readme(), re.S | re.M)
                 if "torch.onnx.export" in b)
    first = block.splitlines()[0]
    assert first.startswith("# needs: torch onnxscript ") and "pip install torch onnxscript" in first
    assert "pip install torch onnxscript" in readme().split("```python\n" + block)[0][-400:]


def test_the_readme_says_how_long_the_tests_take():
    text = readme()
    command = ".venv/bin/python -m pytest -q -n 2\n```"
    after = text[text.index(command) + len(command):][:400]
    assert re.search(r"about \d+-\d+ minutes on 2 cores", after), after
    assert re.search(r"\d[\d,]* tests", after), after


# ------------------------------------------------------------------ checkpoints
def test_model_checkpoint_overwrites_as_keras_does_and_the_cli_refuses(tmp_path, capsys):
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((32, 4)).astype(np.float32), rng.integers(0, 3, 32)
    tm = build.training_model(gemm_inference(4, 3))
    ckpt = tmp_path / "ckpt.onnx"
    TrainingSession(tm).fit(X, y, epochs=3, progress=False, callbacks=[ModelCheckpoint(ckpt)])
    assert checkpoint_epoch(ckpt) == 3
    TrainingSession(tm).fit(X, y, epochs=1, progress=False, callbacks=[ModelCheckpoint(ckpt)])
    assert checkpoint_epoch(ckpt) == 1  # the earlier run's checkpoint is replaced
    np.savez(tmp_path / "d.npz", X=X, y=y)
    onnx.save(tm, str(tmp_path / "t.onnx"))
    assert main(["train", str(tmp_path / "t.onnx"), "--data", str(tmp_path / "d.npz"), "--epochs",
                 "1", "-o", str(tmp_path / "o.onnx"), "--checkpoint", str(ckpt)]) == 1
    assert "--resume" in capsys.readouterr().err and checkpoint_epoch(ckpt) == 1


@pytest.mark.parametrize("text", [ModelCheckpoint.__doc__, (ROOT / "docs" / "fit.md").read_text()])
def test_the_difference_is_documented(text):
    words = " ".join(text.split())
    assert re.search(r"overwrites .*as Keras", words)
    assert "--resume" in words and "--overwrite" in words
