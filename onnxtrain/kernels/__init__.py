"""Fused kernels and the graph rewrites that use them.

``library``: the custom-op library built from ``optim_kernels.c`` (optimizer
updates, layer kernels, the NCHWc filter reorder) and ``llm_kernels.c`` (a
decoder's chains); ``fuse``: the optimizer rewrites and ``with_fused_kernels``;
``layers``, ``conv``, ``norm``: the layer rewrites; ``nchwc``: convolutions on
onnxruntime's NCHWc kernels; ``llm``, ``attention``, ``xent``, ``nbits``: a
decoder's RMSNorm, SiLU gate, RoPE, guarded softmax, cross-entropy and int4
weights, matched with ``graphmatch``.  See docs/fused-kernels.md.
"""
