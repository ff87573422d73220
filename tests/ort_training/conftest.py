"""Shared data of the ort_training tests: the artifacts, checkpoints and runs
that ONNX Runtime training 1.19.2 made, and PyTorch's references
(tests/data/ort_training, written by scripts/make_ort_artifacts.py)."""

import numpy as np
import pytest
from ort_data import DATA

pytest.importorskip("flatbuffers")


@pytest.fixture(scope="session")
def ort_runs():
    return dict(np.load(DATA / "ort_runs.npz"))


@pytest.fixture(scope="session")
def torch_ref():
    return dict(np.load(DATA / "torch_reference.npz"))


@pytest.fixture(scope="session")
def data_dir():
    return DATA
