"""A decoder's chains as torch's dynamo exporter writes them, differentiated by
onnxtrain's rules, as standard-op programs and as the kernels' programs
(``kernels.llm.rewrite``), with float64 references: shared by
tests/kernels/test_llm_kernels.py and benchmarks/llm_kernels.py.

Each builder returns a ``Chain``: the standard program (forward, a loss
sum(y * t) with t a feed, and the Gradient expanded), its feeds, the outputs
to compare and a float64 reference of them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff import expand_gradients
from onnxtrain.core.graph import PREVIEW_DOMAIN
from onnxtrain.core.names import NameGen
from onnxtrain.kernels import library, llm
from onnxtrain.kernels.fuse import KERNEL_DOMAIN
from onnxtrain.runtime.executor import default_session_options

OPSET = 20


@dataclass
class Chain:
    model: onnx.ModelProto  # the standard program
    feeds: dict[str, np.ndarray]
    outputs: list[str]
    reference: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]  # float64

    def fused(self) -> tuple[onnx.ModelProto, int]:
        m = onnx.ModelProto()
        m.CopyFrom(self.model)
        count = llm.rewrite(m.graph, list(m.opset_import), KERNEL_DOMAIN)
        m.opset_import.append(helper.make_opsetid(KERNEL_DOMAIN, 1))
        return m, count


def session(model: onnx.ModelProto, threads: int | None = None, fold: bool = True) -> ort.InferenceSession:
    """onnxtrain's session options; ``fold=False``: without constant folding, as
    the session runs a program with MatMulNBits (its unpacked weights would be
    folded into float copies, and multiplied as constants)."""
    so = default_session_options(threads)
    lib = library.library()
    if lib and any(o.domain == KERNEL_DOMAIN for o in model.opset_import):
        so.register_custom_ops_library(lib)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"],
                                disabled_optimizers=None if fold else ["ConstantFolding"])


def run(model: onnx.ModelProto, chain: Chain, fold: bool = True) -> dict[str, np.ndarray]:
    return dict(zip(chain.outputs, session(model, fold=fold).run(chain.outputs, chain.feeds)))


def _const(name: str, value, dtype=np.float32) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value, dtype), name))


def _dims(name: str, a: np.ndarray, named: dict[str, list] | None) -> list:
    """The declared dims of feed ``name``: ``named``'s where given (symbolic
    dims as strings, as an exporter leaves batch and sequence), else the array's."""
    return list(named[name]) if named and name in named else list(a.shape)


def _program(nodes, feeds: dict[str, np.ndarray], y: list[str], xs: list[str], cotangents: dict[str, str],
             named: dict[str, list] | None = None) -> tuple:
    """nodes + loss = sum of sum(y_k * t_k) + Gradient(xs) -> (model, outputs)."""
    nodes = list(nodes)
    terms = []
    for out, t in cotangents.items():
        nodes.append(helper.make_node("Mul", [out, t], [f"{out}_t"]))
        nodes.append(helper.make_node("ReduceSum", [f"{out}_t"], [f"{out}_s"], keepdims=0))
        terms.append(f"{out}_s")
    loss = terms[0] if len(terms) == 1 else "loss"
    if len(terms) > 1:
        nodes.append(helper.make_node("Sum", terms, ["loss"]))
    grads = [f"grad_{x}" for x in xs]
    nodes.append(helper.make_node("Gradient", xs, grads, domain=PREVIEW_DOMAIN, xs=xs, y=loss))
    outputs = y + grads
    graph = helper.make_graph(
        nodes, "chain",
        [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), _dims(k, v, named))
         for k, v in feeds.items()],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs])
    imports = [helper.make_opsetid("", OPSET), helper.make_opsetid(PREVIEW_DOMAIN, 1)]
    expand_gradients(graph, imports, NameGen.from_graph(graph), list(feeds))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return model, outputs


# ------------------------------------------------------------ RMSNorm
def rms_norm(shape=(2, 5, 64), residual: bool = False, seed: int = 0, eps: float = 1e-6, readers: int = 1,
             train_w: bool = True) -> Chain:
    """y = w * (x * 1 / sqrt(mean(x^2) + eps)); with ``residual`` the loss reads
    x + y, so dx is a Sum of the residual's gradient and the norm's terms;
    ``readers`` > 1: y read that many times (as q, k and v read a norm), so dy
    is a Sum of as many terms."""
    rng = np.random.default_rng(seed)
    d = shape[-1]
    feeds = {"x": rng.standard_normal(shape).astype(np.float32),
             "w": rng.uniform(0.8, 1.2, d).astype(np.float32),
             "t": rng.standard_normal(shape).astype(np.float32)}
    for k in range(1, readers):
        feeds[f"t{k}"] = rng.standard_normal(shape).astype(np.float32)
    nodes = [_const("two", 2.0), _const("axes", [-1], np.int64), _const("eps", eps),
             helper.make_node("Pow", ["x", "two"], ["pow"]),
             helper.make_node("ReduceMean", ["pow", "axes"], ["mean"], keepdims=1),
             helper.make_node("Add", ["mean", "eps"], ["add"]),
             helper.make_node("Sqrt", ["add"], ["sqrt"]),
             helper.make_node("Reciprocal", ["sqrt"], ["rsqrt"]),
             helper.make_node("Mul", ["x", "rsqrt"], ["n"]),
             helper.make_node("Mul", ["w", "n"], ["y"])]
    out = "y"
    if residual:
        nodes.append(helper.make_node("Add", ["x", "y"], ["z"]))
        out = "z"
    cotangents = {out: "t"}
    for k in range(1, readers):
        nodes.append(helper.make_node("Identity", [out], [f"{out}{k}"]))
        cotangents[f"{out}{k}"] = f"t{k}"
    model, outputs = _program(nodes, feeds, [out], ["x", "w"] if train_w else ["x"], cotangents)

    def reference(f):
        x, w = (f[k].astype(np.float64) for k in ("x", "w"))
        t = f["t"].astype(np.float64) + sum(f[f"t{k}"].astype(np.float64) for k in range(1, readers))
        r = 1 / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(eps).astype(np.float64))
        n = x * r
        g = t * w
        dx = r * (g - n * (g * n).mean(-1, keepdims=True))
        return {out: w * n + (x if residual else 0), "grad_x": dx + (t if residual else 0),
                **({"grad_w": (t * n).reshape(-1, d).sum(0)} if train_w else {})}
    return Chain(model, feeds, outputs, reference)


# ------------------------------------------------------------ SiLU * gate
def silu_mul(shape=(2, 5, 48), two_readers: bool = False, seed: int = 0, named: bool = False) -> Chain:
    """h = (a * sigmoid(a)) * b; with ``two_readers`` the loss reads h twice, so
    dh is an Add of two parts; ``named``: batch and sequence declared as named dims."""
    rng = np.random.default_rng(seed)
    feeds = {k: (rng.standard_normal(shape) * 3).astype(np.float32) for k in ("a", "b", "t", "u")}
    if not two_readers:
        del feeds["u"]
    nodes = [helper.make_node("Sigmoid", ["a"], ["s"]),
             helper.make_node("Mul", ["a", "s"], ["silu"]),
             helper.make_node("Mul", ["silu", "b"], ["h"])]
    cot = {"h": "t"}
    if two_readers:
        nodes.append(helper.make_node("Identity", ["h"], ["h2"]))
        cot["h2"] = "u"
    dims = {k: ["batch", "sequence", *shape[2:]] for k in feeds} if named else None
    model, outputs = _program(nodes, feeds, ["h"], ["a", "b"], cot, dims)

    def reference(f):
        a, b = f["a"].astype(np.float64), f["b"].astype(np.float64)
        t = f["t"].astype(np.float64) + (f["u"].astype(np.float64) if two_readers else 0)
        s = 1 / (1 + np.exp(-a))
        return {"h": a * s * b, "grad_a": t * b * (s + a * s * (1 - s)), "grad_b": t * a * s}
    return Chain(model, feeds, outputs, reference)


# ------------------------------------------------------------ RoPE
def rope(shape=(2, 3, 7, 16), table_rank: int = 4, seed: int = 0) -> Chain:
    """y = x * cos + Concat(-x[h:], x[:h]) * sin, the tables [1, .., S, D]."""
    rng = np.random.default_rng(seed)
    s, d = shape[-2:]
    angles = np.arange(s)[:, None] * (1.0 / 10000 ** (np.arange(0, d, 2) / d))[None, :]
    angles = np.concatenate([angles, angles], -1).reshape((1,) * (table_rank - 2) + (s, d))
    feeds = {"x": rng.standard_normal(shape).astype(np.float32),
             "cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32),
             "t": rng.standard_normal(shape).astype(np.float32)}
    big = np.iinfo(np.int64).max
    nodes = [_const("starts0", [0], np.int64), _const("h", [d // 2], np.int64), _const("big", [big], np.int64),
             _const("last", [-1], np.int64), _const("one", [1], np.int64),
             helper.make_node("Mul", ["x", "cos"], ["xc"]),
             helper.make_node("Slice", ["x", "starts0", "h", "last", "one"], ["lo"]),
             helper.make_node("Slice", ["x", "h", "big", "last", "one"], ["hi"]),
             helper.make_node("Neg", ["hi"], ["neg"]),
             helper.make_node("Concat", ["neg", "lo"], ["rot"], axis=-1),
             helper.make_node("Mul", ["rot", "sin"], ["rs"]),
             helper.make_node("Add", ["xc", "rs"], ["y"])]
    model, outputs = _program(nodes, feeds, ["y"], ["x"], {"y": "t"})

    def reference(f):
        x, c, sn, t = (f[k].astype(np.float64) for k in ("x", "cos", "sin", "t"))
        h = d // 2

        def rot(v):
            return np.concatenate([-v[..., h:], v[..., :h]], -1)

        z = t * sn
        dx = t * c + np.concatenate([z[..., h:], -z[..., :h]], -1)
        return {"y": x * c + rot(x) * sn, "grad_x": dx}
    return Chain(model, feeds, outputs, reference)


# ------------------------------------------------------------ the guarded softmax
def guarded_softmax(shape=(2, 3, 6, 6), masked_rows: int = 1, seed: int = 0) -> Chain:
    """q = Where(IsNaN(p), 0, p), p = Softmax(scores); the first ``masked_rows``
    query rows of each head all -inf (NaN in p, 0 in q)."""
    rng = np.random.default_rng(seed)
    scores = (rng.standard_normal(shape) * 2).astype(np.float32)
    scores[..., :masked_rows, :] = -np.inf
    feeds = {"scores": scores, "t": rng.standard_normal(shape).astype(np.float32)}
    nodes = [_const("zero", 0.0),
             helper.make_node("Softmax", ["scores"], ["p"], axis=-1),
             helper.make_node("IsNaN", ["p"], ["nan"]),
             helper.make_node("Where", ["nan", "zero", "p"], ["q"])]
    model, outputs = _program(nodes, feeds, ["q"], ["scores"], {"q": "t"})

    def reference(f):
        s, t = f["scores"].astype(np.float64), f["t"].astype(np.float64)
        with np.errstate(invalid="ignore"):
            e = np.exp(s - s.max(-1, keepdims=True))
            q = np.nan_to_num(e / e.sum(-1, keepdims=True), nan=0.0)
        return {"q": q, "grad_scores": q * (t - (t * q).sum(-1, keepdims=True))}
    return Chain(model, feeds, outputs, reference)


def masked_softmax(shape=(2, 3, 6, 72), mask_shape=(2, 1, 6, 72), guard: bool = True, seed: int = 0,
                   lowest: float = -np.inf, named: bool = False, alternate: bool = False) -> Chain:
    """p = Softmax(scores + mask) over the last axis (the exporter's attention:
    a causal mask of 0 and ``lowest``, broadcast over heads), guarded as the
    exporter writes it when ``guard``; the mask's last rows of the first batch
    fully masked (NaN in p, 0 in q with -inf).  A mask without a row axis
    masks random keys instead (padding).  ``named``: the scores' dims named
    (as a small model's dynamic batch and sequence).  ``alternate``: padding
    keys of every other position over the last 32 (a tail with masked and
    kept keys in every block of eight)."""
    rng = np.random.default_rng(seed)
    scores = (rng.standard_normal(shape) * 2).astype(np.float32)
    s, d = (shape[-2] if len(shape) > 1 else 1), shape[-1]
    if len(mask_shape) >= 2 and mask_shape[-2] == s:  # causal
        causal = np.where(np.arange(d)[None, :] > np.arange(s)[:, None] + (d - s), lowest, 0.0)
        mask = np.broadcast_to(causal, mask_shape).astype(np.float32).copy()
    else:  # keys of padding
        mask = np.where(rng.random(mask_shape) < 0.3, lowest, 0.0).astype(np.float32)
        if alternate:
            mask[..., -32:] = np.where(np.arange(32) % 2 == 0, lowest, 0.0)
    if len(mask_shape) >= 3 and mask_shape[-2] > 1:
        mask[(0,) * (len(mask_shape) - 2) + (slice(-1, None),)] = lowest
    feeds = {"scores": scores, "mask": mask, "t": rng.standard_normal(shape).astype(np.float32)}
    nodes = [helper.make_node("Add", ["scores", "mask"], ["sum"]),
             helper.make_node("Softmax", ["sum"], ["p"], axis=-1)]
    out = "p"
    if guard:
        nodes += [_const("zero", 0.0), helper.make_node("IsNaN", ["p"], ["nan"]),
                  helper.make_node("Where", ["nan", "zero", "p"], ["q"])]
        out = "q"
    dims = None
    if named:  # (the mask's dims of 1 stay 1)
        dims = {k: [f"d{i}" for i in range(len(shape))] for k in ("scores", "t")}
        dims["mask"] = [1 if m == 1 else f"d{i + len(shape) - len(mask_shape)}" for i, m in enumerate(mask_shape)]
    model, outputs = _program(nodes, feeds, [out], ["scores"], {out: "t"}, dims)

    def reference(f):
        v = f["scores"].astype(np.float64) + f["mask"].astype(np.float64)
        t = f["t"].astype(np.float64)
        with np.errstate(invalid="ignore"):
            e = np.exp(v - v.max(-1, keepdims=True))
            p = e / e.sum(-1, keepdims=True)
        if guard:
            p = np.nan_to_num(p, nan=0.0)
        return {out: p, "grad_scores": p * (t - (t * p).sum(-1, keepdims=True))}
    return Chain(model, feeds, outputs, reference)


def rotation(shape=(2, 5, 3, 16), half: int = 8, table=(5, 1, 8), seed: int = 0, neg_sin: bool = False) -> Chain:
    """y = the attention rules' ``rotate`` (halves) of x [B, S, N, H] by cos and
    sin tables [S, 1, half] (``neg_sin``: by Neg(sin), the inverse rotation of
    the rules' dq and dk); channels past 2 half pass through."""
    from onnxtrain.autodiff.rules.contrib_rotary import rotate
    from onnxtrain.core.emitter import Emitter

    rng = np.random.default_rng(seed)
    ang = rng.uniform(-3, 3, table).astype(np.float32)
    feeds = {"x": (rng.standard_normal(shape) * 2).astype(np.float32), "cos": np.cos(ang), "sin": np.sin(ang)}
    e = Emitter(OPSET, NameGen(list(feeds)), {k: TensorProto.FLOAT for k in feeds})
    sin = e.Neg("sin") if neg_sin else "sin"
    out = rotate(e, "x", "cos", sin, False)
    # (the rotation is written inside the rules' backward: no gradient of it here)
    graph = helper.make_graph(
        [*e.nodes, helper.make_node("Identity", [out], ["y"])], "chain",
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape)) for k, v in feeds.items()],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8

    def reference(f):
        x, c, s = (f[k].astype(np.float64) for k in ("x", "cos", "sin"))
        s = -s if neg_sin else s
        x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
        return {"y": np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest], -1)}
    return Chain(model, feeds, ["y"], reference)


def low_rank(shape=(2, 5, 48), k: int = 16, seed: int = 0, named: bool = False, swap: bool = False) -> Chain:
    """y = base + MatMul(h, B), h [.., k], B [k, N] (LoRA's up-projection and
    its Add; ``swap``: Add(delta, base)), base, h and B trained; ``named``: the
    leading dims of base and h named (batch, seq), as an onnxruntime-genai
    model leaves them."""
    rng = np.random.default_rng(seed)
    lead, n = shape[:-1], shape[-1]
    feeds = {"base": rng.standard_normal(shape).astype(np.float32),
             "h": rng.standard_normal((*lead, k)).astype(np.float32),
             "B": (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32),
             "t": rng.standard_normal(shape).astype(np.float32)}
    nodes = [helper.make_node("MatMul", ["h", "B"], ["delta"]),
             helper.make_node("Add", ["delta", "base"] if swap else ["base", "delta"], ["y"])]
    dims = {"base": ["batch", "seq", n], "h": ["batch", "seq", k]} if named else None
    model, outputs = _program(nodes, feeds, ["y"], ["base", "h", "B"], {"y": "t"}, dims)

    def reference(f):
        base, h, b, t = (f[x].astype(np.float64) for x in ("base", "h", "B", "t"))
        return {"y": base + h @ b, "grad_base": t, "grad_h": t @ b.T,
                "grad_B": h.reshape(-1, h.shape[-1]).T @ t.reshape(-1, t.shape[-1])}
    return Chain(model, feeds, outputs, reference)


def low_rank_down(shape=(3, 100, 160), k: int = 16, seed: int = 0, named: bool = False) -> Chain:
    """h = MatMul(x, A), x [.., N], A [N, k] (LoRA's down-projection), x and A
    trained: A's gradient x^T dh has its few columns on the right.
    ``named``: x's leading dims named (batch, seq)."""
    rng = np.random.default_rng(seed)
    lead, n = shape[:-1], shape[-1]
    feeds = {"x": rng.standard_normal(shape).astype(np.float32),
             "A": (rng.standard_normal((n, k)) / np.sqrt(n)).astype(np.float32),
             "t": rng.standard_normal((*lead, k)).astype(np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "A"], ["h"])]
    dims = {"x": ["batch", "seq", n], "t": ["batch", "seq", k]} if named else None
    model, outputs = _program(nodes, feeds, ["h"], ["x", "A"], {"h": "t"}, dims)

    def reference(f):
        x, a, t = (f[v].astype(np.float64) for v in ("x", "A", "t"))
        return {"h": x @ a, "grad_x": t @ a.T,
                "grad_A": x.reshape(-1, x.shape[-1]).T @ t.reshape(-1, t.shape[-1])}
    return Chain(model, feeds, outputs, reference)


def attention(shape=(2, 3, 80, 16), mask: str = "causal", seed: int = 0, scale: float = 0.25,
              keys: int | None = None, split_scale: bool = True) -> Chain:
    """o = Where(IsNaN(p), 0, p) v, p = Softmax((q s) (k s)^T + mask), s =
    sqrt(scale), as the dynamo exporter writes scaled dot-product attention
    (k transposed; ``split_scale=False``: the scale a Mul after the product),
    q, k and v [B, H, S, D] trained (keys [B, H, keys, D]).  ``mask``:
    "causal" (0 and -inf, the last row of the first batch fully masked: a
    zero row), "padding" (random keys of each batch masked) or "none" (zeros)."""
    rng = np.random.default_rng(seed)
    b, h, s, d = shape
    n = keys or s
    feeds = {x: rng.standard_normal((b, h, s if x == "q" else n, d)).astype(np.float32) for x in ("q", "k", "v")}
    if mask == "causal":
        m = np.where(np.arange(n)[None, :] > np.arange(s)[:, None] + (n - s), -np.inf, 0.0)
        m = np.broadcast_to(m, (b, 1, s, n)).astype(np.float32).copy()
        m[0, 0, -1] = -np.inf
    elif mask == "padding":
        m = np.where(rng.random((b, 1, 1, n)) < 0.4, -np.inf, 0.0).astype(np.float32)
    else:
        m = np.zeros((b, 1, 1, n), np.float32)
    feeds["mask"] = m
    feeds["t"] = rng.standard_normal((b, h, s, d)).astype(np.float32)
    if split_scale:
        nodes = [_const("root", np.sqrt(scale)),
                 helper.make_node("Mul", ["q", "root"], ["qs"]),
                 helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
                 helper.make_node("Mul", ["kt", "root"], ["kts"]),
                 helper.make_node("MatMul", ["qs", "kts"], ["scores"])]
    else:
        nodes = [_const("scale", scale),
                 helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
                 helper.make_node("MatMul", ["q", "kt"], ["qk"]),
                 helper.make_node("Mul", ["qk", "scale"], ["scores"])]
    nodes += [_const("zero", 0.0),
             helper.make_node("Add", ["scores", "mask"], ["sum"]),
             helper.make_node("Softmax", ["sum"], ["p"], axis=-1),
             helper.make_node("IsNaN", ["p"], ["nan"]),
             helper.make_node("Where", ["nan", "zero", "p"], ["pg"]),
             helper.make_node("MatMul", ["pg", "v"], ["o"])]
    model, outputs = _program(nodes, feeds, ["o"], ["q", "k", "v"], {"o": "t"})

    def reference(f):
        q, k, v, t = (f[x].astype(np.float64) for x in ("q", "k", "v", "t"))
        sc = q @ np.swapaxes(k, -1, -2) * scale + f["mask"].astype(np.float64)
        with np.errstate(invalid="ignore"):
            e = np.exp(sc - sc.max(-1, keepdims=True))
            p = np.nan_to_num(e / e.sum(-1, keepdims=True), nan=0.0)
        dp = t @ np.swapaxes(v, -1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
        return {"o": p @ v, "grad_q": ds @ k, "grad_k": np.swapaxes(ds, -1, -2) @ q,
                "grad_v": np.swapaxes(p, -1, -2) @ t}
    return Chain(model, feeds, outputs, reference)


# ------------------------------------------------------------ cross-entropy
def cross_entropy(n: int = 12, c: int = 300, ignored: int = 3, seed: int = 0, scale: float = 3.0,
                  named: bool = False, offset: float = 0.0) -> Chain:
    """loss = SoftmaxCrossEntropyLoss(scores, labels), mean, ignore_index -100
    on ``ignored`` rows; ``named``: the rows of scores and labels declared as two
    different named dims (as reshaping logits and labels separately leaves them).
    ``offset`` is added to every score (scores far below 0: a row's maximum
    must come from the row, not from a starting value)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, c, n).astype(np.int64)
    labels[:ignored] = -100
    feeds = {"scores": (rng.standard_normal((n, c)) * scale + offset).astype(np.float32), "labels": labels}
    nodes = [helper.make_node("SoftmaxCrossEntropyLoss", ["scores", "labels"], ["loss"], reduction="mean",
                              ignore_index=-100)]
    graph_nodes = nodes + [helper.make_node("Gradient", ["scores"], ["grad_scores"], domain=PREVIEW_DOMAIN,
                                            xs=["scores"], y="loss")]
    graph = helper.make_graph(
        graph_nodes, "chain",
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["rows" if named else n, c]),
         helper.make_tensor_value_info("labels", TensorProto.INT64, ["targets" if named else n])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("loss", "grad_scores")])
    imports = [helper.make_opsetid("", OPSET), helper.make_opsetid(PREVIEW_DOMAIN, 1)]
    expand_gradients(graph, imports, NameGen.from_graph(graph), list(feeds))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8

    def reference(f):
        s, t = f["scores"].astype(np.float64), f["labels"]
        kept = t != -100
        lse = np.log(np.exp(s - s.max(1, keepdims=True)).sum(1)) + s.max(1)
        safe = np.where(kept, t, 0)
        picked = s[np.arange(n), safe]
        loss = ((lse - picked) * kept).sum() / kept.sum()
        p = np.exp(s - lse[:, None])
        onehot = np.zeros_like(s)
        onehot[np.arange(n), safe] = 1
        grad = (p - onehot) * kept[:, None] / kept.sum()
        return {"loss": np.asarray(loss), "grad_scores": grad}
    return Chain(model, feeds, ["loss", "grad_scores"], reference)


# ------------------------------------------------------------ int4 weights
def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """[rows, count] codes < 2^bits -> uint8 [rows, ceil(count bits / 8)], low bits first."""
    per = 8 // bits
    rows, count = codes.shape
    padded = np.zeros((rows, -(-count // per) * per), dtype=np.int64)
    padded[:, :count] = codes
    grouped = padded.reshape(rows, -1, per)
    return sum(grouped[:, :, i] << (i * bits) for i in range(per)).astype(np.uint8)


def nbits(k: int = 40, n: int = 24, block: int = 16, bits: int = 4, zp: str = "none", m: int = 6,
          opset: int = OPSET, seed: int = 0, train_scales: bool = False) -> Chain:
    """Y = MatMulNBits(A, B, scales[, zero points]) (com.microsoft), its dA (and
    with ``train_scales`` its dscales, the scales a feed); ``zp``: "none"
    (2^(bits-1)), "packed" (uint8, as B) or "float"."""
    rng = np.random.default_rng(seed)
    blocks = -(-k // block)
    codes = rng.integers(0, 2 ** bits, size=(n, blocks * block))
    b = pack_codes(codes, bits).reshape(n, blocks, block * bits // 8)
    scales = rng.uniform(0.05, 0.2, size=(n, blocks)).astype(np.float32)
    if zp == "packed":
        zcodes = rng.integers(0, 2 ** bits, size=(n, blocks))
        zvalue, zinit = zcodes.astype(np.float32), pack_codes(zcodes, bits).reshape(-1)
    elif zp == "float":
        zvalue = zinit = rng.uniform(0, 2 ** bits - 1, size=(n, blocks)).astype(np.float32)
    else:
        zvalue, zinit = np.full((n, blocks), 2.0 ** (bits - 1), np.float32), None
    feeds = {"A": rng.standard_normal((m, k)).astype(np.float32), "t": rng.standard_normal((m, n)).astype(np.float32)}
    inits = [numpy_helper.from_array(b, "B")]
    if train_scales:
        feeds["scales"] = scales.reshape(-1)
    else:
        inits.append(numpy_helper.from_array(scales.reshape(-1), "scales"))
    xs = ["A", "scales"] if train_scales else ["A"]
    inputs = ["A", "B", "scales"]
    if zinit is not None:
        inits.append(numpy_helper.from_array(zinit, "zp"))
        inputs.append("zp")
    nodes = [helper.make_node("MatMulNBits", inputs, ["Y"], domain="com.microsoft", K=k, N=n, bits=bits,
                              block_size=block),
             helper.make_node("Mul", ["Y", "t"], ["Yt"]),
             helper.make_node("ReduceSum", ["Yt"], ["loss"], keepdims=0),
             helper.make_node("Gradient", xs, [f"grad_{x}" for x in xs], domain=PREVIEW_DOMAIN, xs=xs, y="loss")]
    outputs = ["Y"] + [f"grad_{x}" for x in xs]
    graph = helper.make_graph(
        nodes, "nbits", [helper.make_tensor_value_info(x, TensorProto.FLOAT, list(feeds[x].shape)) for x in feeds],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], inits)
    imports = [helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1),
               helper.make_opsetid(PREVIEW_DOMAIN, 1)]
    expand_gradients(graph, imports, NameGen.from_graph(graph), list(feeds) + [t.name for t in inits])
    model = helper.make_model(graph, opset_imports=imports[:2])
    model.ir_version = 8
    w64 = ((codes.reshape(n, blocks, block) - zvalue[:, :, None].astype(np.float64))
           * scales[:, :, None].astype(np.float64)).reshape(n, -1)[:, :k]

    def reference(f):
        a, t = f["A"].astype(np.float64), f["t"].astype(np.float64)
        return {"Y": a @ w64.T, "grad_A": t @ w64}
    chain = Chain(model, feeds, outputs, reference)
    chain.weight = w64  # (the float64 dequantized weight, for the kernel's own test)
    return chain
