"""Serve a LoRA/QLoRA-trained onnxruntime-genai model with onnxruntime-genai.

``export(sess, folder, base=GENAI_FOLDER)`` (``sess``: a ``SessionLike``,
such as a ``TrainingSession``; public as ``onnxtrain.genai.export``) writes
a genai model folder:
every file of ``base`` (``genai_config.json``, the tokenizer files, ...)
with its decoder model (``model.onnx`` and its data) rewritten from base's
own graph, so the builder's ops stay as they are (GroupQueryAttention with
its KV-cache buffers shared between past and present: genai's
``past_present_share_buffer``).  The adapters come from the session's
state (``sess.model``'s ``onnxtrain.lora`` description):

``adapters="merged"``
    float targets get ``W + s·A·B``; quantized targets (MatMulNBits,
    DequantizeLinear codes) keep codes, scales and zero points bit for bit
    and get the exact side branch ``X·W_q + s·(X·A)·B`` (``build.lora``).
``adapters="separate"``
    the base model, each target with a LoRA slot: graph inputs
    ``<prefix>.lora_A.weight`` [in, r] and ``<prefix>.lora_B.weight`` [r, out]
    whose default initializers are empty ([in, 0], [0, out]: the branch
    adds zeros, the model runs as the base when no adapter is loaded), plus
    ``{name}.onnx_adapter`` (``onnxruntime.AdapterFormat``) holding A and
    ``s·B`` in the model's dtype.  ``og.Adapters(model).load(path, name)``
    and ``generator.set_active_adapter(adapters, name)`` apply it.

Slot names follow Olive's convention on the genai model's own names:
``<prefix>`` is the target initializer's name without ``.MatMul.weight``
or ``.MatMul.weight_Q4`` (genai: ``model.layers.0.attn.qkv_proj``).  A
packed projection such as ``qkv_proj`` is one target, one matrix: its
adapters span q, k and v together ([hidden, r] and [r, q + k + v]).

Other trained parameters (``trainable=`` under LoRA, e.g. norms) whose
names are base initializers are written into the model in both modes.
onnxruntime-genai itself is not needed to export (``onnxtrain[genai]`` to
run the result).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..builder import lora as _lora
from ..io.loading import load
from ..io.metadata import model_metadata
from ..io.storage import write_model
from ..runtime.adapters import write_adapter
from .session_like import SessionLike

MODES = ("merged", "separate")
_SUFFIXES = (".MatMul.weight_Q4", ".MatMul.weight_Q8", ".MatMul.weight", "_Q4", "_Q8", ".weight")


def slot_prefix(weight: str) -> str:
    """Olive's module prefix of a target initializer name (see the module doc)."""
    for suffix in _SUFFIXES:
        if weight.endswith(suffix) and len(weight) > len(suffix):
            return weight[: -len(suffix)]
    return weight


def decoder_file(base: Path) -> str:
    """The decoder model's file name from ``base/genai_config.json``."""
    cfg_path = base / "genai_config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{base}: not an onnxruntime-genai model folder (no genai_config.json)")
    cfg = json.loads(cfg_path.read_text())
    try:
        return str(cfg["model"]["decoder"]["filename"])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{cfg_path}: no model.decoder.filename") from exc


def _check_built_from(built: onnx.ModelProto, info: dict[str, Any], model: onnx.ModelProto,
                      path: Path) -> None:
    """ValueError, in one line naming both files, when the session's LoRA targets
    are not weights of base's decoder: the session was built from another model
    (another export of the same network names its weights otherwise)."""
    names = {t.name for t in model.graph.initializer}
    missing = [e["weight"] for e in info["targets"] if e["weight"] not in names]
    if not missing:
        return
    source = model_metadata(built).get("source")
    built_from = f"{source}" if source else "a model in memory (no file recorded)"
    shown = ", ".join(repr(m) for m in missing[:3]) + (", ..." if len(missing) > 3 else "")
    raise ValueError(
        f"genai.export: the session must be built from the base folder's own {path}, not from "
        f"{built_from} (its LoRA targets {shown} are not weights there): build it with "
        f"build.training_model({str(path)!r}, lora=...)")


def export(sess: SessionLike, folder: str | os.PathLike, base: str | os.PathLike,
           adapters: str = "merged", name: str = "adapter") -> Path:
    """Write the genai model folder ``folder`` for LoRA/QLoRA session ``sess``
    trained on ``base``'s decoder model (see the module doc); returns
    ``folder``.  ``folder`` must not be ``base``; files of base are copied,
    the decoder model and its data are written anew (atomically each)."""
    if adapters not in MODES:
        raise ValueError(f"genai.export: adapters must be one of {MODES}, not {adapters!r}")
    if not isinstance(name, str) or not name or os.sep in name or name.startswith("."):
        raise ValueError(f"genai.export: name must be a plain file stem, not {name!r}")
    if not isinstance(sess, SessionLike):
        raise TypeError(f"genai.export: sess must be a TrainingSession (or another SessionLike: a "
                        f"model, its state and fit position), not {type(sess).__name__}")
    info = _lora.info_of(sess.model)
    if info is None:
        raise ValueError("genai.export: the session was not built with lora= (no onnxtrain.lora metadata)")
    state = sess.state  # one state version (a session's view pins it)
    base, folder = Path(base), Path(folder)
    filename = decoder_file(base)
    if folder.exists() and folder.resolve() == base.resolve():
        raise ValueError("genai.export: folder must differ from base (base's files are read)")
    skip = {filename} | _external_files(onnx.load(str(base / filename), load_external_data=False))
    # Weights memory-mapped from base's data file, never read into the protobuf:
    # merged weights are computed block by block and codes copied file to file
    # while the new model is written.
    model, _ = load(base / filename)
    _check_built_from(sess.model, info, model, base / filename)
    desc = {"rank": info["rank"], "alpha": info["alpha"],
            "targets": [{k: e[k] for k in ("weight", "A", "B", "in", "out", "transposed", "scale",
                                           "quantized") if k in e} for e in info["targets"]]}
    arrays = {e[k]: np.asarray(state[e[k]]) for e in info["targets"] for k in ("A", "B")}
    _write_other_parameters(model, state, arrays)
    try:
        lora_model = _lora.attach(model, desc, arrays)
    except ValueError as exc:
        raise ValueError(f"genai.export: the session's adapters do not fit {base / filename}: {exc}") from exc
    params: dict[str, np.ndarray] = {}
    deferred: dict = {}
    if adapters == "merged":
        out = _lora.merge(lora_model, deferred=deferred)
    else:
        out, params = _slots(lora_model)
    folder.mkdir(parents=True, exist_ok=True)
    for item in base.iterdir():
        if item.name in skip or item.name.endswith(".onnx_adapter"):
            continue
        dest = folder / item.name
        if item.is_dir():
            shutil.copytree(item, dest, dirs_exist_ok=True)
        else:
            shutil.copy2(item, dest)
    write_model(out, folder / filename, external_data=True, deferred=deferred)
    if params:
        write_adapter(folder / f"{name}.onnx_adapter", params)
    return folder


def _external_files(model: onnx.ModelProto) -> set[str]:
    """External data file names a model's tensors refer to."""
    names = set()
    for t in list(model.graph.initializer):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            for kv in t.external_data:
                if kv.key == "location":
                    names.add(Path(kv.value).name)
    return names


def _write_other_parameters(model: onnx.ModelProto, state: Mapping[str, np.ndarray],
                            adapters: Mapping[str, np.ndarray]) -> None:
    """Trained non-adapter parameters named like base initializers (same shape)."""
    for t in model.graph.initializer:
        if t.name in state and t.name not in adapters:
            value = np.asarray(state[t.name])
            if list(value.shape) == list(t.dims):
                t.CopyFrom(numpy_helper.from_array(
                    value.astype(helper.tensor_dtype_to_np_dtype(t.data_type)), t.name))


def _slots(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The LoRA model ``model`` (``lora.attach``ed, no dropout) with each
    target's A and B turned into slot inputs with empty defaults and the
    scale Mul removed; returns it and the adapter tensors (A, s·B)."""
    info = _lora.info_of(model)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    nodes = {n.name: n for n in graph.node}
    rename: dict[str, str] = {}
    bypass: dict[str, str] = {}
    drop: set[str] = set()
    params: dict[str, np.ndarray] = {}
    taken = {t.name for t in graph.initializer} | {i.name for i in graph.input}
    for e in info["targets"]:
        prefix = slot_prefix(e["weight"])
        a_slot, b_slot = f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"
        for slot in (a_slot, b_slot):
            if slot in taken:
                raise ValueError(f"genai.export: the slot name {slot!r} is already used in the model")
            taken.add(slot)
        a, b = (numpy_helper.to_array(inits[e[k]]) for k in ("A", "B"))
        dtype = a.dtype
        factor = None
        for n in (nodes[x] for x in e["nodes"]):
            if n.op_type in ("Transpose", "Dropout"):
                raise ValueError(f"genai.export(adapters='separate'): target {e['weight']!r} is not "
                                 "read as MatMul(X, W) (or has dropout); use adapters='merged'")
            if n.op_type == "Mul":  # the scale: folded into B
                bypass[n.output[0]] = n.input[0]
                drop.add(n.name)
                const = next(c for c in graph.node if c.op_type == "Constant" and c.output[0] == n.input[1])
                value = float(numpy_helper.to_array(const.attribute[0].t))
                if factor is not None and value != factor:
                    raise ValueError(f"genai.export: target {e['weight']!r} has uses with different scales")
                factor = value
            elif n.op_type == "Constant":
                drop.add(n.name)
        params[a_slot] = a.astype(dtype)
        params[b_slot] = (float(e["scale"] if factor is None else factor) * b.astype(np.float64)).astype(dtype)
        rename[e["A"]], rename[e["B"]] = a_slot, b_slot
        empty_a, empty_b = np.zeros((e["in"], 0), dtype), np.zeros((0, e["out"]), dtype)
        inits[e["A"]].CopyFrom(numpy_helper.from_array(empty_a, a_slot))
        inits[e["B"]].CopyFrom(numpy_helper.from_array(empty_b, b_slot))
        elem = helper.np_dtype_to_tensor_dtype(dtype)
        graph.input.append(helper.make_tensor_value_info(a_slot, elem, [e["in"], "lora_rank"]))
        graph.input.append(helper.make_tensor_value_info(b_slot, elem, ["lora_rank", e["out"]]))
    kept = []
    for n in graph.node:
        if n.name in drop:
            continue
        for i, x in enumerate(n.input):
            x = bypass.get(x, x)
            n.input[i] = rename.get(x, x)
        kept.append(n)
    del graph.node[:]
    graph.node.extend(kept)
    _lora.drop_info(model)
    return model, params


