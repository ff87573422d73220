"""The inference model ``Module.export_model_for_inferencing`` writes.

The forward model is cut at the requested outputs (``core.graph.keep_outputs``):
only the nodes they need stay, the parameters become initializers with their
current values, and inputs nothing reads any more (labels, targets) are
dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from ..core.graph import keep_outputs
from ..lower.pipeline import drop_unused_initializers


def inference_model(forward: onnx.ModelProto, values: dict[str, np.ndarray],
                    outputs: Sequence[str]) -> onnx.ModelProto:
    """``forward`` cut at ``outputs`` (names of values it computes or takes in)."""
    out = onnx.ModelProto()
    out.CopyFrom(forward)
    g = out.graph
    names = {i.name for i in g.input} | {t.name for t in g.initializer}
    inputs = [i for i in g.input if i.name not in values]
    inits = [t for t in g.initializer if t.name not in values]
    inits += [numpy_helper.from_array(np.asarray(v), n) for n, v in values.items() if n in names]
    for field, kept in (("input", inputs), ("initializer", inits)):
        kept = [type(x).FromString(x.SerializeToString()) for x in kept]
        g.ClearField(field)
        getattr(g, field).extend(kept)
    keep_outputs(out, outputs, "export_model_for_inferencing")
    drop_unused_initializers(g)
    return out
