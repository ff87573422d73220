"""What is left of the session's former mixins: the ONNX export of a model
with given state (``export``), until it joins the exporters' room."""
