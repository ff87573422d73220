"""Gradients of the classic model-zoo CNNs at their original opsets (7-9).

The onnx package ships "light" versions of AlexNet, ZFNet-512, ResNet-50,
Inception v1/v2, SqueezeNet, ShuffleNet, DenseNet-121 and VGG-19 (opset 9, IR 3):
the real graphs with every weight replaced by a ConstantOfShape node.  Each
test here

* turns the ConstantOfShape weights into seeded random initializers (He
  scale for Conv/Gemm weights; batch-norm statistics and scales near 1) and
  scales the last layer so that the logits are of order 1 (the softmax is
  then far from saturation);
* relabels the model to opset 8 and 7 as well: after the ConstantOfShape
  nodes are gone, every op these models use exists at opset 7 with the same
  semantics (BatchNormalization-7 has spatial=1, MaxPool-1 no Indices, Sum-6
  no broadcasting, which none of them needs);
* builds ``Gradient(loss, weights)`` with ``loss = sum(R * softmax output)``
  (R random), expands it with onnxtrain and runs it on onnxruntime in float32;
* compares the directional derivative <grad, d> with a float64 central
  difference of the loss on ``onnx.reference`` along two random directions d:
  one over every weight, one over the first convolution's weight alone (its
  gradient goes through every layer's backward rule).  The tolerance is
  relative to sum |grad * d|, the size of the terms the inner product adds.

The oracle runs the float64 model on ``onnx.reference`` with five ops
replaced by numpy implementations written here from the spec:
BatchNormalization (the reference's BatchNormalization-9 computes batch
statistics whenever it sees a momentum, which every opset-9 node has by
default, instead of inference mode), LRN (the reference's differs from the
spec and from onnxruntime by 2e-3), Softmax before opset 13 (the reference
hands opset-9 nodes Softmax-13's default axis -1 and does not coerce to
2-D), MaxPool and AveragePool (the reference loops in Python: 10 s for
Inception v1).  The oracle's float64 loss must match onnxruntime's float32
loss to 1e-4, which checks these.

Float32 gradients through 20-70 layers agree with the float64 differences to
2e-5 of sum |grad * d| at worst (Inception v2, first convolution; the same
value comes out of the opset-13 rules on the upgraded model); the tolerance
is 1e-4.  The step is 1e-7 (relative to each weight's scale): with 1e-6 the
differences cross enough ReLU kinks to be off by 6e-5 (ShuffleNet).

The input images are 1x3x224x224 as the models declare, except where the
architecture allows smaller ones (global pooling, or a Reshape before the
first Gemm whose size we fix along with that Gemm's random weight).  The
whole file takes about 60 s on one core (the float64 oracle is computed once
per model and shared by its three opsets).
"""

from __future__ import annotations

import functools
import math
import os
import time

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from onnxtrain.autodiff import expand_gradients
from onnxtrain.core.graph import PREVIEW_DOMAIN
from onnxtrain.core.names import NameGen
from onnxtrain.runtime.executor import Executor
from onnxtrain.runtime.options import default_session_options

#: Minutes of float64 oracles on 2 cores, about our rules and not the
#: libraries' versions: CI runs them in its newest leg only (.ci/run).
pytestmark = pytest.mark.heavy

LIGHT = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")

#: model -> input spatial size (None: the declared 224).
MODELS = {
    "bvlc_alexnet": 99,
    "zfnet512": 99,
    "resnet50": None,
    "inception_v1": None,
    "inception_v2": None,
    "squeezenet": 96,
    "shufflenet": None,
    "densenet121": 64,
    "vgg19": 32,
}
#: |<g, d> - numeric| <= RTOL * sum |g * d|
RTOL = 1e-4
EPS = 1e-7  # the step along d (d is scaled like each weight)


def _path(name: str) -> str:
    path = os.path.join(LIGHT, f"light_{name}.onnx")
    if not os.path.exists(path):
        pytest.skip(f"this onnx ({onnx.__version__}) ships no light zoo model {path}")
    return path


# ====================================================================== the model
def _consumers(graph: onnx.GraphProto) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
    out: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for n in graph.node:
        for j, i in enumerate(n.input):
            out.setdefault(i, []).append((n, j))
    return out


def _random_weight(shape: list[int], user: onnx.NodeProto, slot: int, rng) -> np.ndarray:
    """A random value for the weight in input ``slot`` of ``user``."""
    op = user.op_type
    if op == "Conv" and slot == 1:
        return rng.standard_normal(shape, np.float32) * math.sqrt(2.0 / np.prod(shape[1:]))
    if op == "Gemm" and slot == 1:
        trans_b = any(a.name == "transB" and a.i for a in user.attribute)
        return rng.standard_normal(shape, np.float32) * math.sqrt(2.0 / shape[1 if trans_b else 0])
    if (op == "BatchNormalization" and slot == 1) or op == "Mul":
        return rng.uniform(0.5, 1.0, shape)  # scales
    if op == "BatchNormalization" and slot == 4:
        return rng.uniform(0.5, 1.5, shape)  # variances
    return 0.1 * rng.standard_normal(shape)  # biases, means, shifts


def _materialize(model: onnx.ModelProto, seed: int) -> tuple[onnx.ModelProto, list[str]]:
    """The model with its ConstantOfShape weights as random initializers
    (IR 8: initializers are no longer graph inputs); returns it and the
    weights' names in graph order."""
    rng = np.random.default_rng(seed)
    g = model.graph
    shapes = {t.name: t for t in g.initializer}
    users = _consumers(g)
    nodes, weights, dropped = [], [], set()
    for n in g.node:
        if n.op_type != "ConstantOfShape":
            nodes.append(n)
            continue
        shape = [int(v) for v in numpy_helper.to_array(shapes[n.input[0]])]
        dropped.add(n.input[0])
        user, slot = users[n.output[0]][0]
        while user.op_type in ("Unsqueeze", "Reshape"):  # e.g. per-channel scale: Unsqueeze -> Mul
            user, slot = users[user.output[0]][0]
        value = _random_weight(shape, user, slot, rng).astype(np.float32)
        weights.append(numpy_helper.from_array(value, n.output[0]))
    kept = [t for t in g.initializer if t.name not in dropped]
    del g.node[:]
    g.node.extend(nodes)
    del g.initializer[:]
    g.initializer.extend(kept + weights)
    init_names = {t.name for t in g.initializer} | dropped
    inputs = [i for i in g.input if i.name not in init_names]
    del g.input[:]
    g.input.extend(inputs)
    model.ir_version = 8
    return model, [w.name for w in weights]


def _image(model: onnx.ModelProto) -> onnx.ValueInfoProto:
    """The image input: the graph input that is no initializer."""
    inits = {t.name for t in model.graph.initializer}
    return next(i for i in model.graph.input if i.name not in inits)


def _resize(model: onnx.ModelProto, size: int) -> None:
    """Give the image input (of the light model, before ``_materialize``)
    spatial size ``size``.  A Reshape before a Gemm (AlexNet, ZFNet: to
    [1, 9216]) becomes [1, -1] and the Gemm's weight shape follows."""
    dims = _image(model).type.tensor_type.shape.dim
    dims[2].dim_value = dims[3].dim_value = size
    users = _consumers(model.graph)
    inits = {t.name: t for t in model.graph.initializer}
    makers = {n.output[0]: n for n in model.graph.node}
    for n in model.graph.node:
        gemm = [u for u, slot in users.get(n.output[0], []) if u.op_type == "Gemm" and slot == 0]
        if n.op_type != "Reshape" or not gemm:
            continue
        inits[n.input[1]].CopyFrom(numpy_helper.from_array(np.array([1, -1], np.int64), n.input[1]))
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        shape = next(v for v in inferred.graph.value_info if v.name == n.input[0]).type.tensor_type.shape
        flat = math.prod(d.dim_value for d in shape.dim[1:])
        weight_shape = inits[makers[gemm[0].input[1]].input[0]]  # its ConstantOfShape's shape
        assert any(a.name == "transB" and a.i for a in gemm[0].attribute)
        out_features = int(numpy_helper.to_array(weight_shape)[0])
        new_shape = np.array([out_features, flat], np.int64)
        weight_shape.CopyFrom(numpy_helper.from_array(new_shape, weight_shape.name))


def _last_layer(model: onnx.ModelProto) -> onnx.NodeProto:
    """The Gemm or Conv that computes the logits (the Softmax's input, if any,
    up to Reshape, Dropout, Relu and pooling, which commute with a positive scale)."""
    makers = {o: n for n in model.graph.node for o in n.output}
    node = makers[model.graph.output[0].name]
    passing = ("Softmax", "Reshape", "Flatten", "Dropout", "Relu", "GlobalAveragePool", "AveragePool")
    while node.op_type in passing:
        node = makers[node.input[0]]
    assert node.op_type in ("Gemm", "Conv"), node.op_type
    return node


@functools.lru_cache(maxsize=None)
def zoo_case(name: str):
    """(float32 model at opset 9, weight names, feeds, directions, float64 directional derivatives),
    computed once per model and shared by its opsets."""
    model = onnx.load(_path(name))
    if MODELS[name] is not None:
        _resize(model, MODELS[name])
    model, weights = _materialize(model, seed=len(name))
    rng = np.random.default_rng(0)
    x = _image(model)
    image = rng.standard_normal([d.dim_value for d in x.type.tensor_type.shape.dim]).astype(np.float32)
    # scale the last layer so that the logits have a standard deviation of 2
    last = _last_layer(model)
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.append(helper.make_tensor_value_info(last.output[0], TensorProto.FLOAT, None))
    logits = Executor(probe).run({x.name: image}, [last.output[0]])[0]
    factor = 2.0 / float(np.std(logits))
    inits = {t.name: t for t in model.graph.initializer}
    makers = {o: n for n in model.graph.node for o in n.output}
    for w in last.input[1:]:
        while w in makers:  # a weight reshaped on its way (Inception v1)
            w = makers[w].input[0]
        t = inits[w]
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * np.float32(factor), w))
    out = model.graph.output[0]
    r = rng.standard_normal([d.dim_value for d in out.type.tensor_type.shape.dim]).astype(np.float32)
    feeds = {x.name: image, "R": r}
    first_conv = next(n.input[1] for n in model.graph.node if n.op_type == "Conv")
    directions = {"all": {}, "first conv": {}}
    for w in weights:
        v = numpy_helper.to_array(inits[w])
        d = rng.standard_normal(v.shape) * (float(np.std(v)) or 1.0)
        directions["all"][w] = d
        if w == first_conv:
            directions["first conv"][w] = d
    loss32 = float(Executor(_loss_model(model)).run(feeds, ["loss"])[0])
    numeric, loss64 = _oracle(model, feeds, directions)
    np.testing.assert_allclose(loss64, loss32, rtol=1e-4, atol=1e-5,
                               err_msg=f"{name}: float64 oracle and onnxruntime disagree")
    return model, weights, feeds, directions, numeric


def _loss_model(model: onnx.ModelProto, opset: int = 9) -> onnx.ModelProto:
    """loss = sum(R * output), at ``opset``."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    out = g.output[0]
    g.input.append(helper.make_tensor_value_info("R", out.type.tensor_type.elem_type,
                                                 [d.dim_value for d in out.type.tensor_type.shape.dim]))
    g.node.append(helper.make_node("Mul", [out.name, "R"], ["weighted"]))
    g.node.append(helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0))
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("loss", out.type.tensor_type.elem_type, []))
    del m.opset_import[:]
    m.opset_import.append(helper.make_opsetid("", opset))
    return m


# ====================================================================== the oracle
class BatchNormalization(OpRun):
    """Inference-mode BatchNormalization (the zoo nodes have one output)."""

    op_domain = ""

    def _run(self, x, scale, bias, mean, var, epsilon=None, **_):
        eps = 1e-5 if epsilon is None else epsilon
        shape = (-1,) + (1,) * (x.ndim - 2)
        inv = scale.reshape(shape) / np.sqrt(var.reshape(shape) + eps)
        return ((x - mean.reshape(shape)) * inv + bias.reshape(shape),)


class Softmax(OpRun):
    """Softmax-1/11: over the 2-D coercion [prod(d0..d_axis-1), prod(d_axis..)]."""

    op_domain = ""

    def _run(self, x, axis=None):
        # the attribute defaults handed in are Softmax-13's (axis=-1): read the node's own
        given = [a.i for a in self.onnx_node.attribute if a.name == "axis"]
        axis = given[0] % x.ndim if given else 1
        flat = x.reshape(int(np.prod(x.shape[:axis])), -1)
        e = np.exp(flat - flat.max(axis=1, keepdims=True))
        return ((e / e.sum(axis=1, keepdims=True)).reshape(x.shape),)


class LRN(OpRun):
    """y = x / (bias + alpha / size * sum of x^2 over the channels
    [c - floor((size-1)/2), c + ceil((size-1)/2)])^beta"""

    op_domain = ""

    def _run(self, x, alpha=None, beta=None, bias=None, size=None):
        alpha = 1e-4 if alpha is None else alpha
        beta = 0.75 if beta is None else beta
        bias = 1.0 if bias is None else bias
        channels = x.shape[1]
        squares = np.zeros_like(x)
        for c in range(channels):
            lo, hi = max(0, c - (size - 1) // 2), min(channels, c + size // 2 + 1)
            squares[:, c] = (x[:, lo:hi] ** 2).sum(axis=1)
        return (x / (bias + alpha / size * squares) ** beta,)


class MaxPool(OpRun):
    """MaxPool without dilations or ceil_mode, padding with -inf."""

    op_domain = ""

    def _run(self, x, kernel_shape=None, strides=None, pads=None, auto_pad=None, storage_order=None,
             dilations=None, ceil_mode=None):
        assert auto_pad in (None, "NOTSET") and not ceil_mode, "unsupported"
        assert all(d == 1 for d in dilations or []), "unsupported"
        k = len(kernel_shape)
        pads = pads or [0] * (2 * k)
        strides = strides or [1] * k
        padded = np.pad(x, [(0, 0), (0, 0)] + list(zip(pads[:k], pads[k:])), constant_values=-np.inf)
        win = np.lib.stride_tricks.sliding_window_view(padded, kernel_shape, axis=tuple(range(2, k + 2)))
        win = win[(slice(None), slice(None)) + tuple(slice(None, None, s) for s in strides)]
        return (win.max(axis=tuple(range(-k, 0))),)


class AveragePool(OpRun):
    """AveragePool without ceil_mode: window sums of the zero-padded input over
    the number of positions counted (inside the input unless count_include_pad)."""

    op_domain = ""

    def _run(self, x, kernel_shape=None, strides=None, pads=None, auto_pad=None, ceil_mode=None,
             count_include_pad=None, dilations=None):
        assert auto_pad in (None, "NOTSET") and not ceil_mode, "unsupported"
        assert all(d == 1 for d in dilations or []), "unsupported"
        k = len(kernel_shape)
        pads = pads or [0] * (2 * k)
        strides = strides or [1] * k
        widths = [(0, 0), (0, 0)] + list(zip(pads[:k], pads[k:]))

        def window_sums(a):
            spatial = tuple(range(2, k + 2))
            win = np.lib.stride_tricks.sliding_window_view(np.pad(a, widths), kernel_shape, axis=spatial)
            win = win[(slice(None), slice(None)) + tuple(slice(None, None, s) for s in strides)]
            return win.sum(axis=tuple(range(-k, 0)))

        counts = np.prod(kernel_shape) if count_include_pad else window_sums(np.ones((1, 1) + x.shape[2:]))
        return (window_sums(x) / counts,)


def _as_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    for t in g.initializer:
        if t.data_type == TensorProto.FLOAT:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))
    for v in list(g.input) + list(g.output) + list(g.value_info):
        if v.type.tensor_type.elem_type == TensorProto.FLOAT:
            v.type.tensor_type.elem_type = TensorProto.DOUBLE
    return m


def _oracle(model, feeds, directions) -> tuple[dict[str, float], float]:
    """Central differences of the float64 loss along each direction, and the loss."""
    m64 = _as_float64(_loss_model(model))
    point = {k: v.astype(np.float64) for k, v in feeds.items()}
    point.update({t.name: numpy_helper.to_array(t).astype(np.float64) for t in m64.graph.initializer
                  if t.data_type == TensorProto.DOUBLE})
    # the weights become inputs so that they can be perturbed
    g = m64.graph
    for t in list(g.initializer):
        if t.name in directions["all"]:
            g.input.append(helper.make_tensor_value_info(t.name, TensorProto.DOUBLE, list(t.dims)))
    kept = [t for t in g.initializer if t.name not in directions["all"]]
    del g.initializer[:]
    g.initializer.extend(kept)
    feeds64 = {k: v for k, v in point.items() if k in {i.name for i in g.input}}
    ev = ReferenceEvaluator(m64, new_ops=[BatchNormalization, Softmax, MaxPool, LRN, AveragePool])

    def loss(values):
        return float(ev.run(["loss"], values)[0])

    numeric, middle = {}, []
    for key, d in directions.items():
        plus = loss({k: v + EPS * d[k] if k in d else v for k, v in feeds64.items()})
        minus = loss({k: v - EPS * d[k] if k in d else v for k, v in feeds64.items()})
        numeric[key] = (plus - minus) / (2 * EPS)
        middle.append((plus + minus) / 2)  # the loss at the point, up to O(EPS^2)
    return numeric, middle[0]


# ====================================================================== the tests
def _gradient_model(model: onnx.ModelProto, weights: list[str], opset: int) -> tuple[onnx.ModelProto, list[str]]:
    m = _loss_model(model, opset)
    m.opset_import.append(helper.make_opsetid(PREVIEW_DOMAIN, 1))
    g = m.graph
    grads = [f"grad/{w}" for w in weights]
    g.node.append(helper.make_node("Gradient", weights, grads, domain=PREVIEW_DOMAIN, xs=weights,
                                   y="loss", name="zoo_gradient"))
    dims = {t.name: list(t.dims) for t in g.initializer}
    g.output.extend(helper.make_tensor_value_info(gr, TensorProto.FLOAT, dims[w]) for gr, w in zip(grads, weights))
    names = {i.name for i in g.input} | {t.name for t in g.initializer}
    names |= {o for n in g.node for o in n.output}
    available = [i.name for i in g.input] + [t.name for t in g.initializer]
    expand_gradients(g, m.opset_import, NameGen(names), available)
    onnx.checker.check_model(m)
    return m, grads


# One model's tests share its float64 oracle (``zoo_case`` is cached per
# process): under ``pytest -n N --dist loadgroup`` (.ci/run) they run in one worker.
@pytest.mark.parametrize("opset", [9, 8, 7])
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xdist_group(f"zoo-{n}")) for n in MODELS])
def test_zoo_light_gradient(name, opset):
    start = time.perf_counter()
    model, weights, feeds, directions, numeric = zoo_case(name)
    prepared = time.perf_counter()
    gm, grads = _gradient_model(model, weights, opset)
    # The rules are checked with onnxruntime's float32 kernels short of its
    # level-3 layout transforms; those (NCHWc convolutions on AVX-512 hosts)
    # round differently along the long backward chains: on an AMD EPYC,
    # shufflenet's first-conv direction is off by 1.6e-4 of sum |g * d| with
    # them and by 6e-6 without.  The sessions' own setting is checked too,
    # to ten times the bound, at the newest opset (the layout transforms do
    # not depend on the opset the rules emitted at; 7 and 8 would repeat it).
    extended = default_session_options()
    extended.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    wrong, errors = [], []
    settings = ((extended, RTOL), (None, 10 * RTOL)) if opset == 9 else ((extended, RTOL),)
    for options, rtol in settings:
        values = dict(zip(weights, Executor(gm, session_options=options).run(feeds, grads)))
        for key, d in directions.items():
            terms = [values[w].astype(np.float64) * d[w] for w in d]
            predicted = sum(float(t.sum()) for t in terms)
            scale = sum(float(np.abs(t).sum()) for t in terms)
            errors.append(abs(predicted - numeric[key]) / scale)
            if not abs(predicted - numeric[key]) <= rtol * scale:
                wrong.append(f"{key}: analytic {predicted:.8g}, numeric {numeric[key]:.8g}, "
                             f"scale {scale:.3g} ({'extended' if options else 'default'} options)")
    print(f"{name} opset {opset}: oracle {prepared - start:.2f}s, gradient {time.perf_counter() - prepared:.2f}s, "
          f"errors / scale {', '.join(f'{v:.1e}' for v in errors)}")
    assert not wrong, f"{name} at opset {opset}: " + "; ".join(wrong)


@pytest.mark.xdist_group("zoo-squeezenet")
def test_zoo_light_trains_at_opset7():
    """A standard training model around SqueezeNet relabelled to opset 7 (the
    algorithm: the forward pass, loss = sum(R * softmax), Gradient over every
    weight, plain SGD, bound back through update_binding) trains on
    onnxruntime through TrainingSession: the loss falls step by step."""
    model, weights, feeds, _, _ = zoo_case("squeezenet")
    model = _loss_model(model, opset=7)  # the main graph: the inference model with its loss
    main = model.graph
    lr = 2e-4
    # the algorithm: its own copy of the forward pass (train/...), then Gradient and SGD
    rename = {o: f"train/{o}" for n in main.node for o in n.output}
    nodes = []
    for k, n in enumerate(main.node):
        copy = onnx.NodeProto()
        copy.CopyFrom(n)
        copy.name = f"train/{k}"
        copy.input[:] = [rename.get(i, i) for i in n.input]
        copy.output[:] = [rename[o] for o in n.output]
        nodes.append(copy)
    loss = rename["loss"]
    grads = [f"grad/{w}" for w in weights]
    nodes.append(helper.make_node("Gradient", weights, grads, domain=PREVIEW_DOMAIN, xs=weights, y=loss,
                                  name="train/gradient"))
    inits = [numpy_helper.from_array(np.array(lr, np.float32), "lr")]
    for w, g in zip(weights, grads):
        nodes.append(helper.make_node("Mul", ["lr", g], [f"{g}/step"]))
        nodes.append(helper.make_node("Sub", [w, f"{g}/step"], [f"new/{w}"]))
    dims = {t.name: list(t.dims) for t in main.initializer}
    outputs = [helper.make_tensor_value_info(loss, TensorProto.FLOAT, [])]
    outputs += [helper.make_tensor_value_info(f"new/{w}", TensorProto.FLOAT, dims[w]) for w in weights]
    info = onnx.TrainingInfoProto()
    info.algorithm.CopyFrom(helper.make_graph(nodes, "algorithm", [], outputs, inits))
    for w in weights:
        info.update_binding.add(key=w, value=f"new/{w}")
    model.training_info.append(info)
    model.opset_import.append(helper.make_opsetid(PREVIEW_DOMAIN, 1))
    onnx.checker.check_model(model)

    from onnxtrain import TrainingSession

    session = TrainingSession(model)
    losses = [float(session.train_step(feeds)[loss]) for _ in range(4)]
    print("squeezenet opset 7 training losses", losses)
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


@pytest.mark.xdist_group("zoo-zfnet512")
def test_zoo_light_builds_with_defaults():
    """``build.training_model`` with its defaults on a zoo model as shipped
    (opset 9, a final Softmax over Flatten): the builder upgrades the opset,
    cross-entropy reads the logits before the Softmax (never log_softmax of
    probabilities), so the first loss is -log p[label] of the original model,
    and the loss falls under the default Adam (to 0: one image is memorised)."""
    from onnxtrain import TrainingSession, build

    model, _, feeds, _, _ = zoo_case("zfnet512")  # no Dropout: the training forward is the model's
    image_name = _image(model).name
    image = feeds[image_name]
    probs = Executor(model).run({image_name: image}, [model.graph.output[0].name])[0].reshape(1, -1)
    label = np.array([int(np.argmin(probs))], np.int64)
    tm = build.training_model(model)
    assert max(o.version for o in tm.opset_import if o.domain in ("", "ai.onnx")) >= 13
    sess = TrainingSession(tm)
    losses = [float(sess.train_step({image_name: image, "target": label})["loss"]) for _ in range(3)]
    np.testing.assert_allclose(losses[0], -np.log(probs[0, label[0]]), rtol=1e-4)
    assert np.isfinite(losses).all() and losses[1] < losses[0] and losses[2] <= losses[1], losses
