"""The documented public names keep working wherever the modules behind them
live (docs/architecture.md: the public modules are thin faces)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from importlib import metadata

import pytest

import onnxtrain

PUBLIC = {
    "onnxtrain": ["TrainingSession", "build", "bundle", "Callback", "Checkpoint", "CSVLogger", "EarlyStopping",
                  "History", "ModelCheckpoint", "StopTraining", "TerminateOnNaN", "ExecutionError",
                  "GradientError", "TrainingModelError", "NonFiniteLossError", "checkpoint_epoch",
                  "train_test_split", "__version__"],
    "onnxtrain.build": ["training_model", "parameter_choices", "ParameterChoice", "LoRA", "export_requantized", "Loss", "MSE",
                        "L1", "Huber", "CrossEntropy", "BCEWithLogits", "NLL", "CustomLoss", "Optimizer",
                        "SGD", "Adagrad", "Adam", "AdamW", "Schedule", "cosine", "step_decay",
                        "linear_warmup", "lora", "losses", "optimizers", "schedules"],
    "onnxtrain.bundle": ["save", "load", "read", "Bundle", "BundleError", "BundleFileMissing", "FORMAT",
                         "VERSION"],
    "onnxtrain.autodiff": ["vjp", "no_grad", "refuse", "VJPContext", "REGISTRY"],
    "onnxtrain.comm": ["Communicator", "LocalCommunicator", "MPICommunicator", "SingleProcess",
                       "as_communicator", "local_group"],
    "onnxtrain.backend": ["prepare", "run_model", "run_node", "supports_device"],
    "onnxtrain.datasets": ["load_digits", "train_test_split"],
    "onnxtrain.demo": ["build_classifier", "run_demo", "demo_steps", "DEFAULT_EPOCHS", "DEFAULT_BATCH_SIZE",
                       "DEFAULT_LR"],
    "onnxtrain.runtime.executor": ["default_session_options"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_names_import(module):
    mod = importlib.import_module(module)
    missing = [name for name in PUBLIC[module] if not hasattr(mod, name)]
    assert missing == []


def test_everything_in_all_exists():
    for module in ("onnxtrain", "onnxtrain.build", "onnxtrain.bundle", "onnxtrain.comm", "onnxtrain.backend",
                   "onnxtrain.datasets", "onnxtrain.demo"):
        mod = importlib.import_module(module)
        assert [n for n in mod.__all__ if not hasattr(mod, n)] == [], module


def test_the_build_submodules_as_the_docs_import_them():
    from onnxtrain.build import lora, schedules

    assert callable(lora.merge) and callable(schedules.cosine)
    assert onnxtrain.build.training_model is onnxtrain.builder.training_model


def test_the_console_script_and_python_dash_m():
    (script,) = [e for e in metadata.entry_points(group="console_scripts") if e.name == "onnxtrain"]
    assert callable(script.load())
    out = subprocess.run([sys.executable, "-m", "onnxtrain", "--version"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and onnxtrain.__version__ in out.stdout + out.stderr
