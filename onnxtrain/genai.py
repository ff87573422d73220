"""Serve a LoRA/QLoRA-trained onnxruntime-genai model with onnxruntime-genai
(public; defined in ``onnxtrain.export.genai``, which the module docs describe).

>>> from onnxtrain import genai
>>> genai.export(sess, "out", base="genai-model", adapters="merged")   # doctest: +SKIP
"""

from .export.genai import MODES, decoder_file, export, slot_prefix

__all__ = ["MODES", "decoder_file", "export", "slot_prefix"]
