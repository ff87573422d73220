"""A decoder-only transformer language model as an ONNX file with external data.

``write_decoder_lm(path, config)`` writes ``path`` (the graph, a few hundred
KB) and ``path + ".data"`` (every weight), with ``onnx.helper`` and numpy
only.  The weights are random (seeded) and streamed to the data file one
chunk at a time: neither the whole model nor a ModelProto holding raw data is
ever in memory, so a model of several GB is written in about the time the disk
takes.  Tensors in the data file start at multiples of 4096 bytes (a page),
so a loader can memory-map them.

The model (pre-norm, GPT style, untied head)::

    input_ids [batch, seq] (int64)
    x = tok_emb[input_ids] + pos_emb[:seq]
    N times:  x = x + Wo·attn(LN1(x) Wq, LN1(x) Wk, LN1(x) Wv)    causal, H heads
              x = x + W2·gelu(LN2(x) W1)
    logits = LN_f(x) · lm_head                    [batch, seq, vocab]

Every projection is ``MatMul(activation, W)`` with ``W`` stored
``[in, out]`` and no bias, so each is a LoRA target of ``onnxtrain.build``;
the embeddings are read by Gather/Slice and stay frozen.  The causal mask is
an additive ``[max_seq, max_seq]`` constant (0 / -1e9) sliced to the
sequence length.

    python examples/decoder_lm.py --config small --out /tmp/lm   # writes and describes it
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: Offsets of tensors in the data file are multiples of this (a memory page).
ALIGN = 4096
#: Tensors smaller than this many bytes stay inside the .onnx file.
INLINE_BELOW = 1024
#: Random numbers are drawn (and written) this many values at a time.
CHUNK = 1 << 22
OPSET = 20  # Gelu


@dataclass(frozen=True)
class DecoderConfig:
    vocab: int = 2048
    d_model: int = 256
    layers: int = 4
    heads: int = 4
    ffn: int = 1024
    max_seq: int = 128
    seed: int = 0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.d_model % self.heads:
            raise ValueError(f"d_model {self.d_model} is not a multiple of heads {self.heads}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    def weight_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every parameter, in data-file order."""
        d, f = self.d_model, self.ffn
        out = [("tok_emb", (self.vocab, d)), ("pos_emb", (self.max_seq, d))]
        for i in range(self.layers):
            p = f"h{i}."
            out += [(p + "ln1.weight", (d,)), (p + "ln1.bias", (d,)),
                    (p + "attn.q", (d, d)), (p + "attn.k", (d, d)), (p + "attn.v", (d, d)),
                    (p + "attn.o", (d, d)),
                    (p + "ln2.weight", (d,)), (p + "ln2.bias", (d,)),
                    (p + "mlp.fc1", (d, f)), (p + "mlp.fc2", (f, d))]
        out += [("ln_f.weight", (d,)), ("ln_f.bias", (d,)), ("lm_head", (d, self.vocab))]
        return out

    @property
    def parameters(self) -> int:
        return sum(math.prod(s) for _, s in self.weight_shapes())


CONFIGS = {
    # a few M parameters: trains in seconds
    "small": DecoderConfig(vocab=2048, d_model=256, layers=4, heads=4, ffn=1024, max_seq=128),
    # ~1.14 B parameters, 4.6 GB of float32
    "1b": DecoderConfig(vocab=32000, d_model=2048, layers=20, heads=16, ffn=8192, max_seq=128),
}


# ------------------------------------------------------------------ weights
def _fill(name: str, shape: tuple[int, ...], cfg: DecoderConfig):
    """Yield the float32 values of ``name`` in C order, in chunks of at most CHUNK.

    LayerNorm weights are ones and biases zeros; matrices are normal(0, std),
    with GPT-2's 1/sqrt(2·layers) on the projections writing into the residual
    stream.  Each tensor has its own random stream (seed, crc of its name), so
    a tensor's values do not depend on the others."""
    n = math.prod(shape)
    if name.endswith(".weight"):
        const = 1.0
    elif name.endswith(".bias"):
        const = 0.0
    else:
        const = None
    if const is not None:
        yield np.full(n, const, np.float32)
        return
    std = cfg.init_std
    if name.endswith(("attn.o", "mlp.fc2")):
        std /= math.sqrt(2 * cfg.layers)
    rng = np.random.default_rng([cfg.seed, zlib.crc32(name.encode())])
    for start in range(0, n, CHUNK):
        chunk = rng.standard_normal(min(CHUNK, n - start), dtype=np.float32)
        chunk *= np.float32(std)
        yield chunk


def weight(cfg: DecoderConfig, name: str) -> np.ndarray:
    """One parameter's values as written (for tests and small models)."""
    shape = dict(cfg.weight_shapes())[name]
    return np.concatenate(list(_fill(name, shape, cfg))).reshape(shape)


def _external(name: str, shape, location: str, offset: int, length: int) -> TensorProto:
    t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(shape))
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = k, v
    return t


def write_weights(cfg: DecoderConfig, data_path: str | os.PathLike, location: str) -> list[TensorProto]:
    """Stream every parameter into ``data_path``; return the (data-less) TensorProtos."""
    inits = []
    with open(data_path, "wb") as f:
        for name, shape in cfg.weight_shapes():
            nbytes = 4 * math.prod(shape)
            if nbytes < INLINE_BELOW:
                inits.append(numpy_helper.from_array(
                    np.concatenate(list(_fill(name, shape, cfg))).reshape(shape), name))
                continue
            offset = f.tell()
            if offset % ALIGN:
                f.write(b"\0" * (ALIGN - offset % ALIGN))
                offset = f.tell()
            for chunk in _fill(name, shape, cfg):
                f.write(memoryview(chunk))
            inits.append(_external(name, shape, location, offset, nbytes))
    return inits


# ------------------------------------------------------------------ graph
def _graph_nodes(cfg: DecoderConfig) -> tuple[list[onnx.NodeProto], list[TensorProto]]:
    d, h, dh = cfg.d_model, cfg.heads, cfg.head_dim
    nodes: list[onnx.NodeProto] = []
    consts = [
        numpy_helper.from_array(np.array(1.0 / math.sqrt(dh), np.float32), "attn_scale"),
        numpy_helper.from_array(
            np.triu(np.full((cfg.max_seq, cfg.max_seq), -1e9, np.float32), 1), "causal_mask"),
        numpy_helper.from_array(np.array([0, 0, h, dh], np.int64), "heads_shape"),
        numpy_helper.from_array(np.array([0, 0, d], np.int64), "model_shape"),
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([0, 0], np.int64), "zeros2"),
        numpy_helper.from_array(np.array([1], np.int64), "one"),
        numpy_helper.from_array(np.array([2], np.int64), "two"),
    ]

    def node(op, inputs, outputs, **attrs):
        nodes.append(helper.make_node(op, inputs, outputs, name=outputs[0], **attrs))
        return outputs[0]

    # sequence length T, the positions [T, d] and the mask [T, T]
    shape = node("Shape", ["input_ids"], ["ids_shape"])
    seq = node("Slice", [shape, "one", "two"], ["seq_len"])  # [T]
    seq2 = node("Concat", [seq, seq], ["seq_len2"], axis=0)
    pos = node("Slice", ["pos_emb", "zero", seq, "zero"], ["pos"])
    mask = node("Slice", ["causal_mask", "zeros2", seq2], ["mask"])

    tok = node("Gather", ["tok_emb", "input_ids"], ["tok"], axis=0)
    x = node("Add", [tok, pos], ["x0"])
    for i in range(cfg.layers):
        p = f"h{i}."
        ln = node("LayerNormalization", [x, p + "ln1.weight", p + "ln1.bias"], [p + "ln1"],
                  axis=-1, epsilon=1e-5)
        heads = {}
        for kind in "qkv":
            proj = node("MatMul", [ln, p + "attn." + kind], [p + kind])
            split = node("Reshape", [proj, "heads_shape"], [p + kind + "_heads"])
            perm = [0, 2, 3, 1] if kind == "k" else [0, 2, 1, 3]
            heads[kind] = node("Transpose", [split], [p + kind + "_t"], perm=perm)
        scores = node("MatMul", [heads["q"], heads["k"]], [p + "scores"])  # [B, H, T, T]
        scaled = node("Mul", [scores, "attn_scale"], [p + "scaled"])
        masked = node("Add", [scaled, mask], [p + "masked"])
        probs = node("Softmax", [masked], [p + "probs"], axis=-1)
        ctx = node("MatMul", [probs, heads["v"]], [p + "ctx"])  # [B, H, T, dh]
        ctx = node("Transpose", [ctx], [p + "ctx_t"], perm=[0, 2, 1, 3])
        ctx = node("Reshape", [ctx, "model_shape"], [p + "ctx_merged"])
        attn = node("MatMul", [ctx, p + "attn.o"], [p + "attn_out"])
        x = node("Add", [x, attn], [p + "x_attn"])
        ln = node("LayerNormalization", [x, p + "ln2.weight", p + "ln2.bias"], [p + "ln2"],
                  axis=-1, epsilon=1e-5)
        hid = node("MatMul", [ln, p + "mlp.fc1"], [p + "fc1_out"])
        hid = node("Gelu", [hid], [p + "gelu"])
        mlp = node("MatMul", [hid, p + "mlp.fc2"], [p + "mlp_out"])
        x = node("Add", [x, mlp], [p + "x_out"])
    ln = node("LayerNormalization", [x, "ln_f.weight", "ln_f.bias"], ["ln_f"], axis=-1, epsilon=1e-5)
    node("MatMul", [ln, "lm_head"], ["logits"])
    return nodes, consts


def make_graph(cfg: DecoderConfig, weights: list[TensorProto]) -> onnx.ModelProto:
    nodes, consts = _graph_nodes(cfg)
    graph = helper.make_graph(
        nodes, "decoder_lm",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", cfg.vocab])],
        weights + consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="onnxtrain-examples", ir_version=10)
    helper.set_model_props(model, {"decoder_lm.config": repr(asdict(cfg))})
    return model


def write_decoder_lm(path: str | os.PathLike, cfg: DecoderConfig) -> dict:
    """Write the model to ``path`` and its weights to ``path.data``; returns sizes and time."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = path.with_name(path.name + ".data")
    t0 = time.perf_counter()
    weights = write_weights(cfg, data, data.name)
    model = make_graph(cfg, weights)
    path.write_bytes(model.SerializeToString())
    seconds = time.perf_counter() - t0
    return {"path": str(path), "data": str(data), "parameters": cfg.parameters,
            "model_bytes": path.stat().st_size, "data_bytes": data.stat().st_size,
            "seconds": seconds}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (this example shows none anyway)")
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--out", default=None,
                        help="output folder (default: a new temporary folder, printed)")
    args = parser.parse_args(argv)
    cfg = CONFIGS[args.config]
    # Never into the repository by default: the weights run to gigabytes.
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="decoder_lm_"))
    info = write_decoder_lm(out / f"decoder_lm_{args.config}.onnx", cfg)
    print(f"{info['path']}: {info['parameters'] / 1e6:.1f} M parameters, "
          f"{info['data_bytes'] / 2**30:.2f} GiB of weights written in {info['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
