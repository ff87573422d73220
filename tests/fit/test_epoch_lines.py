"""What training prints: losses of any size readable (scientific notation
past a million, in fit's and the CLI's epoch lines), and the CLI's closing
summary counting epochs and steps in words."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from models import gemm_inference

from onnxtrain import build
from onnxtrain.cli.app import main
from onnxtrain.train.loop import epoch_line, fmt_loss


def test_huge_losses_print_in_scientific_notation():
    huge = 445944625879819678883241398160588800.0
    assert fmt_loss(huge) == "4.459e+35"
    assert fmt_loss(1e6) == "1e+06" and fmt_loss(999999.0) == "999999.0000"
    assert fmt_loss(0.1234) == "0.1234" and fmt_loss(float("nan")) == "nan"
    assert "4.459e+35" in epoch_line(0, 1, {"loss": huge}, 1.0)


def test_cli_epoch_lines_use_scientific_notation(capsys, tmp_path):
    from onnxtrain.cli.app import _EpochLines  # the CLI's own line printer

    _EpochLines(3).on_epoch_end(0, {"loss": 4.459e35, "accuracy": 0.5, "lr": 0.001})
    line = capsys.readouterr().out.strip()
    assert line == "epoch 1/3: loss 4.459e+35, accuracy 0.5000, lr 0.001"


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
