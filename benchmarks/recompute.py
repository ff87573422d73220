"""Activation recompute: peak memory and step time of a transformer stack.

Not part of CI.  Trains a pre-norm transformer stack (GPT-style blocks:
``x += Wo·attn(LN1 x)``, ``x += W2·gelu(W1·LN2 x)``, a final LayerNorm, MSE
against a random target, AdamW) built here with onnx.helper, once per
``recompute=`` setting of ``build.training_model``, each in a fresh process
so that its peak resident memory (VmHWM) is its own:

- ``peak``: VmHWM after the timed steps, minus the resident size just
  before the session was made (the interpreter, numpy, onnxruntime and the
  batch are left out; weights, optimizer state and every activation buffer
  are in);
- ``activations``: ``peak`` minus the same process's resident size after the
  session was made and initialized (weights, moments, compiled programs):
  what the training step itself adds, activations and gradients;
- ``step``: the median wall time of the timed steps (after warm-up steps,
  which also let onnxruntime plan its memory pattern).

Defaults: 4 blocks, d_model 256, 4 heads, FFN 1024, sequence 512, batch 4.

    python benchmarks/recompute.py                      # every mode, 3 repeats each
    python benchmarks/recompute.py --modes off blocks --repeats 5
    python benchmarks/recompute.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from onnx import TensorProto, helper, numpy_helper

F32 = TensorProto.FLOAT
HERE = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------------ the model
def transformer_stack(blocks: int = 4, d_model: int = 256, heads: int = 4, ffn: int = 1024,
                      seq: int = 512, batch: int = 4, seed: int = 0, activation: str = "gelu",
                      opset: int = 20):
    """A pre-norm transformer encoder stack as an inference ModelProto, and a batch.

    Per block (static shapes [B, S, D], H heads of dh = D / H):

        h = LN1(x);  q, k, v = split(h Wqkv + bqkv) per head
        x = x + (softmax(q k^T / sqrt(dh)) v) Wo + bo
        x = x + act(LN2(x) W1 + b1) W2 + b2

    then Y = LN(x).  ``activation``: "gelu" (Gelu, opset >= 20) or "relu".
    Returns (model, {"X": ..., "target": ...})."""
    rng = np.random.default_rng(seed)
    B, S, D, H, F = batch, seq, d_model, heads, ffn
    dh = D // H
    inits = []
    nodes = []

    def param(name, shape, scale):
        inits.append(numpy_helper.from_array(rng.uniform(-scale, scale, size=shape).astype(np.float32), name))
        return name

    def const(name, value):
        nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value), name)))
        return name

    heads_shape = const("heads_shape", np.array([B, S, H, dh], np.int64))
    model_shape = const("model_shape", np.array([B, S, D], np.int64))
    split_sizes = const("split_sizes", np.array([D, D, D], np.int64))
    scale = const("attn_scale", np.array(1.0 / np.sqrt(dh), np.float32))

    def layer_norm(x, prefix):
        w = f"{prefix}.weight"
        inits.append(numpy_helper.from_array((1.0 + rng.uniform(-0.1, 0.1, D)).astype(np.float32), w))
        b = param(f"{prefix}.bias", (D,), 0.1)
        y = f"{prefix}.out"
        nodes.append(helper.make_node("LayerNormalization", [x, w, b], [y], axis=-1, epsilon=1e-5))
        return y

    def linear(x, prefix, n_in, n_out):
        w = param(f"{prefix}.weight_t", (n_in, n_out), 1.0 / np.sqrt(n_in))
        b = param(f"{prefix}.bias", (n_out,), 1.0 / np.sqrt(n_in))
        nodes.append(helper.make_node("MatMul", [x, w], [f"{prefix}.mm"]))
        nodes.append(helper.make_node("Add", [f"{prefix}.mm", b], [f"{prefix}.out"]))
        return f"{prefix}.out"

    x = "X"
    for i in range(blocks):
        p = f"block{i}"
        h = layer_norm(x, f"{p}.ln1")
        qkv = linear(h, f"{p}.qkv", D, 3 * D)
        q, k, v = (f"{p}.{n}" for n in "qkv")
        nodes.append(helper.make_node("Split", [qkv, split_sizes], [q, k, v], axis=-1))
        for n, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
            nodes.append(helper.make_node("Reshape", [f"{p}.{n}", heads_shape], [f"{p}.{n}_h"]))
            nodes.append(helper.make_node("Transpose", [f"{p}.{n}_h"], [f"{p}.{n}_t"], perm=perm))
        nodes += [
            helper.make_node("MatMul", [f"{p}.q_t", f"{p}.k_t"], [f"{p}.scores_raw"]),
            helper.make_node("Mul", [f"{p}.scores_raw", scale], [f"{p}.scores"]),
            helper.make_node("Softmax", [f"{p}.scores"], [f"{p}.attn"], axis=-1),
            helper.make_node("MatMul", [f"{p}.attn", f"{p}.v_t"], [f"{p}.ctx_t"]),
            helper.make_node("Transpose", [f"{p}.ctx_t"], [f"{p}.ctx_h"], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", [f"{p}.ctx_h", model_shape], [f"{p}.ctx"]),
        ]
        o = linear(f"{p}.ctx", f"{p}.proj", D, D)
        nodes.append(helper.make_node("Add", [x, o], [f"{p}.res1"]))
        h2 = layer_norm(f"{p}.res1", f"{p}.ln2")
        f1 = linear(h2, f"{p}.fc1", D, F)
        if activation == "gelu":
            nodes.append(helper.make_node("Gelu", [f1], [f"{p}.act"]))
        elif activation == "relu":
            nodes.append(helper.make_node("Relu", [f1], [f"{p}.act"]))
        else:
            raise ValueError(f"activation must be 'gelu' or 'relu', not {activation!r}")
        f2 = linear(f"{p}.act", f"{p}.fc2", F, D)
        nodes.append(helper.make_node("Add", [f"{p}.res1", f2], [f"{p}.res2"]))
        x = f"{p}.res2"
    y = layer_norm(x, "final_ln")
    nodes.append(helper.make_node("Identity", [y], ["Y"]))
    graph = helper.make_graph(
        nodes, "transformer_stack",
        [helper.make_tensor_value_info("X", F32, [B, S, D])],
        [helper.make_tensor_value_info("Y", F32, [B, S, D])], inits)
    if activation == "relu" and opset < 17:
        opset = 17
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    feeds = {"X": rng.standard_normal((B, S, D)).astype(np.float32),
             "target": rng.standard_normal((B, S, D)).astype(np.float32)}
    return model, feeds


# ------------------------------------------------------------------ one measurement
#: Session configurations: onnxruntime's memory settings (see the module docstring).
CONFIGS = {
    # what TrainingSession chooses: CPU arena, memory pattern (off when
    # recompute= is on), buffer reuse
    "default": {},
    # arena and memory pattern off (as onnxtrain does for large models): malloc'ed buffers
    "no-arena": {"enable_cpu_mem_arena": False, "enable_mem_pattern": False},
    # the memory pattern alone off (arena and reuse on), glibc's malloc as it is
    "no-pattern": {"enable_mem_pattern": False},
    # ... and buffer reuse off too: each value freed after its last reader (true live bytes)
    "no-reuse": {"enable_cpu_mem_arena": False, "enable_mem_pattern": False, "enable_mem_reuse": False},
}


def _status(field: str) -> float:
    """A /proc/self/status field in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker(mode, config: str, steps: int, warmup: int, shape: dict) -> dict:
    """Build, train ``warmup + steps`` steps, measure (runs in a fresh process)."""
    sys.path.insert(0, os.path.dirname(HERE))
    import onnxtrain
    from onnxtrain import build
    from onnxtrain.runtime.executor import default_session_options

    model, feeds = transformer_stack(**shape)
    tm = build.training_model(model, loss="mse", output="Y", optimizer=build.AdamW(lr=1e-3),
                              recompute=mode)
    # "default": the options the session chooses itself (with recompute= on,
    # no memory pattern); the others: default_session_options() changed.
    so = None
    if config != "default":
        so = default_session_options()
        for key, value in CONFIGS[config].items():
            setattr(so, key, value)
    before = _status("VmRSS")
    sess = onnxtrain.TrainingSession(tm, session_options=so)
    sess.initialize()
    program = sess.programs()["training_info[0].algorithm"]
    copies = sum(1 for n in program.graph.node if n.name.endswith("/copy") or "/copy_" in n.name)
    ready = _status("VmRSS")
    times, losses = [], []
    for i in range(warmup + steps):
        t = time.perf_counter()
        out = sess.train_step(feeds)
        dt = time.perf_counter() - t
        losses.append(float(out[next(k for k, v in out.items() if np.ndim(v) == 0)]))
        if i >= warmup:
            times.append(dt)
    peak = _status("VmHWM")
    return {"mode": mode, "config": config, "peak_mib": peak - before,
            "activations_mib": peak - ready, "state_mib": ready - before,
            "step_s": statistics.median(times), "times": times, "losses": losses,
            "recompute_nodes": copies, "program_nodes": len(program.graph.node)}


def measure(mode, config: str, steps: int, warmup: int, shape: dict) -> dict:
    """``worker`` in a fresh interpreter (its own VmHWM)."""
    env = dict(os.environ)
    if config in ("no-arena", "no-reuse"):
        # glibc: every buffer over 64 KiB its own mapping, returned on free, so
        # that the resident size follows the live bytes (no heap fragmentation).
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    args = json.dumps({"mode": mode, "config": config, "steps": steps, "warmup": warmup, "shape": shape})
    p = subprocess.run([sys.executable, __file__, "--worker", args], capture_output=True,
                       text=True, env=env, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"worker {mode!r} {config!r} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="+", default=["off", "elementwise", "blocks"],
                    help="off, elementwise, blocks, an int (segments) or comma-separated checkpoint names")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per (mode, config)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        w = json.loads(args.worker)
        print(json.dumps(worker(w["mode"], w["config"], w["steps"], w["warmup"], w["shape"])))
        return
    shape = {"blocks": args.blocks, "d_model": args.d_model, "heads": args.heads,
             "ffn": 4 * args.d_model, "seq": args.seq, "batch": args.batch}

    def parse(m: str):
        if m == "off":
            return None
        if m.isdigit():
            return int(m)
        if m in ("elementwise", "blocks"):
            return m
        return m.split(",")

    print(f"transformer stack {shape}, AdamW, {args.steps} timed steps after {args.warmup}, "
          f"{args.repeats} processes each; medians")
    rows = []
    for config in args.configs:
        results = {}
        # Interleave the modes (noisy shared machines): repeat r of every mode, then r + 1.
        for r in range(args.repeats):
            for m in args.modes:
                results.setdefault(m, []).append(measure(parse(m), config, args.steps, args.warmup, shape))
        base = results[args.modes[0]]
        base_act = statistics.median(x["activations_mib"] for x in base)
        base_step = statistics.median(x["step_s"] for x in base)
        base_losses = base[0]["losses"]
        print(f"\n[{config}]  {'mode':<14}{'peak MiB':>10}{'activ. MiB':>12}{'ratio':>8}"
              f"{'step s':>9}{'ratio':>8}  {'copies':>7}  max |loss diff|")
        for m, xs in results.items():
            act = statistics.median(x["activations_mib"] for x in xs)
            step = statistics.median(x["step_s"] for x in xs)
            diff = max(abs(a - b) for a, b in zip(xs[0]["losses"], base_losses))
            print(f"[{config}]  {m:<14}{statistics.median(x['peak_mib'] for x in xs):>10.1f}"
                  f"{act:>12.1f}{act / base_act:>8.2f}{step:>9.3f}{step / base_step:>8.2f}"
                  f"  {xs[0]['recompute_nodes']:>7}  {diff:.2e}")
            rows.extend(xs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": shape, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
