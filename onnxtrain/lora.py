"""LoRA, as ``onnxtrain.build.lora``: the rewrite that trains low-rank
adapters and their merge (defined in ``onnxtrain.builder.lora``, whose
docstring has the math), and the adapter files (``onnxtrain.export.adapters``).

>>> from onnxtrain.build import lora
>>> lora.save_adapters(sess, "adapters.npz")                      # doctest: +SKIP
>>> merged = lora.apply_adapters("model.onnx", "adapters.npz")     # doctest: +SKIP
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
