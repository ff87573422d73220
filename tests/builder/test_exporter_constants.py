"""Exporter constants on hand-made graphs: the cases real exports do not cover
(onnxruntime-genai's cos_cache/sin_cache, interleaved sinusoidal tables, a
mask fed to Attention, a bias beside a mask that must still train)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import build
from onnxtrain.summary import parameter_text

F32 = TensorProto.FLOAT


def model(nodes, inits, inputs, outputs, opsets=(("", 23),)):
    g = helper.make_graph(nodes, "g", inputs, outputs,
                          [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    m.ir_version = 10
    return m


def reasons(m):
    return {c.name: (c.trainable, c.reason) for c in build.parameter_choices(m)}


def test_genai_cos_sin_caches_are_positional_whatever_their_values():
    """GroupQueryAttention inputs 7 and 8 (and RotaryEmbedding's caches) are
    positional tables by their slot, even when stored as random values."""
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", F32, [1, 4, 16])
    y = helper.make_tensor_value_info("y", F32, [1, 4, 16])
    gqa = helper.make_node("GroupQueryAttention", ["q", "", "", "", "", "seqlens", "total", "cos_cache",
                                                   "sin_cache"], ["y"], domain="com.microsoft",
                           num_heads=2, kv_num_heads=2, do_rotary=1)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["q"]), gqa]
    m = model(nodes, {"W": rng.standard_normal((16, 16)), "cos_cache": rng.standard_normal((8, 4)),
                      "sin_cache": rng.standard_normal((8, 4))}, [x], [y],
              (("", 17), ("com.microsoft", 1)))
    assert reasons(m) == {"W": (True, "weight"), "cos_cache": (False, "positional"),
                          "sin_cache": (False, "positional")}


def test_tables_found_by_value_and_masks_by_use():
    t = np.arange(6)[:, None] * np.array([1.0, 0.1, 0.01, 0.001])[None]
    interleaved = np.stack([np.sin(t), np.cos(t)], -1).reshape(6, 8)  # Vaswani's layout
    x = helper.make_tensor_value_info("x", F32, [6, 8])
    q = helper.make_tensor_value_info("q", F32, [1, 2, 6, 8])
    out = [helper.make_tensor_value_info(n, F32, None) for n in ("h", "att")]
    nodes = [
        helper.make_node("Add", ["x", "table"], ["h0"]),
        helper.make_node("MatMul", ["h0", "W"], ["h1"]),
        helper.make_node("Add", ["h1", "bias"], ["h2"]),  # a bias feeding Softmax: a weight
        helper.make_node("Softmax", ["h2"], ["h"]),
        helper.make_node("Attention", ["q", "q", "q", "zeros"], ["att"]),  # all-zero mask: constant
    ]
    rng = np.random.default_rng(1)
    m = model(nodes, {"table": interleaved, "W": rng.standard_normal((8, 8)), "bias": rng.standard_normal(8),
                      "zeros": np.zeros((6, 6))}, [x, q], out)
    assert reasons(m) == {"table": (False, "positional"), "W": (True, "weight"),
                          "bias": (True, "weight"), "zeros": (False, "mask")}


def test_inspect_shows_the_name_a_weight_is_known_by():
    rng = np.random.default_rng(2)
    mm = helper.make_node("MatMul", ["x", "val_7"], ["y"], name="/model/layers.0/self_attn/q_proj/MatMul")
    m = model([mm], {"val_7": rng.standard_normal((4, 4))}, [helper.make_tensor_value_info("x", F32, [2, 4])],
              [helper.make_tensor_value_info("y", F32, [2, 4])])
    text = parameter_text(m)
    assert "known as" in text and "model.layers.0.self_attn.q_proj.weight" in text
    c = build.parameter_choices(m)[0]
    assert c.known_as == "model.layers.0.self_attn.q_proj.weight" and c.lora == "target"
    tm = build.training_model(m, loss="mse", trainable=["self_attn.q_proj"])
    assert any(p.key == "onnxtrain.trainable" and "val_7" in p.value for p in tm.metadata_props)


def test_rope_angles_read_by_cos_and_sin_are_positional():
    """torch's dynamo export of a Llama at a long traced length folds the angles
    (positions x inverse frequencies) into one initializer that Cos and Sin read;
    it is a positional table whatever its values (stored externally, unread),
    and full fine-tuning leaves it alone.  A tensor that only Cos reads, or that
    a product reads too, stays a weight."""
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", F32, [1, 4, 8])
    y = helper.make_tensor_value_info("y", F32, None)
    nodes = [
        helper.make_node("Reshape", ["angles", "shape"], ["a"]),
        helper.make_node("Cos", ["a"], ["cos"]), helper.make_node("Sin", ["angles"], ["sin"]),
        helper.make_node("Mul", ["x", "cos"], ["xc"]), helper.make_node("Mul", ["x", "sin"], ["xs"]),
        helper.make_node("Cos", ["phase"], ["pc"]),
        helper.make_node("Add", ["xc", "xs"], ["h"]), helper.make_node("Add", ["h", "pc"], ["h2"]),
        helper.make_node("MatMul", ["h2", "W"], ["y"]),
    ]
    m = model(nodes, {"angles": rng.standard_normal((1, 4, 8)), "phase": rng.standard_normal((1, 4, 8)),
                      "W": rng.standard_normal((8, 8))}, [x], [y])
    m.graph.initializer.append(numpy_helper.from_array(np.array([1, 4, 8], np.int64), "shape"))
    assert reasons(m) == {"angles": (False, "positional"), "phase": (True, "weight"), "W": (True, "weight")}


def _added(table):
    """A graph that adds ``table`` to its input, then multiplies by W."""
    x = helper.make_tensor_value_info("x", F32, list(table.shape))
    y = helper.make_tensor_value_info("y", F32, None)
    nodes = [helper.make_node("Add", ["x", "table"], ["h"]), helper.make_node("MatMul", ["h", "W"], ["y"])]
    w = np.random.default_rng(3).standard_normal((table.shape[-1], 4))
    return model(nodes, {"table": table, "W": w}, [x], [y])


def test_value_tests_look_past_their_first_elements():
    """The value tests try a table's first elements alone before all of it:
    a table whose first rows are a sinusoidal table or a broadcast copy and
    whose last row is not is a weight; the whole tables are constants."""
    t = np.arange(40)[:, None] * np.array([1.0, 0.1, 0.01, 0.001])[None]
    table = np.concatenate([np.cos(t), np.sin(t)], -1)  # [40, 8], halves
    assert reasons(_added(table))["table"] == (False, "positional")
    off = table.copy()
    off[-1, 0] = 0.5
    assert reasons(_added(off))["table"] == (True, "weight")
    copy = np.tile(np.linspace(-1.0, 1.0, 8), (5, 1))  # the same row over a batch of 5
    assert reasons(_added(copy))["table"] == (False, "broadcast")
    copy[-1, 3] += 1.0
    assert reasons(_added(copy))["table"] == (True, "weight")
