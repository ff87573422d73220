"""Adapt converter output to what the builder trains (skl2onnx conversions, old opsets).

``adapt(proto)`` returns the inference model the builder trains.  A model
that needs none of the rewrites below comes back unchanged (the same object);
otherwise a rewritten copy, checked against the original (see ``_check``).

Rewrites, in order:

1. **ZipMap** (``ai.onnx.ml``) turns a probability tensor into a sequence of
   maps, which no loss can read.  The node becomes ``Identity`` and the graph
   output keeps its name but is now the probability tensor ``[N, C]`` (its
   columns in ZipMap's class order).
2. **LinearRegressor / LinearClassifier** keep their coefficients in
   attributes, out of the optimizer's reach.  With X ``[N, F]`` (cast to
   float32, as the ml ops compute), W ``[E, F]`` the coefficients and b the
   ``E`` intercepts they become standard ops on trainable initializers::

       s = X W^T + b                    MatMul + Add, W^T and b lifted into initializers

   LinearRegressor output: ``post_transform(s)`` (with one target
   onnxruntime ignores every transform but PROBIT, so ``s``).
   LinearClassifier scores ``z`` (onnxruntime's rules, the ``ai.onnx.ml``
   spec leaves them open):

   - E >= 2: ``z = post_transform(s)`` row by row: NONE ``s``, LOGISTIC
     ``sigmoid(s)``, SOFTMAX ``softmax(s)``;
   - E = 1 with two class labels (binary): ``z = [1 - t, t]``, ``t = sigmoid(s)``
     for LOGISTIC, else ``t = s``;

   labels: ``classlabels[argmax(z, axis=1)]`` (Gather from a constant of the
   class labels; the first maximum wins, as in onnxruntime).  SOFTMAX_ZERO
   and PROBIT are refused with a ValueError naming the node.
3. **Normalizer** with ``norm="L1"`` (what skl2onnx puts after a classifier)
   becomes ``x / sum(|x|, axis=1)``.
4. **Old opsets**: a default-domain opset below 13 (the builder's minimum) is
   upgraded with ``onnx.version_converter`` once no ``ai.onnx.ml`` op that
   the converter cannot handle is left; the ``ai.onnx.ml`` import is kept.

**Logits for cross-entropy.**  Cross-entropy must never apply log_softmax to
probabilities.  For every floating output ``p`` of a model that imports
``ai.onnx.ml`` whose value is a probability recognised from its producers,
an extra graph output ``<p>_logits`` holds scores ``l`` with
``softmax(l) = p``:

- ``p = softmax(z)``                      -> ``l = z``
- ``p = sigmoid(z)`` (one column per class) -> ``l = log sigmoid(z) = -softplus(-z)``
- ``p = q / sum(q)``  (L1 normalisation)   -> the logits of ``q``
- ``p = [1 - sigmoid(s), sigmoid(s)]``   -> ``l = [0, s]``

(``log_softmax(log sigmoid(z)) = log(sigmoid(z) / sum sigmoid(z))``, the log of
the normalised probabilities.)  The pairs are recorded in the model's
metadata ``onnxtrain.logits_of`` as JSON ``{"<p>": "<p>_logits"}``; the
builder reads them with ``loss_output``.

>>> import numpy as np
>>> from onnx import TensorProto, helper
>>> node = helper.make_node("LinearRegressor", ["X"], ["Y"], domain="ai.onnx.ml",
...                         coefficients=[1.0, 2.0], intercepts=[0.5])
>>> g = helper.make_graph([node], "reg",
...     [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 2])],
...     [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 1])])
>>> m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
...                                          helper.make_opsetid("ai.onnx.ml", 1)])
>>> [n.op_type for n in adapt(m).graph.node]
['MatMul', 'Add']
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..core.emitter import FLOAT_TYPES
from ..core.graph import DEFAULT_DOMAINS, opset_version
from ..core.names import NameGen
from ..io import mapped
from ..io.metadata import PREFIX, model_metadata, set_metadata
from .losses import CrossEntropy

ML = "ai.onnx.ml"
#: The builder's minimum default-domain opset (see builder.MIN_OPSET).
MIN_OPSET = 13
#: Metadata key: JSON {probability output: its logits output}.
LOGITS_OF = "onnxtrain.logits_of"
#: ml ops this module rewrites into standard ops.
_REWRITTEN = ("ZipMap", "LinearRegressor", "LinearClassifier", "Normalizer")


# ------------------------------------------------------------------ public entry
def adapt(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The inference model the builder trains (``proto`` is not modified).

    Returns ``proto`` itself when nothing needs rewriting."""
    opset = opset_version(proto.opset_import) or None
    has_ml = any(o.domain == ML for o in proto.opset_import)
    rewrites = [n for n in proto.graph.node if n.domain == ML and n.op_type in _REWRITTEN]
    softmax_out = _ends_in_softmax(proto.graph)
    if not rewrites and (opset is None or opset >= MIN_OPSET) and not has_ml and not softmax_out:
        return proto
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    _dedupe_imports(model)
    if rewrites:
        _Rewriter(model, opset or MIN_OPSET).run()
    if opset is not None and opset < MIN_OPSET:
        model = _upgrade(model, opset)
    if has_ml or softmax_out:
        _add_logits(model, softmax_only=not has_ml)
    if model.SerializeToString() == proto.SerializeToString():
        return proto
    _check(proto, model)
    return model


def logits_of(proto: onnx.ModelProto) -> dict[str, str]:
    """{probability output: logits output} recorded by ``adapt`` (empty if none)."""
    return dict(model_metadata(proto).get(LOGITS_OF.removeprefix(PREFIX)) or {})


def loss_output(proto: onnx.ModelProto, output: str | None, loss: Any) -> str:
    """The main-graph output a loss reads, for a model ``adapt`` returned.

    ``output=None``: the first output with a floating element type (skl2onnx
    classifiers put their int64 labels first).  Cross-entropy applies
    log_softmax to what it reads: on a probability output it reads the
    output's ``<p>_logits`` instead."""
    graph = proto.graph
    outputs = [o.name for o in graph.output]
    if not outputs:
        raise ValueError("the main graph has no outputs")
    if output is None:
        floating = [
            o.name for o in graph.output
            if o.type.HasField("tensor_type") and o.type.tensor_type.elem_type in FLOAT_TYPES
        ]
        logits = set(logits_of(proto).values())
        floating = [o for o in floating if o not in logits] or floating
        output = floating[0] if floating else outputs[0]
    elif output not in outputs:
        raise ValueError(f"output {output!r} is not an output of the main graph; outputs are {outputs}")
    if isinstance(loss, CrossEntropy):
        output = logits_of(proto).get(output, output)
    return output


# ------------------------------------------------------------------ rewrites
def _dedupe_imports(model: onnx.ModelProto) -> None:
    """One import per domain (skl2onnx may repeat the default domain's)."""
    seen: dict[str, onnx.OperatorSetIdProto] = {}
    for o in model.opset_import:
        key = "" if o.domain in DEFAULT_DOMAINS else o.domain
        if key not in seen or o.version > seen[key].version:
            seen[key] = o
    kept = [onnx.OperatorSetIdProto(domain=o.domain, version=o.version) for o in seen.values()]
    del model.opset_import[:]
    model.opset_import.extend(kept)


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Rewriter:
    """Replaces ZipMap, LinearRegressor, LinearClassifier and Normalizer(L1)
    by standard ops valid at the model's default opset (>= 7)."""

    def __init__(self, model: onnx.ModelProto, opset: int) -> None:
        self.model = model
        self.graph = model.graph
        self.opset = opset
        used = {n.name for n in self.graph.node}
        for n in self.graph.node:
            used.update(n.input)
            used.update(n.output)
        used.update(i.name for i in self.graph.input)
        used.update(t.name for t in self.graph.initializer)
        self.names = NameGen(used)
        #: Element types of the values whose type the graph declares.
        self.types = {
            v.name: v.type.tensor_type.elem_type
            for v in list(self.graph.input) + list(self.graph.value_info)
            if v.type.HasField("tensor_type")
        }
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    # -- emitting
    def op(self, op_type: str, inputs: list[str], hint: str, out: str | None = None, **attrs) -> str:
        out = out or self.names.fresh(hint)
        self.nodes.append(
            helper.make_node(op_type, inputs, [out], name=self.names.fresh(f"adapt/{op_type}"), **attrs)
        )
        return out

    def init(self, array: np.ndarray, hint: str) -> str:
        name = self.names.fresh(hint)
        self.inits.append(numpy_helper.from_array(array, name))
        return name

    def reduce_sum_rows(self, x: str, hint: str) -> str:
        """sum over axis 1, keepdims (axes an attribute before opset 13)."""
        if self.opset >= 13:
            axes = self.init(np.array([1], np.int64), f"{hint}_axes")
            return self.op("ReduceSum", [x, axes], hint, keepdims=1)
        return self.op("ReduceSum", [x], hint, axes=[1], keepdims=1)

    # -- driver
    def run(self) -> None:
        out_types = {o.name: o for o in self.graph.output}
        new_nodes: list[onnx.NodeProto] = []
        for node in self.graph.node:
            self.nodes = []
            if node.domain == ML and node.op_type == "ZipMap":
                self.op("Identity", [node.input[0]], "", out=node.output[0])
                if node.output[0] in out_types:
                    vi = out_types[node.output[0]]
                    vi.type.CopyFrom(helper.make_tensor_type_proto(TensorProto.FLOAT, [None, None]))
            elif node.domain == ML and node.op_type == "LinearRegressor":
                self.linear_regressor(node)
            elif node.domain == ML and node.op_type == "LinearClassifier":
                self.linear_classifier(node)
            elif node.domain == ML and node.op_type == "Normalizer" and _text(
                _attrs(node).get("norm", "MAX")
            ) == "L1":
                x = node.input[0]
                self.op("Div", [x, self.reduce_sum_rows(self.op("Abs", [x], f"{x}_abs"), f"{x}_l1")],
                        "", out=node.output[0])
            else:
                self.nodes = [node]
            new_nodes.extend(self.nodes)
        del self.graph.node[:]
        self.graph.node.extend(new_nodes)
        self.graph.initializer.extend(self.inits)

    def scores(self, node: onnx.NodeProto, rows: int, out: str | None = None) -> str:
        """s = X W^T + b, with W^T [F, E] and b [E] new float32 initializers
        (X cast to float32 unless it is already)."""
        a = _attrs(node)
        coef = np.asarray(a.get("coefficients", []), np.float32)
        if rows < 1 or coef.size % rows:
            raise ValueError(
                f"{node.op_type} node {node.name!r}: {coef.size} coefficients for {rows} score columns"
            )
        w = coef.reshape(rows, -1)
        intercepts = np.asarray(a.get("intercepts", []) or np.zeros(rows), np.float32)
        if intercepts.size != rows:
            raise ValueError(
                f"{node.op_type} node {node.name!r}: {intercepts.size} intercepts for {rows} score columns"
            )
        base = node.name or node.op_type
        x = node.input[0]
        if self.types.get(x) != TensorProto.FLOAT:
            x = self.op("Cast", [x], f"{base}/X_float", to=TensorProto.FLOAT)
        wt = self.init(np.ascontiguousarray(w.T), f"{base}/coefficients")
        b = self.init(intercepts, f"{base}/intercepts")
        return self.op("Add", [self.op("MatMul", [x, wt], f"{base}/XW"), b], f"{base}/scores", out=out)

    def transform(self, node: onnx.NodeProto, s: str, transform: str, out: str) -> str:
        if transform == "NONE":
            return self.op("Identity", [s], "", out=out)
        if transform == "LOGISTIC":
            return self.op("Sigmoid", [s], "", out=out)
        if transform == "SOFTMAX":
            return self.op("Softmax", [s], "", out=out, axis=1)
        raise ValueError(
            f"{node.op_type} node {node.name!r}: post_transform {transform} is not supported by the "
            "builder's rewrite (NONE, LOGISTIC and SOFTMAX are)"
        )

    def linear_regressor(self, node: onnx.NodeProto) -> None:
        a = _attrs(node)
        targets = int(a.get("targets", 1))
        transform = _text(a.get("post_transform", "NONE"))
        if targets == 1 and transform != "PROBIT":
            transform = "NONE"  # onnxruntime applies only PROBIT to a single target
        if transform == "NONE":
            self.scores(node, targets, out=node.output[0])
        else:
            self.transform(node, self.scores(node, targets), transform, node.output[0])

    def linear_classifier(self, node: onnx.NodeProto) -> None:
        a = _attrs(node)
        transform = _text(a.get("post_transform", "NONE"))
        if "classlabels_strings" in a:
            labels = np.array([_text(v) for v in a["classlabels_strings"]], dtype=object)
        else:
            labels = np.asarray(a.get("classlabels_ints", []), np.int64)
        rows = len(a.get("intercepts", []) or []) or len(labels)
        base = node.name or node.op_type
        s = self.scores(node, rows)
        z_name = node.output[1] if len(node.output) > 1 and node.output[1] else self.names.fresh(f"{base}/z")
        if rows == 1 and len(labels) == 2:
            if transform not in ("NONE", "LOGISTIC", "SOFTMAX"):
                self.transform(node, s, transform, z_name)  # raises
            t = self.op("Sigmoid", [s], f"{base}/t") if transform == "LOGISTIC" else s
            one = self.init(np.ones((1, 1), np.float32), f"{base}/one")
            self.op("Concat", [self.op("Sub", [one, t], f"{base}/1-t"), t], "", out=z_name, axis=1)
        else:
            self.transform(node, s, transform, z_name)
        if node.output and node.output[0]:
            index = self.op("ArgMax", [z_name], f"{base}/argmax", axis=1, keepdims=0)
            table = self.init(labels, f"{base}/classlabels")
            self.op("Gather", [table, index], "", out=node.output[0], axis=0)


# ------------------------------------------------------------------ old opsets
def _upgrade(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """The model at default-domain opset 13 (ai.onnx.ml import kept)."""
    left = sorted({n.op_type for n in model.graph.node if n.domain == ML})
    others = [o for o in model.opset_import if o.domain not in DEFAULT_DOMAINS]
    try:
        upgraded = onnx.version_converter.convert_version(model, MIN_OPSET)
    except Exception as exc:  # the converter raises its own error types
        raise ValueError(
            f"the model imports the default ONNX domain at opset {opset}; upgrading it to "
            f"{MIN_OPSET} failed ({exc}); ai.onnx.ml ops left in the graph: {left}"
        ) from exc
    kept = {o.domain for o in upgraded.opset_import}
    for o in others:
        if o.domain not in kept:
            upgraded.opset_import.append(o)
    return upgraded


# ------------------------------------------------------------------ logits
def _ends_in_softmax(graph: onnx.GraphProto) -> bool:
    """Whether a floating graph output is produced by Softmax (through Identity)."""
    producer = {o: n for n in graph.node for o in n.output if o}
    for out in graph.output:
        node = producer.get(out.name)
        for _ in range(8):
            if node is None or node.domain not in DEFAULT_DOMAINS or node.op_type != "Identity":
                break
            node = producer.get(node.input[0])
        if node is not None and node.domain in DEFAULT_DOMAINS and node.op_type == "Softmax":
            return True
    return False


def _add_logits(model: onnx.ModelProto, softmax_only: bool = False) -> None:
    """Add ``<p>_logits`` outputs for the recognised probability outputs (see
    module doc); ``softmax_only``: recognise Softmax outputs alone (models
    without ``ai.onnx.ml``, where a Sigmoid output is not a class probability)."""
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output if o}
    opset = opset_version(model.opset_import) or MIN_OPSET
    rewriter = _Rewriter(model, opset)
    pairs: dict[str, str] = {}
    for out in list(graph.output):
        if not out.type.HasField("tensor_type") or out.type.tensor_type.elem_type not in FLOAT_TYPES:
            continue
        logits = _logits_for(rewriter, producer, graph, out.name, depth=0, softmax_only=softmax_only)
        if logits is None:
            continue
        name = rewriter.names.fresh(f"{out.name}_logits")
        rewriter.op("Identity", [logits], "", out=name)
        graph.output.append(
            helper.make_tensor_value_info(name, out.type.tensor_type.elem_type, [None, None])
        )
        pairs[out.name] = name
    if not pairs:
        return
    graph.node.extend(rewriter.nodes)
    graph.initializer.extend(rewriter.inits)
    set_metadata(model, LOGITS_OF.removeprefix(PREFIX), pairs)


def _logits_for(rw: _Rewriter, producer: dict, graph: onnx.GraphProto, p: str, depth: int,
                softmax_only: bool = False) -> str | None:
    """Scores l with softmax(l) = p along axis 1, or None when p is not recognised."""
    node = producer.get(p)
    if node is None or node.domain not in DEFAULT_DOMAINS or depth > 8:
        return None
    kind = node.op_type
    if kind == "Identity":
        return _logits_for(rw, producer, graph, node.input[0], depth + 1, softmax_only)
    if kind == "Softmax":
        axis = int(_attrs(node).get("axis", 1 if rw.opset < 13 else -1))
        return node.input[0] if axis in (1, -1) else None
    if kind == "Reshape":
        return _flattened_softmax_logits(producer, node)
    if softmax_only:
        return None
    if kind == "Sigmoid":  # log sigmoid(z) = -softplus(-z)
        z = node.input[0]
        return rw.op("Neg", [rw.op("Softplus", [rw.op("Neg", [z], f"{z}_neg")], f"{z}_softplus")],
                     f"{z}_logsigmoid")
    if kind == "Div" and _is_l1_norm_of(producer, node):
        return _logits_for(rw, producer, graph, node.input[0], depth + 1)
    if kind == "Concat" and len(node.input) == 2:
        # [1 - t, t] with t = sigmoid(s): l = [0, s]
        first, t = (producer.get(i) for i in node.input)
        if (first is not None and first.op_type == "Sub" and first.input[1] == node.input[1]
                and t is not None and t.op_type == "Sigmoid" and _is_one(graph, first.input[0])):
            s = t.input[0]
            zero = rw.op("Sub", [s, s], f"{s}_zero")
            return rw.op("Concat", [zero, s], f"{s}_binary_logits", axis=1)
    return None


def _flattened_softmax_logits(producer: dict, reshape: onnx.NodeProto) -> str | None:
    """p = Reshape(Softmax(Flatten(x, axis=1), axis=-1), Shape(x)): what the
    version converter makes of an opset < 13 Softmax (a softmax over every
    axis from 1 on).  Its logits are the flattened scores ``[N, prod(rest)]``
    (for ``[N, C, 1, 1]`` zoo outputs: ``[N, C]``, class indices ``[N]``)."""
    soft, shape = producer.get(reshape.input[0]), producer.get(reshape.input[1])
    if soft is None or soft.op_type != "Softmax" or shape is None or shape.op_type != "Shape":
        return None
    flat = producer.get(soft.input[0])
    if flat is None or flat.op_type != "Flatten" or int(_attrs(flat).get("axis", 1)) != 1:
        return None
    if int(_attrs(soft).get("axis", -1)) not in (1, -1) or shape.input[0] != flat.input[0]:
        return None
    return soft.input[0]


def _is_l1_norm_of(producer: dict, div: onnx.NodeProto) -> bool:
    """div = x / ReduceSum(Abs(x), axis 1, keepdims)."""
    total = producer.get(div.input[1])
    if total is None or total.op_type != "ReduceSum":
        return False
    absolute = producer.get(total.input[0])
    return absolute is not None and absolute.op_type == "Abs" and absolute.input[0] == div.input[0]


def _is_one(graph: onnx.GraphProto, name: str) -> bool:
    for t in graph.initializer:
        if t.name == name:
            return bool(np.all(mapped.to_array(t) == 1))
    return False


# ------------------------------------------------------------------ check
def _random_feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    for i in model.graph.input:
        if i.name in inits:
            continue
        tt = i.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else 2 for d in tt.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if np.issubdtype(dtype, np.floating):
            feeds[i.name] = rng.standard_normal(shape).astype(dtype)
        else:
            feeds[i.name] = rng.integers(0, 3, shape).astype(dtype)
    return feeds


def _as_array(value: Any) -> np.ndarray:
    """A ZipMap output (a list of {label: prob}) as its [N, C] array."""
    if isinstance(value, list):
        return np.array([[row[k] for k in row] for row in value], dtype=np.float32)
    return np.asarray(value)


def _checkable(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` for onnx's checker: mapped weights (``onnxtrain.io.mapped``, whose
    absolute locations the checker refuses) become typed graph inputs, as
    their data does not matter to the graph's validity."""
    weights = [t for t in model.graph.initializer if mapped.is_mapped(t)]
    if not weights:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    names = {t.name for t in weights}
    kept = [t for t in out.graph.initializer if t.name not in names]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    declared = {i.name for i in out.graph.input}
    for t in weights:
        if t.name not in declared:
            out.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return mapped.rooted(out, copy=False)


def _check(original: onnx.ModelProto, adapted: onnx.ModelProto) -> None:
    """checker + strict shape inference + the same outputs as the original on a random input."""
    from ..runtime.executor import Executor

    try:
        onnx.checker.check_model(_checkable(adapted), full_check=True)
    except Exception as exc:
        raise ValueError(f"the adapted model is not valid ONNX: {exc}") from exc
    feeds = _random_feeds(original)
    try:
        before = Executor(original, label="original model").run(feeds)
    except Exception as exc:
        raise ValueError(
            f"cannot check the adapted model: the original does not run on a random input "
            f"(symbolic dimensions set to 2): {exc}"
        ) from exc
    after = Executor(adapted, label="adapted model").run(feeds)
    for out, want, got in zip(original.graph.output, before, after):
        want, got = _as_array(want), _as_array(got)
        same = want.shape == got.shape and (
            np.array_equal(want, got) if want.dtype.kind in "iuOSUb"
            else np.allclose(want, got, rtol=1e-4, atol=1e-5)
        )
        if not same:
            raise ValueError(
                f"the adapted model differs from the original on output {out.name!r} "
                f"(random input check): expected {want.ravel()[:6]}, got {got.ravel()[:6]}"
            )
