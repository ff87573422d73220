"""Write the bundles and Python's results that js/test compares against.

    python js/test/make_fixtures.py OUT_FOLDER

For each case: ``CASE/bundle`` (``onnxtrain.bundle.save`` of the starting
session), the batches as raw little-endian files, the steps (which
algorithm, which batch), Python's returned outputs after each step, and
``CASE/after`` (``bundle.save`` after the steps: its ``state.bin`` is the
expected state), plus an inference batch and Python's ``run`` outputs.
``OUT_FOLDER/cases.json`` lists them.  Models are small and built here or in
``tests/models.py`` (hand-written TrainingInfoProtos), so the whole set takes
seconds; nothing large is committed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from inference_models import cnn as digits_cnn  # noqa: E402
from inference_models import mlp as digits_mlp  # noqa: E402

import onnxtrain  # noqa: E402
from onnxtrain import build, bundle  # noqa: E402
from onnxtrain.datasets import load_digits  # noqa: E402
from tests import models as hand  # noqa: E402

OPSET = 17
F32 = TensorProto.FLOAT


class Case:
    """One case: a session, its batches and the steps to replay."""

    def __init__(self, out: Path, name: str, source, exact: bool = True, initialize: bool = False):
        self.name = name
        self.folder = out / name
        self.folder.mkdir(parents=True)
        self.sess = source if isinstance(source, onnxtrain.TrainingSession) else onnxtrain.TrainingSession(source)
        self.initialize = initialize
        self.exact = exact
        self.arrays: dict[str, dict] = {}
        self.steps: list[dict] = []
        self.record: dict = {"name": name, "exact": exact, "initialize": initialize}

    def array(self, key: str, value: np.ndarray) -> dict:
        value = np.asarray(value)  # (np.ascontiguousarray would make a scalar 1-d)
        path = self.folder / f"{key}.bin"
        path.write_bytes(value.tobytes())
        return {"file": str(path.relative_to(self.folder.parent)), "dtype": value.dtype.name,
                "shape": list(value.shape)}

    def feeds(self, key: str, batch: dict[str, np.ndarray]) -> dict:
        return {name: self.array(f"{key}.{name}", value) for name, value in batch.items()}

    def start(self) -> None:
        bundle.save(self.sess, self.folder / "bundle")
        if self.initialize:
            self.sess.initialize()

    def step(self, batch: dict[str, np.ndarray], algorithm: int | None = None,
             learning_rate: float | None = None) -> None:
        if learning_rate is not None:
            self.sess.learning_rate = learning_rate
        out = self.sess.train_step(batch, algorithm=algorithm)
        entry = {"feeds": self.feeds(f"step{len(self.steps)}", batch), "algorithm": algorithm,
                 "outputs": {k: self.array(f"step{len(self.steps)}.out.{k}", v) for k, v in out.items()}}
        if learning_rate is not None:
            entry["learning_rate"] = learning_rate
        self.steps.append(entry)

    def finish(self, run_batch: dict[str, np.ndarray]) -> dict:
        bundle.save(self.sess, self.folder / "after")
        outputs = self.sess.run(run_batch)
        self.record.update(
            bundle=f"{self.name}/bundle", after=f"{self.name}/after", steps=self.steps,
            run={"feeds": self.feeds("run", run_batch),
                 "outputs": {k: self.array(f"run.out.{k}", v) for k, v in outputs.items()}},
        )
        return self.record


# ------------------------------------------------------------------ models
def init(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def transformer_block(seed: int = 0, d: int = 16, heads: int = 2, ffn: int = 32) -> onnx.ModelProto:
    """x[N, S, d] -> multi-head self-attention -> residual + LayerNorm -> ReLU FFN
    -> residual + LayerNorm -> y (a small W4 of benchmarks/workloads.py)."""
    rng = np.random.default_rng(seed)
    dh = d // heads
    p = {n: (rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32)
         for n, s in [("Wq", (d, d)), ("Wk", (d, d)), ("Wv", (d, d)), ("Wo", (d, d)),
                      ("W1", (d, ffn)), ("W2", (ffn, d))]}
    p.update({"b1": np.zeros(ffn, np.float32), "b2": np.zeros(d, np.float32),
              "g1": np.ones(d, np.float32), "be1": np.zeros(d, np.float32),
              "g2": np.ones(d, np.float32), "be2": np.zeros(d, np.float32)})
    consts = [init("split_shape", np.array([0, 0, heads, dh], np.int64)),
              init("merge_shape", np.array([0, 0, d], np.int64)),
              init("scale", np.array(1.0 / np.sqrt(dh), np.float32))]
    n = helper.make_node
    nodes = []
    for w in ("q", "k", "v"):
        nodes += [n("MatMul", ["x", f"W{w}"], [f"{w}_flat"]),
                  n("Reshape", [f"{w}_flat", "split_shape"], [f"{w}_split"]),
                  n("Transpose", [f"{w}_split"], [f"{w}_heads"], perm=[0, 2, 1, 3])]
    nodes += [
        n("Transpose", ["k_heads"], ["k_t"], perm=[0, 1, 3, 2]),
        n("MatMul", ["q_heads", "k_t"], ["scores_raw"]),
        n("Mul", ["scores_raw", "scale"], ["scores"]),
        n("Softmax", ["scores"], ["attn"], axis=-1),
        n("MatMul", ["attn", "v_heads"], ["ctx_heads"]),
        n("Transpose", ["ctx_heads"], ["ctx_split"], perm=[0, 2, 1, 3]),
        n("Reshape", ["ctx_split", "merge_shape"], ["ctx"]),
        n("MatMul", ["ctx", "Wo"], ["attn_out"]),
        n("Add", ["x", "attn_out"], ["res1"]),
        n("LayerNormalization", ["res1", "g1", "be1"], ["h"], axis=-1, epsilon=1e-5),
        n("MatMul", ["h", "W1"], ["f1"]), n("Add", ["f1", "b1"], ["f1b"]), n("Relu", ["f1b"], ["f1r"]),
        n("MatMul", ["f1r", "W2"], ["f2"]), n("Add", ["f2", "b2"], ["f2b"]),
        n("Add", ["h", "f2b"], ["res2"]),
        n("LayerNormalization", ["res2", "g2", "be2"], ["y"], axis=-1, epsilon=1e-5),
    ]
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", F32, ["N", "S", d])],
                              [helper.make_tensor_value_info("y", F32, ["N", "S", d])],
                              [init(k, v) for k, v in p.items()] + consts)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def lstm_classifier(seed: int = 0, inputs: int = 6, hidden: int = 8, classes: int = 4) -> onnx.ModelProto:
    """x[S, N, inputs] -> LSTM -> last hidden state -> Gemm -> logits (a small W7-LSTM)."""
    rng = np.random.default_rng(seed)
    bound = 1 / np.sqrt(hidden)
    p = {"W": rng.uniform(-bound, bound, (1, 4 * hidden, inputs)).astype(np.float32),
         "R": rng.uniform(-bound, bound, (1, 4 * hidden, hidden)).astype(np.float32),
         "B": rng.uniform(-bound, bound, (1, 8 * hidden)).astype(np.float32),
         "fc.W": (rng.standard_normal((hidden, classes)) / np.sqrt(hidden)).astype(np.float32),
         "fc.b": np.zeros(classes, np.float32)}
    n = helper.make_node
    nodes = [n("LSTM", ["x", "W", "R", "B"], ["", "h_last"], hidden_size=hidden),
             n("Squeeze", ["h_last", "axis0"], ["h"]),
             n("Gemm", ["h", "fc.W", "fc.b"], ["logits"])]
    graph = helper.make_graph(nodes, "lstm", [helper.make_tensor_value_info("x", F32, ["S", "N", inputs])],
                              [helper.make_tensor_value_info("logits", F32, ["N", classes])],
                              [init(k, v) for k, v in p.items()] + [init("axis0", np.array([0], np.int64))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def cnn_batchnorm(seed: int = 0, channels: int = 4, classes: int = 10) -> onnx.ModelProto:
    """image[N, 1, 8, 8] -> Conv -> BatchNormalization -> Relu -> MaxPool -> Gemm -> logits."""
    rng = np.random.default_rng(seed)
    p = {"conv.W": (rng.standard_normal((channels, 1, 3, 3)) / 3).astype(np.float32),
         "conv.b": np.zeros(channels, np.float32),
         "bn.scale": np.ones(channels, np.float32), "bn.bias": np.zeros(channels, np.float32),
         "bn.mean": np.zeros(channels, np.float32), "bn.var": np.ones(channels, np.float32),
         "fc.W": (rng.standard_normal((channels * 16, classes)) / np.sqrt(channels * 16)).astype(np.float32),
         "fc.b": np.zeros(classes, np.float32)}
    n = helper.make_node
    nodes = [n("Conv", ["image", "conv.W", "conv.b"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             n("BatchNormalization", ["c", "bn.scale", "bn.bias", "bn.mean", "bn.var"], ["bn"], epsilon=1e-5),
             n("Relu", ["bn"], ["r"]),
             n("MaxPool", ["r"], ["pooled"], kernel_shape=[2, 2], strides=[2, 2]),
             n("Flatten", ["pooled"], ["features"], axis=1),
             n("Gemm", ["features", "fc.W", "fc.b"], ["logits"])]
    graph = helper.make_graph(nodes, "cnn_bn", [helper.make_tensor_value_info("image", F32, ["N", 1, 8, 8])],
                              [helper.make_tensor_value_info("logits", F32, ["N", classes])],
                              [init(k, v) for k, v in p.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


# ------------------------------------------------------------------ cases
def digits(n: int, offset: int = 0):
    X, y = load_digits()
    return X[offset:offset + n].astype(np.float32), y[offset:offset + n].astype(np.int64)


def case_linear(out: Path) -> dict:
    """Hand-written TrainingInfoProto: Gradient + Momentum, an initialization graph."""
    c = Case(out, "linear", hand.linear_regression("momentum", n_in=3, lr=0.05), initialize=True)
    c.start()
    rng = np.random.default_rng(1)
    for _ in range(5):
        X = rng.standard_normal((6, 3)).astype(np.float32)
        c.step({"X": X, "T": (X @ np.array([[1.0], [-2.0], [0.5]], np.float32) + 0.3).astype(np.float32)})
    return c.finish({"X": rng.standard_normal((4, 3)).astype(np.float32)})


def case_two_algorithms(out: Path) -> dict:
    """Hand-written: two TrainingInfoProtos (Adam on each layer), each with an initialization."""
    model = hand.mlp_classifier("adam", sizes=(64, 16, 10), lr=0.02, groups=[["W1", "b1"], ["W2", "b2"]])
    c = Case(out, "two_algorithms", model, initialize=True)
    c.start()
    X, y = digits(40)
    for i, algorithm in enumerate([None, 0, 1, None, 1]):
        rows = slice(8 * i, 8 * i + 8)
        c.step({"X": X[rows], "label": y[rows]}, algorithm)
    return c.finish({"X": X[:5]})


def case_mlp(out: Path) -> dict:
    """The builder: Adam (the learning rate is a state variable, set halfway)."""
    model = build.training_model(digits_mlp(n_in=64, hidden=32), loss="cross_entropy", target="label",
                                 optimizer=build.Adam(lr=0.01))
    c = Case(out, "mlp", model)
    c.start()
    X, y = digits(48)
    for i in range(6):
        rows = slice(8 * i, 8 * i + 8)
        c.step({"X": X[rows], "label": y[rows]}, learning_rate=0.003 if i == 3 else None)
    return c.finish({"X": X[:5]})


def case_cnn_batchnorm(out: Path) -> dict:
    """The builder on Conv + BatchNormalization (training mode, running statistics as state), SGD momentum."""
    model = build.training_model(cnn_batchnorm(), loss="cross_entropy", target="label",
                                 optimizer=build.SGD(lr=0.05, momentum=0.9))
    return image_case(out, "cnn_batchnorm", model, steps=5, offset=0)


def image_case(out: Path, name: str, model: onnx.ModelProto, steps: int, offset: int) -> dict:
    """Steps of 8 digit images [8, 1, 8, 8] with labels."""
    c = Case(out, name, model)
    c.start()
    X, y = digits(8 * steps, offset=offset)
    images = X.reshape(-1, 1, 8, 8)
    for i in range(steps):
        rows = slice(8 * i, 8 * i + 8)
        c.step({"image": images[rows], "label": y[rows]})
    return c.finish({"image": images[:4]})


def case_transformer(out: Path) -> dict:
    """The builder on a transformer encoder block (attention, LayerNorm), MSE, AdamW, a cosine schedule."""
    model = build.training_model(transformer_block(), loss="mse", target="target",
                                 optimizer=build.AdamW(lr=0.01, weight_decay=0.01), schedule=build.cosine(20))
    c = Case(out, "transformer", model)
    # The schedule computes cos() in float64 (the rate's dtype): onnxruntime has no float64
    # Cos kernel before 1.29, so an older one refuses the program when it loads.
    c.record["min_onnxruntime"] = {"version": "1.29.0", "refusal": "Cos"}
    c.start()
    rng = np.random.default_rng(2)
    for _ in range(4):
        x = rng.standard_normal((3, 5, 16)).astype(np.float32)
        c.step({"x": x, "target": np.tanh(x[:, ::-1]).astype(np.float32)})
    return c.finish({"x": rng.standard_normal((2, 5, 16)).astype(np.float32)})


def case_lstm(out: Path) -> dict:
    """The builder on an LSTM classifier, Adam."""
    model = build.training_model(lstm_classifier(), loss="cross_entropy", target="label",
                                 optimizer=build.Adam(lr=0.02))
    c = Case(out, "lstm", model)
    c.start()
    rng = np.random.default_rng(3)
    for _ in range(4):
        x = rng.standard_normal((7, 5, 6)).astype(np.float32)
        c.step({"x": x, "label": (x[:, :, 0].sum(axis=0) > 0).astype(np.int64) + 2 * (x[-1, :, 1] > 0)})
    return c.finish({"x": rng.standard_normal((7, 3, 6)).astype(np.float32)})


def case_fit(out: Path) -> dict:
    """A fit checkpoint: Python fits 1 epoch, saves; JS fits on to epoch 3 (no shuffle),
    as Python's bundle.load + fit does; gradient accumulation's cycle [0, 1]."""
    model = build.training_model(digits_mlp(n_in=64, hidden=16, seed=1), loss="cross_entropy",
                                 target="label", optimizer=build.Adam(lr=0.01), accumulate=2)
    folder = out / "fit"
    folder.mkdir()
    X, y = digits(100, offset=200)
    sess = onnxtrain.TrainingSession(model)
    sess.fit(X, y, epochs=1, batch_size=16, shuffle=False, progress=False)
    bundle.save(sess, folder / "bundle")
    resumed = bundle.load(folder / "bundle")
    history = resumed.fit(X, y, epochs=3, batch_size=16, shuffle=False, progress=False)
    bundle.save(resumed, folder / "after")
    (folder / "X.bin").write_bytes(X.tobytes())
    (folder / "y.bin").write_bytes(y.tobytes())
    return {"name": "fit", "exact": True, "bundle": "fit/bundle", "after": "fit/after",
            "fit": {"X": {"file": "fit/X.bin", "dtype": "float32", "shape": list(X.shape)},
                    "label": {"file": "fit/y.bin", "dtype": "int64", "shape": list(y.shape)},
                    "epochs": 3, "batchSize": 16, "loss": history.history["loss"],
                    "position": {k: resumed.fit_position[k] for k in ("epoch", "batch", "step")}}}


def case_digits_cnn(out: Path) -> dict:
    """The builder on the digits CNN (Conv, MaxPool), SGD; used by the browser test too."""
    model = build.training_model(digits_cnn(channels=4), loss="cross_entropy", target="label",
                                 optimizer=build.SGD(lr=0.05))
    return image_case(out, "digits_cnn", model, steps=4, offset=500)


def case_lora(out: Path) -> dict:
    """The builder with LoRA adapters: the frozen weights are constants (in constants.bin,
    read as external data), the adapters the state; Adam."""
    model = build.training_model(digits_mlp(n_in=64, hidden=32, seed=2), loss="cross_entropy",
                                 target="label", optimizer=build.Adam(lr=0.02),
                                 lora=build.LoRA(rank=2, alpha=4))
    c = Case(out, "lora", model)
    c.start()
    X, y = digits(32, offset=700)
    for i in range(4):
        rows = slice(8 * i, 8 * i + 8)
        c.step({"X": X[rows], "label": y[rows]})
    record = c.finish({"X": X[:5]})
    assert (c.folder / "bundle" / "constants.bin").exists(), "the frozen weights are constants"
    return record


def case_faulty(out: Path) -> dict:
    """Two hand-written algorithms without Gradient: [0] W += 1; [1] V += D, D a feed of any
    shape.  D of shape [2, 3] broadcasts V to [2, 3] (a bound value of the wrong shape,
    found after [0] ran); D of shape [2] fails in onnxruntime (shapes that do not broadcast)."""
    n = helper.make_node
    W = np.array([1.0, 2.0, 3.0], np.float32)
    infos = [
        hand.training_info([n("Add", ["W", "one"], ["W_plus"])], [init("one", np.float32(1))], [],
                           [helper.make_tensor_value_info("W_plus", F32, [3])], [("W", "W_plus")]),
        hand.training_info([n("Add", ["V", "D"], ["V_moved"])], [],
                           [helper.make_tensor_value_info("D", F32, None)],
                           [helper.make_tensor_value_info("V_moved", F32, None)], [("V", "V_moved")]),
    ]
    model = hand.model([n("Mul", ["X", "W"], ["XW"]), n("Add", ["XW", "V"], ["Y"])],
                       [helper.make_tensor_value_info("X", F32, ["N", 3])],
                       [helper.make_tensor_value_info("Y", F32, ["N", 3])], [init("W", W), init("V", -W)], infos)
    folder = out / "faulty"
    folder.mkdir()
    bundle.save(model, folder / "bundle")
    return {"name": "faulty", "bundle": "faulty/bundle"}


CASES = [case_linear, case_two_algorithms, case_mlp, case_cnn_batchnorm, case_transformer,
         case_lstm, case_fit, case_digits_cnn, case_lora, case_faulty]


def main(argv: list[str]) -> int:
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=False)
    only = set(argv[2:])
    cases = [make(out) for make in CASES if not only or make.__name__[5:] in only]
    (out / "cases.json").write_text(json.dumps({c["name"]: c for c in cases}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
