"""LoRA: train low-rank adapters of frozen MatMul/Gemm weights.

``build.training_model(model, ..., lora=build.LoRA(rank=8, alpha=16))``
freezes every targeted weight ``W`` and trains two small matrices per
target.  With ``W`` read as a linear map from ``in`` to ``out`` features
(``Y = X·W`` with ``W`` of shape ``[in, out]``) the adapters are

    W.lora_A  [in, r]    uniform(-1/sqrt(in), 1/sqrt(in)), seeded
    W.lora_B  [r, out]   zeros

and the graph computes, with s = alpha / r,

    Y = X·W + s · (drop(X)·A)·B                                   (1)

so the first forward pass equals the base model's (B = 0), the product
``A·B`` is never formed during training, and the gradients reach A and B
only: W is an initializer no binding names, a constant.  ``drop`` is an
inverted Dropout of ratio ``dropout`` on the adapter branch only; the main
graph holds it in inference mode (the identity) and the builder's
training-mode forward copy turns it on.  A's bound 1/sqrt(in) is what
PyTorch's ``kaiming_uniform_(a=sqrt(5))`` gives for a ``[r, in]`` weight
(gain sqrt(2 / (1 + 5)), bound gain·sqrt(3 / in)), as peft initializes it.

**Orientation.**  "in" and "out" follow the product, whatever the layout
of ``W`` in the graph.  For stored ``W`` of shape ``[d0, d1]``:

    use                        in   out  stored as   adapter branch
    MatMul(X, W)               d0   d1   [in, out]   s·(X·A)·B
    Gemm(X, W), transB=0       d0   d1   [in, out]   g·s·(op(X)·A)·B
    Gemm(X, W), transB=1       d1   d0   [out, in]   g·s·(op(X)·A)·B
    MatMul(W, X)               d1   d0   [out, in]   s·Bᵀ·(Aᵀ·X)
    Gemm(W, X), transA=0       d1   d0   [out, in]   g·s·Bᵀ·(Aᵀ·op(X))
    Gemm(W, X), transA=1       d0   d1   [in, out]   g·s·Bᵀ·(Aᵀ·op(X))

(g is Gemm's alpha, op(X) the transposed X where Gemm's trans flag asks
for it; Gemm's ``beta·C`` stays in the base node.)  The merged weight, in
``W``'s own layout, is ``W + s·A·B`` when stored ``[in, out]`` and
``W + s·(A·B)ᵀ`` when stored ``[out, in]``.

**Targets.**  ``targets=None`` takes every 2-D floating-point initializer
that is read (directly or through Identity nodes) only as a MatMul or Gemm
weight operand whose other operand is an activation (not an initializer),
with one orientation across its uses, except a language model's output
head (peft's convention for decoder LMs: the attention and MLP projections,
not ``lm_head``; see ``default_targets``).  Names in ``targets=[...]`` may be
the names the exporter recorded for a weight (``"q_proj"`` or
``"model.layers.0.self_attn.q_proj"`` for dynamo's ``val_41``: see
``known_names``).  Anything else (a Gather of a tied
embedding, a bias slot, a graph output) would see the base weight during
training but the merged one after export, so such initializers are skipped
by ``None`` and refused by name.  ``targets`` may also be a list of
initializer names or a predicate ``name -> bool`` applied to the eligible
ones.

**Export.**  ``apply`` records in metadata ``onnxtrain.lora`` (JSON) per
target: the adapter names, the scale, the orientation and every node and
value it inserted; ``merge`` removes them again, renames the rewritten
nodes' outputs back and writes the merged weight, which gives the original
graph.  ``TrainingSession.export(path)`` writes that merged model;
``export(path, training=True)`` the whole training model.  The adapter
files are a way out, in ``onnxtrain.export.adapters`` (public with this
module as ``onnxtrain.build.lora``): ``save_adapters(sess, "a.npz")`` writes
only the adapters (and the description), ``apply_adapters(base_model,
"a.npz")`` merges them into the base model later.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..core.graph import graph_names
from ..core.names import NameGen
from ..io import mapped
from ..io.metadata import PREFIX, drop_metadata, set_metadata
from . import qlora
from .known_names import known_names, matches
from .targets import Use, attribute, default_targets, eligible_targets

#: Metadata key of the LoRA description (a JSON object).
META_KEY = "onnxtrain.lora"
#: Version of that description and of the adapter file.
FORMAT = 1


# ------------------------------------------------------------------ configuration
@dataclass(frozen=True)
class LoRA:
    """Low-rank adapters: ``rank`` r >= 1, scale ``alpha / r``, ``targets``
    (None, a list of initializer names or a predicate), adapter-branch
    ``dropout`` in [0, 1) and the ``seed`` of A's initialization.

    >>> import numpy as np
    >>> from onnx import TensorProto, helper, numpy_helper
    >>> from onnxtrain import TrainingSession, build
    >>> g = helper.make_graph(
    ...     [helper.make_node("MatMul", ["X", "W"], ["Y"])], "linear",
    ...     [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4])],
    ...     [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 3])],
    ...     [numpy_helper.from_array(np.ones((4, 3), np.float32), "W")])
    >>> m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    >>> tm = build.training_model(m, loss="mse", optimizer=build.SGD(lr=0.1),
    ...                           lora=build.LoRA(rank=2, alpha=4))
    >>> sess = TrainingSession(tm)
    >>> {k: v.shape for k, v in sess.state.items() if ".lora_" in k}
    {'W.lora_A': (4, 2), 'W.lora_B': (2, 3)}
    >>> [n.op_type for n in sess.to_model().graph.node]     # export(path) writes this
    ['MatMul']
    """

    rank: int = 8
    alpha: float = 16.0
    targets: Sequence[str] | Callable[[str], bool] | None = None
    dropout: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.rank, (int, np.integer)) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"LoRA.rank must be an integer >= 1, got {self.rank!r}")
        if (not isinstance(self.alpha, (int, float, np.number)) or isinstance(self.alpha, bool)
                or not np.isfinite(self.alpha) or self.alpha <= 0):
            raise ValueError(f"LoRA.alpha must be a finite number > 0, got {self.alpha!r}")
        if (not isinstance(self.dropout, (int, float, np.number)) or isinstance(self.dropout, bool)
                or not 0.0 <= float(self.dropout) < 1.0):
            raise ValueError(f"LoRA.dropout must be a number in [0, 1), got {self.dropout!r}")
        if not isinstance(self.seed, (int, np.integer)) or isinstance(self.seed, bool):
            raise ValueError(f"LoRA.seed must be an integer, got {self.seed!r}")
        t = self.targets
        if isinstance(t, str):
            raise TypeError(f"LoRA.targets must be a list of names, not the string {t!r}")
        if t is not None and not callable(t) and not isinstance(t, Iterable):
            raise TypeError(
                f"LoRA.targets must be None, a list of names or a predicate, not {type(t).__name__}"
            )
        if t is not None and not callable(t):
            names = tuple(t)
            if not names or not all(isinstance(n, str) for n in names):
                raise ValueError(f"LoRA.targets must be a non-empty list of names, got {t!r}")
            object.__setattr__(self, "targets", names)

    @property
    def scale(self) -> float:
        """alpha / r, the factor of the adapter branch."""
        return float(self.alpha) / int(self.rank)


def all_targets(graph: onnx.GraphProto) -> tuple[dict[str, list[Use]], dict[str, str],
                                                  dict[str, qlora.Quantized]]:
    """(eligible name -> uses, ineligible name -> why, quantized name -> its
    description): float weights (``targets.eligible_targets``) and quantized
    codes (``qlora.quantized_targets``: MatMulNBits' B, DequantizeLinear's x)."""
    eligible, why = eligible_targets(graph)
    quantized, qwhy = qlora.quantized_targets(graph, Use)
    for name, q in quantized.items():
        eligible[name] = q.uses
    why.update(qwhy)
    return eligible, why, quantized


def select_targets(graph: onnx.GraphProto, lora: LoRA) -> dict[str, list[Use]]:
    """The targets ``lora.targets`` names, in initializer order (ValueError for
    an unknown or ineligible name, or when nothing is selected).  Entries
    are initializer names or the names the exporter recorded (module paths,
    matched as peft matches ``target_modules``: see ``known_names.matches``)."""
    eligible, why, quantized = all_targets(graph)
    order = [t.name for t in graph.initializer]
    known = known_names(graph)
    t = lora.targets
    if t is None:
        chosen = default_targets(graph, eligible, known, {n: q.n_out for n, q in quantized.items()})[0]
    elif callable(t):
        chosen = [n for n in order if n in eligible and (t(n) or (n in known and t(known[n])))]
    else:
        picked: set[str] = set()
        for entry in t:
            hits = [n for n in order if matches(entry, n, known)]
            if not hits:
                raise ValueError(
                    f"LoRA.targets: unknown name {entry!r}: not an initializer of the main graph nor "
                    f"a module the exporter recorded; eligible weights are "
                    f"{sorted(known.get(n, n) for n in eligible)}"
                )
            usable = [n for n in hits if n in eligible]
            if not usable:
                name = hits[0]
                reason = why.get(name, "it is not a 2-D floating-point initializer")
                shown = repr(entry) if entry == name else f"{entry!r} ({name!r})"
                raise ValueError(f"LoRA.targets: {shown} cannot take an adapter: {reason}")
            picked.update(usable)
        chosen = [n for n in order if n in picked]
    if not chosen:
        raise ValueError(
            "LoRA: no target selected; eligible weights (2-D floating initializers read only as "
            f"MatMul/Gemm weights, MatMulNBits or DequantizeLinear codes) are {sorted(eligible)}"
            + (f"; skipped: {dict(sorted(why.items())[:8])}" if why else "")
        )
    return {n: eligible[n] for n in chosen}


# ------------------------------------------------------------------ the rewrite
def apply(proto: onnx.ModelProto, lora: LoRA) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """Rewrite ``proto``'s main graph in place for (1) and return (proto, info).

    Adds the initializers ``W.lora_A`` and ``W.lora_B`` per target, renames
    the output of each MatMul/Gemm that reads a target to a fresh
    ``W.lora/base`` value and inserts after it the adapter branch and the Add
    that writes the original output.  ``info`` (also stored as metadata
    ``onnxtrain.lora``) is what ``merge`` needs to undo it."""
    if not isinstance(lora, LoRA):
        raise TypeError(f"lora must be None or build.LoRA(...), not {type(lora).__name__}")
    graph = proto.graph
    targets = select_targets(graph, lora)
    quantized = qlora.quantized_targets(graph, Use)[0]
    taken = graph_names(graph)
    for w in targets:
        for suffix in ("lora_A", "lora_B"):
            if f"{w}.{suffix}" in taken:
                raise ValueError(
                    f"LoRA: the adapter name {w}.{suffix!s} is already used in the main graph"
                )
    names = NameGen(taken | {f"{w}.lora_{s}" for w in targets for s in "AB"})
    inits = {t.name: t for t in graph.initializer}
    rng = np.random.default_rng(int(lora.seed))
    r, scale = int(lora.rank), lora.scale
    entries = []
    inserted_after: dict[int, list[onnx.NodeProto]] = {}
    for w, uses in targets.items():
        q = quantized.get(w)
        transposed = uses[0].transposed
        if q is None:
            t = inits[w]
            d0, d1 = int(t.dims[0]), int(t.dims[1])
            n_in, n_out = (d1, d0) if transposed else (d0, d1)
            elem_type = t.data_type
        else:  # QLoRA: float adapters in the activation dtype
            n_in, n_out, elem_type = q.n_in, q.n_out, q.elem_type
        dtype = helper.tensor_dtype_to_np_dtype(elem_type)
        bound = 1.0 / np.sqrt(n_in)
        a_name, b_name = f"{w}.lora_A", f"{w}.lora_B"
        graph.initializer.append(
            numpy_helper.from_array(rng.uniform(-bound, bound, (n_in, r)).astype(dtype), a_name))
        graph.initializer.append(numpy_helper.from_array(np.zeros((r, n_out), dtype), b_name))
        entry = {"weight": w, "A": a_name, "B": b_name, "in": n_in, "out": n_out,
                 "transposed": transposed, "scale": scale, "nodes": [], "values": [], "renamed": {}}
        if q is not None:
            entry["quantized"] = q.kind
        for use in uses:
            node = graph.node[use.position]
            new_nodes = _branch(node, use, a_name, b_name, elem_type, scale, lora.dropout,
                                names, entry)
            inserted_after.setdefault(use.position, []).extend(new_nodes)
        entries.append(entry)
    nodes = list(graph.node)
    del graph.node[:]
    for position, node in enumerate(nodes):
        graph.node.append(node)
        graph.node.extend(inserted_after.get(position, []))
    info = {"format": FORMAT, "rank": r, "alpha": float(lora.alpha), "dropout": float(lora.dropout),
            "seed": int(lora.seed), "targets": entries}
    set_info(proto, info)
    return proto, info


def _branch(node: onnx.NodeProto, use: Use, a: str, b: str, elem_type: int, scale: float,
            dropout: float, names: NameGen, entry: dict) -> list[onnx.NodeProto]:
    """The adapter branch of one MatMul/Gemm use (see the module table); the
    node's output becomes a fresh ``base`` value and the last Add writes the
    original output name."""
    w = entry["weight"]
    out: list[onnx.NodeProto] = []

    def value(hint: str) -> str:
        name = names.fresh(f"{w}.lora/{hint}")
        entry["values"].append(name)
        return name

    def emit(op: str, inputs: list[str], hint: str, **attrs: Any) -> str:
        result = value(hint)
        name = names.fresh(f"{w}.lora/{op}")
        entry["nodes"].append(name)
        out.append(helper.make_node(op, inputs, [result], name=name, **attrs))
        return result

    original = node.output[0]
    base = value("base")
    node.output[0] = base
    entry["renamed"][base] = original
    x = node.input[1 - use.operand]
    factor = scale
    if node.op_type == "Gemm":
        factor *= float(attribute(node, "alpha", 1.0))
        if bool(attribute(node, "transA" if use.operand == 1 else "transB", 0)):
            x = emit("Transpose", [x], "x_t")
    if dropout > 0:
        ratio = emit("Constant", [], "ratio",
                     value=numpy_helper.from_array(np.asarray(dropout, np.float32)))
        x = emit("Dropout", [x, ratio], "x_drop")
    s = emit("Constant", [], "scale",
             value=numpy_helper.from_array(np.asarray(factor, helper.tensor_dtype_to_np_dtype(elem_type))))
    if use.operand == 1:  # Y = X·W:  s·(X·A)·B
        h = emit("MatMul", [x, a], "xa")
        h = emit("Mul", [h, s], "xa_scaled")
        delta = emit("MatMul", [h, b], "delta")
    else:  # Y = W·X:  s·Bᵀ·(Aᵀ·X)
        h = emit("MatMul", [emit("Transpose", [a], "a_t"), x], "ax")
        h = emit("Mul", [h, s], "ax_scaled")
        delta = emit("MatMul", [emit("Transpose", [b], "b_t"), h], "delta")
    name = names.fresh(f"{w}.lora/Add")
    entry["nodes"].append(name)
    out.append(helper.make_node("Add", [base, delta], [original], name=name))
    return out


# ------------------------------------------------------------------ metadata
def set_info(proto: onnx.ModelProto, info: Mapping[str, Any]) -> None:
    """Store ``info`` as metadata ``onnxtrain.lora`` (replacing any)."""
    set_metadata(proto, META_KEY.removeprefix(PREFIX), dict(info))


def drop_info(proto: onnx.ModelProto) -> None:
    """Remove metadata ``onnxtrain.lora`` (the model is a plain one again)."""
    drop_metadata(proto, META_KEY.removeprefix(PREFIX))


def info_of(proto: onnx.ModelProto) -> dict[str, Any] | None:
    """The ``onnxtrain.lora`` description of a model, or None."""
    for p in proto.metadata_props:
        if p.key == META_KEY:
            info = json.loads(p.value)
            if not isinstance(info, dict) or info.get("format") != FORMAT:
                raise ValueError(f"metadata {META_KEY}: unsupported LoRA description {p.value[:200]!r}")
            return info
    return None


def trainable_params(main: onnx.GraphProto, info: Mapping[str, Any], choice: Any) -> list[str]:
    """The trainable set under LoRA: the adapters, plus ``choice`` (None: nothing
    more; a list of names; a predicate over the builder's default set), in
    initializer order.  The frozen weights cannot be named."""
    from .parameters import choose_trainable

    adapters = {name for e in info["targets"] for name in (e["A"], e["B"])}
    frozen = {e["weight"] for e in info["targets"]}
    if choice is None:
        extra: list[str] = []
    elif callable(choice):
        chosen = choose_trainable(main, lambda n: n in adapters or (n not in frozen and choice(n)))
        extra = [n for n in chosen if n not in adapters]
    elif isinstance(choice, str):
        raise TypeError(f"trainable must be a list of names, not the string {choice!r}")
    else:
        wanted = list(choice)
        for name in wanted:
            if name in frozen:
                raise ValueError(
                    f"trainable: {name!r} is a LoRA target, frozen under LoRA (its adapters "
                    f"{name}.lora_A and {name}.lora_B train); leave it out of LoRA.targets to train it"
                )
        extra = choose_trainable(main, wanted) if wanted else []
    keep = adapters | set(extra)
    return [t.name for t in main.initializer if t.name in keep]


# ------------------------------------------------------------------ merging
def merged_blocks(w: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float,
                  transposed: bool) -> Iterator[np.ndarray]:
    """W + s·A·B (or W + s·(A·B)ᵀ for W stored [out, in]) in blocks of W's
    rows, each summed in float64 and rounded once to W's dtype.  A block
    holds about ``mapped.CHUNK_BYTES`` of float64, so merging a weight needs
    no copy of it (W may be a memory map)."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    out_shape = (b64.shape[1], a64.shape[0]) if transposed else (a64.shape[0], b64.shape[1])
    if w.ndim != 2 or a64.shape[1] != b64.shape[0] or tuple(w.shape) != out_shape:
        raise ValueError(f"LoRA merge: adapter product {list(out_shape)} does not fit "
                         f"weight {list(w.shape)}")
    step = max(1, mapped.rows(tuple(w.shape), 8) // 16)  # about 4 MiB of float64: cache-sized
    for start in range(0, w.shape[0], step):
        stop = min(start + step, w.shape[0])
        if transposed:  # rows of (A·B)ᵀ are columns of A·B
            delta = float(scale) * (a64 @ b64[:, start:stop]).T
        else:
            delta = float(scale) * (a64[start:stop] @ b64)
        yield (w[start:stop].astype(np.float64) + delta).astype(w.dtype)


def merged_weight(w: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float,
                  transposed: bool) -> np.ndarray:
    """The whole merged weight (``merged_blocks`` joined)."""
    blocks = list(merged_blocks(w, a, b, scale, transposed))
    return blocks[0] if len(blocks) == 1 else np.concatenate(blocks)


def merge(model: onnx.ModelProto, state: Mapping[str, np.ndarray] | None = None,
          deferred: dict[str, mapped.Deferred] | None = None, requantize: bool = False,
          report: dict[str, dict[str, float]] | None = None) -> onnx.ModelProto:
    """The merged inference model of a LoRA-rewritten ``model`` (not modified).

    Removes every node and value ``apply`` inserted, gives the rewritten
    nodes their original outputs back, drops the adapter initializers and
    writes ``merged_weight`` into each target.  A and B are read from
    ``state`` when given, else from the initializers.  With ``deferred`` (a
    table of ``onnxtrain.io.mapped`` placeholders, which the initializers may
    use), each merged weight becomes a deferred placeholder computed block by
    block while the file is written.  training_info is dropped; metadata
    ``onnxtrain.lora`` too (the result is a plain model).

    A quantized target (QLoRA, ``qlora``) keeps its adapter branch, exact:
    ``X·W_q + s·(X·A)·B`` with A and B initializers and codes, scales and
    zero points untouched (a Dropout on the branch is dropped).  With
    ``requantize=True`` its merged weight is quantized again instead and
    ``report`` (a dict, if given) receives per target the error this added
    (``qlora.requantize_entry``)."""
    info = info_of(model)
    if info is None:
        raise ValueError(f"LoRA merge: the model has no {META_KEY} metadata")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.training_info[:]
    graph = out.graph
    inits = {t.name: t for t in graph.initializer}

    def array(name: str) -> np.ndarray:
        if state is not None and name in state:
            return np.asarray(state[name])
        if name not in inits:
            raise ValueError(f"LoRA merge: no value for {name!r}")
        later = mapped.deferred_of(inits[name], deferred or {})
        return later.value() if later is not None else mapped.to_array(inits[name])

    removed_nodes, removed_values, renamed, merged = set(), set(), {}, {}
    kept_branch: dict[str, np.ndarray] = {}
    bypass: dict[str, str] = {}
    for e in info["targets"]:
        if e.get("quantized") and not requantize:
            for n in graph.node:
                if n.name in e["nodes"] and n.op_type == "Dropout":
                    removed_nodes.add(n.name)
                    bypass[n.output[0]] = n.input[0]
            if state is not None:
                kept_branch.update({e[k]: np.asarray(state[e[k]]) for k in ("A", "B") if e[k] in state})
            continue
        if e.get("quantized"):
            values, rep = qlora.requantize_entry(graph, e, array(e["A"]), array(e["B"]))
            merged.update(values)
            if report is not None:
                report[e["weight"]] = rep
            removed_nodes.update(e["nodes"])
            removed_values.update(e["values"])
            renamed.update(e["renamed"])
            removed_values.update((e["A"], e["B"]))
            continue
        removed_nodes.update(e["nodes"])
        removed_values.update(e["values"])
        renamed.update(e["renamed"])
        args = (array(e["weight"]), array(e["A"]), array(e["B"]), e["scale"], e["transposed"])
        if deferred is None:
            merged[e["weight"]] = merged_weight(*args)
        else:
            merged[e["weight"]] = mapped.Deferred(
                args[0].dtype, tuple(args[0].shape), lambda args=args: merged_blocks(*args))
        removed_values.update((e["A"], e["B"]))
    _rewire(graph, removed_nodes, renamed, bypass)
    _merged_initializers(graph, removed_values, merged, kept_branch, deferred)
    vis = [v for v in graph.value_info if v.name not in removed_values]
    del graph.value_info[:]
    graph.value_info.extend(vis)
    drop_metadata(out, META_KEY.removeprefix(PREFIX))
    return out


def _rewire(graph: onnx.GraphProto, removed: set[str], renamed: Mapping[str, str],
            bypass: Mapping[str, str]) -> None:
    """Drop the ``removed`` nodes; the kept ones write their original outputs (``renamed``)
    and read past a dropped branch Dropout (``bypass``)."""
    kept = [n for n in graph.node if n.name not in removed]
    for n in kept:
        for i, o in enumerate(n.output):
            if o in renamed:
                n.output[i] = renamed[o]
        for i, x in enumerate(n.input):
            if x in bypass:
                n.input[i] = bypass[x]
    del graph.node[:]
    graph.node.extend(kept)


def _merged_initializers(graph: onnx.GraphProto, removed: set[str], merged: Mapping[str, Any],
                         kept_branch: Mapping[str, np.ndarray],
                         deferred: dict[str, mapped.Deferred] | None) -> None:
    """The initializers of the merged model: the ``removed`` dropped, the targets' merged
    weights (deferred or arrays) and a kept branch's trained A and B written in."""
    new_inits = []
    for t in graph.initializer:
        if t.name in removed:
            continue
        if t.name in merged and deferred is not None and isinstance(merged[t.name], mapped.Deferred):
            mapped.defer(t, f"lora/{t.name}", merged[t.name], deferred)
        elif t.name in merged:
            t = numpy_helper.from_array(merged[t.name], t.name)
        elif t.name in kept_branch:
            t = numpy_helper.from_array(kept_branch[t.name].astype(
                helper.tensor_dtype_to_np_dtype(t.data_type)), t.name)
        new_inits.append(t)
    del graph.initializer[:]
    graph.initializer.extend(new_inits)


def attach(proto: onnx.ModelProto, desc: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
           ) -> onnx.ModelProto:
    """``proto`` (modified) rewritten by ``apply`` for the targets of an
    adapter description (``load_adapters``), with ``arrays``' values in its
    adapters: a LoRA model ready for ``merge``.  Each target must exist with
    the recorded features, quantized or not as recorded."""
    weights = [e["weight"] for e in desc["targets"]]
    _, info = apply(proto, LoRA(rank=int(desc["rank"]), alpha=float(desc["alpha"]), targets=weights))
    made = {e["weight"]: e for e in info["targets"]}
    inits = {t.name: t for t in proto.graph.initializer}
    for e in desc["targets"]:
        m = made[e["weight"]]
        if (m["in"], m["out"], bool(m.get("quantized"))) != (e["in"], e["out"], bool(e.get("quantized"))):
            raise ValueError(f"adapters for {e['weight']!r} were trained for [{e['in']}, {e['out']}]"
                             f"{' (quantized)' if e.get('quantized') else ''}; the model has "
                             f"[{m['in']}, {m['out']}]{' (quantized)' if m.get('quantized') else ''}")
        for key in ("A", "B"):
            t = inits[m[key]]
            value = np.asarray(arrays[e[key]])
            if list(value.shape) != list(t.dims):
                raise ValueError(f"adapter {e[key]!r} has shape {list(value.shape)}, expected {list(t.dims)}")
            t.CopyFrom(numpy_helper.from_array(
                value.astype(helper.tensor_dtype_to_np_dtype(t.data_type)), m[key]))
    return proto
