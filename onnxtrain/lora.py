"""LoRA, as ``onnxtrain.build.lora``: the rewrite that trains low-rank
adapters and their merge (defined in ``onnxtrain.builder.lora``, whose
docstring has the math), and the adapter files (``onnxtrain.export.adapters``).

>>> import os, tempfile
>>> from onnxtrain import TrainingSession, build
>>> from onnxtrain.build import lora
>>> from onnxtrain.demo import build_classifier
>>> base = TrainingSession(build_classifier()).to_model()       # an inference model
>>> sess = TrainingSession(build.training_model(base, lora=build.LoRA(rank=4)))
>>> tmp = tempfile.TemporaryDirectory()
>>> path = lora.save_adapters(sess, os.path.join(tmp.name, "adapters.npz"))
>>> merged = lora.apply_adapters(base, path)                    # base with the adapters merged
>>> [t.name for t in merged.graph.initializer] == [t.name for t in base.graph.initializer]
True
>>> tmp.cleanup()
"""

from .builder.lora import (
    FORMAT,
    META_KEY,
    LoRA,
    all_targets,
    apply,
    attach,
    drop_info,
    info_of,
    merge,
    merged_blocks,
    merged_weight,
    select_targets,
    set_info,
    trainable_params,
)
from .export.adapters import apply_adapters, export_requantized, load_adapters, save_adapters

__all__ = [
    "FORMAT", "META_KEY", "LoRA", "all_targets", "apply", "attach", "drop_info", "info_of", "merge",
    "merged_blocks", "merged_weight", "select_targets", "set_info", "trainable_params",
    "apply_adapters", "export_requantized", "load_adapters", "save_adapters",
]
