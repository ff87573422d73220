"""ONNX Runtime training's Python API on onnxtrain (a drop-in for ``onnxruntime.training``).

>>> from onnxtrain.ort_training import artifacts
>>> from onnxtrain.ort_training.api import CheckpointState, Module, Optimizer, LinearLRScheduler

- ``artifacts.generate_artifacts``: training, eval and optimizer models plus a checkpoint;
- ``api``: ``CheckpointState``, ``Module``, ``Optimizer``, ``LinearLRScheduler``;
- ``onnxblock``: custom losses and optimizers as blocks;
- ``import_ort(art_dir, output)``: ORT artifacts + checkpoint -> one standard ONNX
  training model for ``onnxtrain.TrainingSession``, ``fit`` and the CLI.

Artifacts and ODTC checkpoints made by onnxruntime-training 1.19.2 load and
train to its numbers; see docs/migrating-from-ort-training.md.
"""

from .convert import import_ort

__all__ = ["api", "artifacts", "onnxblock", "import_ort"]


def __getattr__(name):  # the submodules load on first use
    if name in ("api", "artifacts", "onnxblock"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
