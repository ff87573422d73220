"""LoRA adapter files: the adapters of a session (or of a LoRA model) on
their own, and the base model with them merged in later.

- ``save_adapters(sess, "a.npz")``: one array per adapter (``W.lora_A``,
  ``W.lora_B``) and the description under ``onnxtrain.lora`` (JSON), r·(in + out)
  values per target; ``load_adapters`` reads it back;
- ``apply_adapters(base_model, "a.npz")``: the base inference model with the
  adapters merged into its weights (``builder.lora.merged_weight``), the model
  ``TrainingSession.export`` writes for the session they came from;
- ``export_requantized(sess, path)``: a QLoRA session's inference model with
  each quantized target's merged weight quantized again.

onnxruntime's own adapter files (``.onnx_adapter``, which onnxruntime-genai
loads) are written by ``runtime.adapters.write_adapter`` (the runtime layer
owns onnxruntime) for ``export.genai``.  Public as ``onnxtrain.build.lora``,
with the LoRA rewrite itself (``builder.lora``).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from ..builder.lora import FORMAT, META_KEY, attach, info_of, merge, merged_blocks, merged_weight
from ..core.files import write_atomically
from ..io import mapped
from ..io.model import ModelLike, load
from ..io.storage import came_external, write_model
from ..lower.pipeline import inference_export
from .model import to_model
from .session_like import SessionLike


def save_adapters(source: SessionLike | ModelLike, path: str | os.PathLike) -> Path:
    """Write the adapters of a TrainingSession or another ``SessionLike``
    (current state) or of a LoRA model (a path, bytes or ModelProto: its
    initializers) to ``path``, an ``.npz`` file: one array per
    adapter under its name (``W.lora_A``, ``W.lora_B``) and the description
    under ``onnxtrain.lora`` (a JSON string), without node lists.  Its size
    is that of the adapters: r·(in + out) values per target."""
    model, state = (source.model, source.state) if isinstance(source, SessionLike) else (load(source)[0], None)
    info = info_of(model)
    if info is None:
        raise ValueError(f"save_adapters: the model has no {META_KEY} metadata (not built with lora=)")
    inits = {t.name: t for t in model.graph.initializer}
    arrays: dict[str, np.ndarray] = {}
    targets = []
    for e in info["targets"]:
        for key in ("A", "B"):
            name = e[key]
            arrays[name] = (np.asarray(state[name]) if state is not None and name in state
                            else mapped.to_array(inits[name]))
        targets.append({k: e[k] for k in ("weight", "A", "B", "in", "out", "transposed", "scale",
                                          "quantized") if k in e})
    desc = {k: info[k] for k in ("format", "rank", "alpha", "dropout", "seed")}
    desc["targets"] = targets
    # Into an open file: np.savez on a path would append ".npz".
    return write_atomically(path, lambda f: np.savez(f, **arrays, **{META_KEY: np.asarray(json.dumps(desc))}))


def load_adapters(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(description, adapter arrays) of a file written by ``save_adapters``."""
    with np.load(path, allow_pickle=False) as z:
        if META_KEY not in z.files:
            raise ValueError(f"{path}: not a LoRA adapter file (no {META_KEY} entry)")
        desc = json.loads(str(z[META_KEY]))
        arrays = {k: z[k] for k in z.files if k != META_KEY}
    if desc.get("format") != FORMAT:
        raise ValueError(f"{path}: unsupported LoRA adapter format {desc.get('format')!r}")
    return desc, arrays


def apply_adapters(base_model: ModelLike, path: str | os.PathLike,
                   output: str | os.PathLike | None = None) -> onnx.ModelProto | Path:
    """The base inference model with the adapters of ``path`` merged into its
    weights (``merged_weight``): the same model ``TrainingSession.export``
    writes for the session the adapters came from.  Each target must be an
    initializer of the base model with the recorded shape.

    ``output``: write the merged model there instead (atomically, streamed:
    each merged weight is computed block by block while it is written, so a
    base model with external data, mapped, is never copied into memory) and
    return the path; a base model that came with external data keeps it."""
    desc, arrays = load_adapters(path)
    source, _ = load(base_model)
    out = onnx.ModelProto()
    out.CopyFrom(source)
    if out.training_info:
        raise ValueError("apply_adapters: base_model must be an inference model (it has training_info)")
    if any(e.get("quantized") for e in desc["targets"]):
        # QLoRA: the exact side branches (in memory), the float targets merged.
        out = merge(attach(out, desc, arrays))
        if output is None:
            return out
        return write_model(out, output)
    inits = {t.name: i for i, t in enumerate(out.graph.initializer)}
    deferred: dict[str, mapped.Deferred] = {}
    for e in desc["targets"]:
        w = e["weight"]
        if w not in inits:
            raise ValueError(f"apply_adapters: the base model has no initializer {w!r}")
        missing = [e[k] for k in ("A", "B") if e[k] not in arrays]
        if missing:
            raise ValueError(f"{path}: adapter arrays {missing} are missing")
        t = out.graph.initializer[inits[w]]
        expected = [e["out"], e["in"]] if e["transposed"] else [e["in"], e["out"]]
        if list(t.dims) != expected:
            raise ValueError(f"apply_adapters: {w!r} has shape {list(t.dims)}, the adapters "
                             f"were trained for {expected}")
        args = (mapped.to_array(t), arrays[e["A"]], arrays[e["B"]], e["scale"], e["transposed"])
        if output is None:
            t.CopyFrom(numpy_helper.from_array(merged_weight(*args), w))
        else:
            value = mapped.Deferred(args[0].dtype, tuple(args[0].shape), lambda args=args: merged_blocks(*args))
            mapped.defer(t, f"lora/{w}", value, deferred)
    if output is None:
        return out
    return write_model(out, output, deferred=deferred, external_data=True if came_external(source) else None)




def export_requantized(source: SessionLike | ModelLike, path: str | os.PathLike) -> dict[str, dict[str, float]]:
    """Write the inference model of a QLoRA session (or LoRA model) to
    ``path`` with each quantized target's merged weight ``W + s·A·B``
    quantized again in its own format (float targets merged as usual), and
    return per quantized target the error that adds (``update_error``: the
    part of ||s·A·B|| lost, relative; ``max_abs_error``), also warned.
    ``TrainingSession.export`` never does this: it keeps the exact branch."""
    model = to_model(source, training=True) if isinstance(source, SessionLike) else load(source)[0]
    info = info_of(model)
    if info is None:
        raise ValueError(f"export_requantized: the model has no {META_KEY} metadata (not built with lora=)")
    report: dict[str, dict[str, float]] = {}
    out = inference_export(merge(model, requantize=True, report=report))
    written = write_model(out, path)
    if report:
        worst = max(report.items(), key=lambda kv: kv[1]["update_error"])
        warnings.warn(f"export_requantized: requantizing {len(report)} quantized target(s) changed the "
                      f"merged weights; worst {worst[0]!r}: {worst[1]['update_error']:.1%} of the "
                      f"LoRA update lost (max abs error {worst[1]['max_abs_error']:.3g})", stacklevel=2)
    del written
    return report
