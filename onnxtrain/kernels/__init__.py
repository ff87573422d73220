"""Fused kernels and the graph rewrites that use them.

``library``: the custom-op library built from ``optim_kernels.c`` (optimizer
updates, layer kernels, the NCHWc filter reorder); ``fuse``: the optimizer
rewrites and ``with_fused_kernels``; ``layers``, ``conv``, ``norm``: the
layer rewrites; ``nchwc``: convolutions on onnxruntime's NCHWc kernels.
See docs/fused-kernels.md.
"""
