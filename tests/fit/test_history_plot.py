"""``History.plot``: losses and metrics on separate, labelled y axes, with
one legend that covers no curve (matplotlib, the ``test`` extra)."""

from __future__ import annotations

import numpy as np
import pytest

from onnxtrain import History


def test_history_plot_puts_losses_and_metrics_on_labelled_axes():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    h = History()
    for e, (loss, acc) in enumerate([(2.0, 0.3), (0.1, 0.8), (0.01, 0.95)]):
        h.append(e, {"loss": loss, "accuracy": acc, "val_loss": loss * 1.1,
                     "val_accuracy": acc - 0.05, "lr": 0.1}, 1.0)
    ax = h.plot()
    assert [line.get_label() for line in ax.get_lines()] == ["loss", "val_loss"]
    assert ax.get_ylabel() == "loss" and ax.get_xlabel() == "epoch"
    others = [a for a in ax.figure.axes if a is not ax]
    assert len(others) == 1
    assert [line.get_label() for line in others[0].get_lines()] == ["accuracy", "val_accuracy"]
    assert others[0].get_ylabel() == "accuracy"
    np.testing.assert_allclose(others[0].get_lines()[0].get_ydata(), h["accuracy"])
    assert len(ax.get_legend().get_texts()) == 4  # one legend for both axes
    import matplotlib.pyplot as plt

    plt.close(ax.figure)
    only = h.plot(["accuracy"])  # metrics alone: one axis, labelled
    assert only.get_ylabel() == "accuracy" and len(only.figure.axes) == 1
    plt.close(only.figure)


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
