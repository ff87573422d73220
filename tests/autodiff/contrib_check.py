"""Checking the gradient rules of onnxruntime contrib ops (com.microsoft, and
the default-domain ops onnxruntime adds), most of which onnxruntime runs only
in float32.

Each op is paired with a float64 numpy transcription of its forward pass (the
"decomposition", written here independently of the rules):

* ``check_forward``: onnxruntime's own float32 kernel matches the
  decomposition (so the decomposition is the op);
* ``check_grad``: the rule's backward nodes, run in float64, match central
  differences of the decomposition's loss ``L = sum_k sum(R_k * out_k)``.
  The model holds the op node, the loss and a Gradient; after expansion the
  op node itself is removed and its outputs are fed with the decomposition's
  float64 values, so every node that runs is a standard op in float64.  A
  rule that replaces the op node (``VJPContext.replace_forward``) leaves
  standard ops computing its outputs: those run instead of the feeds, and
  ``forward_out`` receives what they computed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from onnxtrain.autodiff import expand_gradients
from onnxtrain.core.graph import PREVIEW_DOMAIN
from onnxtrain.core.names import NameGen

MS = "com.microsoft"


def _vi(name: str, arr: np.ndarray) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arr.dtype), list(arr.shape))


def _model(nodes, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray],
           value_info: Mapping[str, np.ndarray] = {}, opset: int = 21) -> onnx.ModelProto:
    graph = helper.make_graph(
        list(nodes), "contrib", [_vi(k, v) for k, v in inputs.items()],
        [_vi(k, v) for k, v in outputs.items()], value_info=[_vi(k, v) for k, v in value_info.items()],
    )
    imports = [helper.make_opsetid("", opset), helper.make_opsetid(MS, 1), helper.make_opsetid(PREVIEW_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=imports)
    model.ir_version = 10
    return model


def _node(op_type: str, inputs: Sequence[str], n_out: int, domain: str, attrs: Mapping) -> onnx.NodeProto:
    return helper.make_node(op_type, list(inputs), [f"out{i}" for i in range(n_out)], name="op",
                            domain=domain, **dict(attrs))


def run_op(op_type, inputs: Mapping[str, np.ndarray | None], attrs=None, *, n_out=1, domain=MS,
           out_like: Sequence[np.ndarray], opset: int = 21) -> list[np.ndarray]:
    """Run the op alone on onnxruntime (None inputs are left out)."""
    names = [k if v is not None else "" for k, v in inputs.items()]
    feeds = {k: v for k, v in inputs.items() if v is not None}
    node = _node(op_type, names, n_out, domain, attrs or {})
    outs = {f"out{i}": o for i, o in enumerate(out_like)}
    model = _model([node], feeds, outs, opset=opset)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(list(outs), feeds)


def check_forward(op_type, inputs, attrs, decomposition: Callable, *, n_out=1, domain=MS,
                  rtol=1e-4, atol=1e-5, rows: Callable | None = None, opset: int = 21) -> None:
    """onnxruntime's float32 kernel against the float64 decomposition.
    ``rows(k, arr)`` selects the entries of output k to compare (default all)."""
    f32 = {k: (v.astype(np.float32) if v is not None and v.dtype == np.float64 else v) for k, v in inputs.items()}
    ref = decomposition(**{k: v for k, v in inputs.items()})
    ref = ref if isinstance(ref, tuple) else (ref,)
    got = run_op(op_type, f32, attrs, n_out=n_out, domain=domain, out_like=[r.astype(np.float32) for r in ref],
                 opset=opset)
    for k, (g, r) in enumerate(zip(got, ref)):
        if rows is not None:
            g, r = rows(k, g), rows(k, r)
        np.testing.assert_allclose(g, r, rtol=rtol, atol=atol, err_msg=f"{op_type} output {k}")


def check_grad(op_type, inputs: Mapping[str, np.ndarray | None], attrs, decomposition: Callable, wrt: Sequence[str],
               *, n_out=1, diff_outputs: Sequence[int] = (0,), domain=MS, seed=0, eps=1e-6,
               rtol=1e-6, directions=2, weights: Mapping[int, np.ndarray] | None = None,
               opset: int = 21, f32: bool = False, forward_out: dict | None = None) -> dict[str, np.ndarray]:
    """The rule's float64 gradient against central differences of the decomposition.
    Returns the analytic gradients.  ``f32``: the backward runs in float32 (for
    rules that emit ops onnxruntime has no float64 kernel for, such as Erf);
    the differences stay float64, ``rtol`` should be float32's."""
    rng = np.random.default_rng(seed)
    feeds = {k: v for k, v in inputs.items() if v is not None}
    low = (lambda a: a.astype(np.float32) if a.dtype == np.float64 else a) if f32 else (lambda a: a)  # noqa: E731
    names = [k if v is not None else "" for k, v in inputs.items()]

    def forward(values):
        out = decomposition(**{k: values.get(k) if v is not None else None for k, v in inputs.items()})
        return out if isinstance(out, tuple) else (out,)

    outs = forward(feeds)
    weights = dict(weights or {})
    for k in diff_outputs:
        weights.setdefault(k, rng.standard_normal(outs[k].shape))
    nodes = [_node(op_type, names, n_out, domain, attrs or {})]
    sums = []
    for k in diff_outputs:
        nodes.append(helper.make_node("Mul", [f"out{k}", f"R{k}"], [f"w{k}"]))
        nodes.append(helper.make_node("ReduceSum", [f"w{k}"], [f"s{k}"], keepdims=0))
        sums.append(f"s{k}")
    nodes.append(helper.make_node("Sum", sums, ["loss"]))
    grads = [f"grad_{x}" for x in wrt]
    nodes.append(helper.make_node("Gradient", list(wrt), grads, domain=PREVIEW_DOMAIN, xs=list(wrt), y="loss"))
    r_feeds = {f"R{k}": weights[k] for k in diff_outputs}
    feeds_run = {k: low(v) for k, v in {**feeds, **r_feeds}.items()}
    model = _model(nodes, feeds_run, {g: feeds_run[x] for g, x in zip(grads, wrt)},
                   value_info={f"out{i}": low(o) for i, o in enumerate(outs)}, opset=opset)
    expand_gradients(model.graph, model.opset_import, NameGen.from_graph(model.graph), list(feeds) + list(r_feeds))
    # The op's outputs are fed (its node removed) unless its rule replaced the node
    # (replace_forward): then the standard ops that stand for it compute them.
    kept = [n for n in model.graph.node if n.name != "op"]
    assert all(n.domain in ("", "ai.onnx") for n in kept), "the backward pass emits standard ops only"
    del model.graph.node[:]
    model.graph.node.extend(kept)
    made = {o for n in kept for o in n.output}
    out_feeds = {f"out{i}": low(o) for i, o in enumerate(outs) if f"out{i}" not in made}
    model.graph.input.extend(_vi(k, v) for k, v in out_feeds.items())
    computed = [f"out{i}" for i in range(len(outs)) if f"out{i}" in made]
    model.graph.output.extend(_vi(k, low(outs[int(k[3:])])) for k in computed)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    values = sess.run(grads + computed, {**feeds_run, **out_feeds})
    raw = dict(zip(wrt, values))
    if forward_out is not None:
        forward_out.update(zip(computed, values[len(grads):]))
    for x, g in raw.items():
        assert g.shape == feeds[x].shape and g.dtype == feeds_run[x].dtype, f"gradient of {x}: {g.shape} {g.dtype}"
    analytic = {x: g.astype(np.float64) for x, g in raw.items()}

    def loss(values):
        o = forward(values)
        return sum(float(np.sum(weights[k] * o[k])) for k in diff_outputs)

    for _ in range(directions):
        d = {x: rng.standard_normal(feeds[x].shape) for x in wrt}
        plus = {**feeds, **{x: feeds[x] + eps * d[x] for x in wrt}}
        minus = {**feeds, **{x: feeds[x] - eps * d[x] for x in wrt}}
        numeric = (loss(plus) - loss(minus)) / (2 * eps)
        predicted = sum(float(np.sum(analytic[x] * d[x])) for x in wrt)
        np.testing.assert_allclose(predicted, numeric, rtol=rtol, atol=1e-7,
                                   err_msg=f"{op_type} directional derivative")
    return analytic
