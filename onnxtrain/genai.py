"""Serve a LoRA/QLoRA-trained onnxruntime-genai model with onnxruntime-genai
(public; defined in ``onnxtrain.export.genai``, which the module docs describe).

A base folder holds ``genai_config.json`` and the decoder model it names;
here a one-MatMul decoder stands for a real one:

>>> import json, os, tempfile
>>> import numpy as np
>>> import onnx
>>> from onnx import TensorProto, helper, numpy_helper
>>> from onnxtrain import TrainingSession, build, genai
>>> tmp = tempfile.TemporaryDirectory()
>>> base = os.path.join(tmp.name, "base")
>>> os.mkdir(base)
>>> weight = numpy_helper.from_array(np.eye(4, dtype=np.float32), "model.layers.0.attn.qkv_proj.MatMul.weight")
>>> graph = helper.make_graph([helper.make_node("MatMul", ["x", weight.name], ["y"])], "decoder",
...                           [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
...                           [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], [weight])
>>> onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
...           os.path.join(base, "model.onnx"))
>>> with open(os.path.join(base, "genai_config.json"), "w") as f:
...     json.dump({"model": {"decoder": {"filename": "model.onnx"}}}, f)
>>> sess = TrainingSession(build.training_model(os.path.join(base, "model.onnx"), loss="mse",
...                                             lora=build.LoRA(rank=2)))
>>> folder = genai.export(sess, os.path.join(tmp.name, "out"), base=base, adapters="merged")
>>> sorted(os.listdir(folder))
['genai_config.json', 'model.onnx']
>>> tmp.cleanup()
"""

from .export.genai import MODES, decoder_file, export, slot_prefix

__all__ = ["MODES", "decoder_file", "export", "slot_prefix"]
