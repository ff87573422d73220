"""The update rules (onnxtrain.optim.rules, optim.updates): each written once.

- A rule added in one place (here: this test module) trains through the
  builder and is fused by name, with no line of the builder, the lowering or
  the kernel rewrite changed.
- Every rule's standard ops compute exactly its documented association, bit
  for bit against a numpy transcription in the parameter's own type (numpy
  rounds each float32/float64 operation as IEEE does, like onnxruntime's CPU
  kernels): a body rewritten with another association fails here.
- Registration and application refuse bad input with clear messages.
"""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper
from test_build import blobs, clip_grads, initial_params, mlp, mlp_loss_and_grads

from onnxtrain import TrainingSession, build
from onnxtrain.core.emitter import Emitter, elem_type
from onnxtrain.core.names import NameGen
from onnxtrain.kernels.fuse import KERNEL_DOMAIN, fuse_rule_calls
from onnxtrain.optim import RULES, FusedKernel, UpdateRule, apply, find_calls, rules

needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)


# ------------------------------------------------------- a rule added in one place
def ema_momentum(e, o):
    """v' = m v + (1 - m) g;  x' = x - r v'  (the velocity as a moving average)."""
    v_new = e.Add(e.Mul(o["alpha"], o["v"]), e.Mul(o["beta"], o["g"]))
    return {"x_new": e.Sub(o["x"], e.Mul(o["r"], v_new)), "v_new": v_new}


#: Its arithmetic is what the library's Momentum kernel computes, so the rule
#: names that kernel: registering it is all the fusion needs.
EMA_MOMENTUM = UpdateRule(
    "EmaMomentum", scalars=("alpha", "beta", "r"), tensors=("x", "g", "v"), outputs=("x_new", "v_new"),
    body=ema_momentum,
    kernel=FusedKernel("Momentum", ("alpha", "beta", "r", "nc"), multi_tensor=True, decay="nc"),
)


class EmaMomentumSGD(build.Optimizer):
    """A builder optimizer over the rule: v = m v + (1 - m) g;  p -= lr v."""

    def __init__(self, lr: float, momentum: float) -> None:
        self.lr, self.momentum = lr, momentum

    def slots(self):
        return (("ema_velocity", 0.0),)

    def update(self, e, lr, step, params, grads, state):
        outs, scalars = [], {}  # the scalars once per element type: the kernel then batches tensors
        for p, g, v in zip(params, grads, state["ema_velocity"]):
            et = e.dtype(p)
            if et not in scalars:
                scalars[et] = {"alpha": e.const(self.momentum, dtype=et),
                               "beta": e.const(1 - self.momentum, dtype=et), "r": e.cast_to(lr, et)}
            outs.append(apply(e, "EmaMomentum", {**scalars[et], "x": p, "g": g, "v": v}))
        return [o["x_new"] for o in outs], {"ema_velocity": [o["v_new"] for o in outs]}


def ema_oracle(params, lr, m, x, labels, steps, clip):
    p = {k: v.copy() for k, v in params.items()}
    vel = {k: np.zeros_like(v) for k, v in p.items()}
    out = []
    for _ in range(steps):
        _, grads = mlp_loss_and_grads(p, x.astype(np.float64), labels)
        for k, g in clip_grads(grads, clip).items():
            vel[k] = m * vel[k] + (1 - m) * g
            p[k] = p[k] - lr * vel[k]
        out.append({k: v.copy() for k, v in p.items()})
    return out


@needs_compiler
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_rule_added_in_one_place_trains_and_fuses(dtype):
    """Registered here, used by a builder optimizer defined here: the session
    trains with it (as a numpy transcription says), the kernel rewrite finds
    its calls by name and runs them as the library's Momentum kernel, and the
    fused run is the standard run bit for bit.  (The gradients are clipped:
    the Gemm fusion, which runs first, would otherwise fold ``beta g`` of the
    weights into their gradients' Gemm, and only the biases would be left.)"""
    model = mlp(sizes=(4, 8, 3), dtype=dtype)
    x, labels = blobs(dtype=dtype)
    with rules.registered(EMA_MOMENTUM):
        tm = build.training_model(model, loss="cross_entropy", optimizer=EmaMomentumSGD(0.2, 0.75),
                                  clip_grad_norm=0.5)
        runs = {}
        for fused in (True, False):
            sess = TrainingSession(tm, fused_kernels=fused)
            losses = [float(sess.train_step({"X": x, "target": labels})["loss"]) for _ in range(10)]
            runs[fused] = sess, losses
    fused, fused_losses = runs[True]
    plain, plain_losses = runs[False]
    executed = fused.programs(executed=True)["training_info[0].algorithm"]
    kernels = [n for n in executed.graph.node if n.domain == KERNEL_DOMAIN]
    suffix = "F32" if dtype == np.float32 else "F64"
    assert [(n.op_type, len(n.output) // 2) for n in kernels] == [(f"Momentum{suffix}", 4)]  # one batch of 4
    assert fused_losses == plain_losses
    for name, value in plain.state.items():
        np.testing.assert_array_equal(fused.state[name], value, err_msg=name)
    expected = ema_oracle(initial_params(model), 0.2, 0.75, x, labels, 10, clip=0.5)[-1]
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == np.float32 else dict(rtol=1e-11, atol=1e-13)
    for name, value in expected.items():
        np.testing.assert_allclose(fused.state[name], value, err_msg=name, **tol)
    assert fused_losses[-1] < fused_losses[0]
    assert "EmaMomentum" not in RULES  # registered for the block only


# ------------------------------------------------- each rule's association, exactly
def _run_call(rule: str, operands: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One call of ``rule`` over graph inputs holding ``operands``, run by onnxruntime."""
    names = list(operands)
    e = Emitter(17, NameGen(names), {k: elem_type(v.dtype) for k, v in operands.items()})
    out = apply(e, rule, {k: k for k in names})
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(e.nodes, rule, [vi(k, elem_type(v.dtype), v.shape) for k, v in operands.items()],
                              [vi(v, e.dtype(v), None) for v in out.values()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip(out, sess.run(list(out.values()), operands)))


def _numpy(rule: str, o: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The documented association of each rule (optim/updates.py), in numpy."""
    if rule == "SGD":
        return {"p_new": o["p"] - o["lr"] * o["g"]}
    if rule == "WeightDecay":
        return {"g_new": o["nc"] * o["x"] + o["g"]}
    if rule == "Adam":
        m = o["b1"] * o["m"] + o["c1"] * o["g"]
        v = o["b2"] * o["v"] + o["c2"] * (o["g"] * o["g"])
        p = o["p"] * o["decay"] if "decay" in o else o["p"]
        return {"p_new": p - o["step"] * (m / (np.sqrt(v) + o["eps"])), "m_new": m, "v_new": v}
    if rule == "DecayAfter":
        return {"p_new": o["p"] - o["s"] * o["p"]}
    if rule == "SpecAdam":
        v = o["alpha"] * o["v"] + o["oma"] * o["g"]
        h = o["beta"] * o["h"] + (o["omb"] * o["g"]) * o["g"]
        x = o["x"] - (o["r"] * v) / (np.sqrt(h) + o["eps"])
        return {"x_new": o["post"] * x if "post" in o else x, "v_new": v, "h_new": h}
    if rule in ("Momentum", "Nesterov"):
        v = o["alpha"] * o["v"] + o["beta"] * o["g"]
        step = v if rule == "Momentum" else o["g"] + o["alpha2"] * v
        return {"x_new": o["x"] - o["r"] * step, "v_new": v}
    if rule == "Adagrad":
        h = o["h"] + o["g"] * o["g"]
        return {"x_new": o["x"] - (o["r"] * o["g"]) / (np.sqrt(h) + o["eps"]), "h_new": h}
    if rule == "TorchAdagrad":
        h = o["h"] + o["g"] * o["g"]
        return {"p_new": o["p"] - o["clr"] * (o["g"] / (np.sqrt(h) + o["eps"])), "h_new": h}
    raise AssertionError(f"no transcription of {rule}")


ELEMENTWISE = ["SGD", "WeightDecay", "Adam", "DecayAfter", "SpecAdam", "Momentum", "Nesterov", "Adagrad",
               "TorchAdagrad"]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rule", ELEMENTWISE)
def test_each_rule_computes_its_association_bit_for_bit(rule, dtype):
    r = RULES[rule]
    rng = np.random.default_rng(7)
    for optional in (False, True):
        if optional and not r.optional:
            continue
        operands = {}
        for name in r.operands:
            if name in r.optional and not optional:
                continue
            shape = () if name in r.scalars else (5, 7)
            value = rng.uniform(0.05, 1.5, shape) if name in r.scalars else rng.standard_normal(shape)
            operands[name] = np.asarray(np.abs(value) if name in ("v", "h") else value, dtype=dtype)
        got, want = _run_call(rule, operands), _numpy(rule, operands)
        assert sorted(got) == sorted(r.outputs)
        for name in r.outputs:
            assert got[name].dtype == dtype
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{rule} {name}")


def test_every_registered_rule_has_a_transcription_or_its_own_test():
    assert set(RULES) == set(ELEMENTWISE) | {"AdamStepSize"}  # (test_fused_kernels: the step size)


# ------------------------------------------------------------------ refusals
def test_registration_refuses_duplicates_and_unknown_operands():
    with pytest.raises(ValueError, match="registered twice"):
        rules.register(UpdateRule("SGD", ("lr",), ("p", "g"), ("p_new",), lambda e, o: {}))
    with pytest.raises(ValueError, match=r"\['eta'\] are not among its operands"):
        rules.register(UpdateRule("Bad", ("lr",), ("p", "g"), ("p_new",), lambda e, o: {}, optional=("eta",)))
    with pytest.raises(ValueError, match="without '/'"):
        rules.register(UpdateRule("a/b", ("lr",), ("p", "g"), ("p_new",), lambda e, o: {}))
    assert "Bad" not in RULES


def test_apply_names_what_is_wrong():
    e = Emitter(17, NameGen(["lr", "p", "g"]), dict.fromkeys(["lr", "p", "g"], onnx.TensorProto.FLOAT))
    with pytest.raises(ValueError, match=r"unknown \['eta'\], missing \['g'\]"):
        apply(e, "SGD", {"lr": "lr", "p": "p", "eta": "g"})
    with pytest.raises(ValueError, match="no update rule named 'Sgd'"):
        apply(e, "Sgd", {"lr": "lr", "p": "p", "g": "g"})


def test_a_rule_whose_body_emits_a_constant_is_never_fused():
    """Numbers are operands (the kernel reads them): a body with a Constant
    cannot be checked against a kernel, so its calls keep their standard ops."""
    def halve(e, o):
        return {"p_new": e.Sub(o["p"], e.Mul(e.const(0.5, like=o["p"]), o["g"]))}

    rule = UpdateRule("Halve", ("lr",), ("p", "g"), ("p_new",), halve,
                      kernel=FusedKernel("Momentum", ("lr", "lr", "lr", "nc"), multi_tensor=True, decay="nc"))
    with rules.registered(rule):
        e = Emitter(17, NameGen(["lr", "p", "g"]), dict.fromkeys(["lr", "p", "g"], onnx.TensorProto.FLOAT))
        apply(e, rule, {"lr": "lr", "p": "p", "g": "g"})
        assert find_calls(e.nodes) == []
        vi = helper.make_tensor_value_info
        graph = helper.make_graph(e.nodes, "g", [vi(n, onnx.TensorProto.FLOAT, [3]) for n in ("p", "g")]
                                  + [vi("lr", onnx.TensorProto.FLOAT, [])],
                                  [vi(e.nodes[-1].output[0], onnx.TensorProto.FLOAT, [3])])
        assert fuse_rule_calls(graph, [helper.make_opsetid("", 17)]) == 0


def test_calls_keep_their_names_through_a_saved_model(tmp_path):
    """The names are ordinary node names: a builder model written and read
    back is fused as before (nothing but the names marks a call)."""
    tm = build.training_model(mlp(), optimizer=build.AdamW(0.01))
    path = tmp_path / "m.onnx"
    onnx.save(tm, path)
    loaded = onnx.load(path)
    calls = find_calls(list(loaded.training_info[0].algorithm.node))
    assert [c.rule.name for c in calls] == ["Adam"] * 4
    assert {c.operands["p"] for c in calls} == {"W1", "b1", "W2", "b2"}


def test_standard_programs_hold_only_default_domain_ops():
    """Calls are plain nodes (their names mark them): the programs that
    ``sess.programs()`` hands out, which the portable bundle stores, import
    and use nothing but the default domain; only the executed program has
    the kernels."""
    tm = build.training_model(mlp(), optimizer=build.SGD(0.1, momentum=0.9, weight_decay=0.01))
    sess = TrainingSession(tm, fused_kernels=None)
    sess.train_step({"X": blobs()[0], "target": blobs()[1]})
    for label, program in sess.programs().items():
        assert {n.domain for n in program.graph.node} <= {""}, label
        assert {o.domain for o in program.opset_import} <= {"", "ai.onnx"}, label
        assert not program.functions, label
    algorithm = sess.programs()["training_info[0].algorithm"]
    assert {c.rule.name for c in find_calls(list(algorithm.graph.node))} == {"Momentum", "WeightDecay"}
