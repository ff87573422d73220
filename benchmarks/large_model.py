"""Large models: export with external data, then load; time and peak memory.

Not part of CI.  Builds a training model whose state is ``--gb`` GiB of
float32 weights split over ``--tensors`` tensors (Y = X @ W_0 + ... chain,
the algorithm decays every weight), and measures, each phase in a fresh
process so that its peak resident memory (VmHWM) is its own:

- ``export``: ``TrainingSession.export(path, training=True)`` with the
  external-data threshold lowered below the model size (the same path a
  model over 1.5 GiB takes by default);
- ``raw read``: reading the data file into one preallocated buffer, the
  disk-speed baseline (page cache warm, as for every phase here);
- ``load``: ``onnxtrain.io.model.load(path)``, which reads every tensor of every
  graph into the ModelProto, after all the safety checks;
- ``session``: ``TrainingSession(path)`` (load, validate, build programs,
  copy the state into onnxruntime buffers), for information.

Memory is reported as the peak minus the process's resident size just
before the phase, and as a ratio to the model's tensor bytes.

    python benchmarks/large_model.py                 # 1 GiB over 8 tensors
    python benchmarks/large_model.py --tensors 1     # the worst case: one 1 GiB tensor
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return float("nan")


def _reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so the peak is this phase's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def build(gb: float, tensors: int):
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    total = int(gb * 2**30)
    cols = 1024
    rows = max(1, total // tensors // 4 // cols)
    nodes, inits, updates, algo_nodes, algo_out = [], [], [], [], []
    prev = "X"
    rng = np.random.default_rng(0)
    for i in range(tensors):
        w = rng.standard_normal((rows, cols), dtype=np.float32)
        inits.append(numpy_helper.from_array(w, f"W{i}"))
        del w
        # X [N, rows] -> ReduceSum over W's columns keeps the chain cheap to run.
        nodes.append(helper.make_node("MatMul", [prev, f"W{i}"], [f"h{i}"]))
        nodes.append(helper.make_node("ReduceSum", [f"h{i}", "axes"], [f"s{i}"], keepdims=1))
        nodes.append(helper.make_node("Expand", [f"s{i}", "xshape"], [f"x{i + 1}"]))
        prev = f"x{i + 1}"
        algo_nodes.append(helper.make_node("Mul", [f"W{i}", "decay"], [f"W{i}_new"]))
        algo_out.append(helper.make_tensor_value_info(f"W{i}_new", TensorProto.FLOAT, [rows, cols]))
        updates.append((f"W{i}", f"W{i}_new"))
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "axes"))
    inits.append(numpy_helper.from_array(np.array([1, rows], np.int64), "xshape"))
    nodes.append(helper.make_node("Identity", [prev], ["Y"]))
    graph = helper.make_graph(nodes, "main", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, rows])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, rows])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    ti = model.training_info.add()
    ti.algorithm.CopyFrom(helper.make_graph(
        algo_nodes, "algorithm", [], algo_out,
        [numpy_helper.from_array(np.float32(0.999), "decay")]))
    for k, v in updates:
        ti.update_binding.add(key=k, value=v)
    return model, rows * cols * 4 * tensors


def phase_export(path: str, gb: float, tensors: int) -> dict:
    from onnxtrain import TrainingSession

    model, nbytes = build(gb, tensors)
    sess = TrainingSession(model)
    del model
    os.environ["ONNXTRAIN_EXTERNAL_DATA_THRESHOLD"] = str(2**20)
    before = _status("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    sess.export(path, training=True)
    seconds = time.perf_counter() - t0
    return {"tensor_bytes": nbytes, "seconds": seconds, "before": before, "peak": _status("VmHWM")}


def phase_raw(path: str) -> dict:
    folder = os.path.dirname(path)
    data = [os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".data")][0]
    size = os.path.getsize(data)
    before = _status("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    buf = bytearray(size)
    with open(data, "rb", buffering=0) as f:
        view = memoryview(buf)
        got = 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
    seconds = time.perf_counter() - t0
    return {"bytes": size, "seconds": seconds, "before": before, "peak": _status("VmHWM")}


def phase_load(path: str) -> dict:
    import onnxtrain.io.model as otmodel

    before = _status("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    proto, _ = otmodel.load(path)
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    t1 = time.perf_counter()
    otmodel.validate(proto)
    validate_s = time.perf_counter() - t1
    return {"seconds": seconds, "before": before, "peak": peak, "validate_seconds": validate_s,
            "peak_with_validate": _status("VmHWM")}


def phase_session(path: str) -> dict:
    import numpy as np

    from onnxtrain import TrainingSession

    before = _status("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    sess = TrainingSession(path)
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    rows = sess.inference_inputs["X"].type.tensor_type.shape.dim[1].dim_value
    t1 = time.perf_counter()
    sess.run({"X": np.ones((1, rows), np.float32)})
    first_run = time.perf_counter() - t1
    return {"seconds": seconds, "before": before, "peak": peak, "first_run_seconds": first_run,
            "peak_after_first_run": _status("VmHWM")}


def _child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--phase", *args], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--dir", help="folder for the model (default: a temporary one)")
    ap.add_argument("--session", action="store_true", help="also measure TrainingSession(path)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--phase", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.phase:
        name, path, *rest = args.phase
        result = {"export": lambda: phase_export(path, float(rest[0]), int(rest[1])),
                  "raw": lambda: phase_raw(path), "load": lambda: phase_load(path),
                  "session": lambda: phase_session(path)}[name]()
        print(json.dumps(result))
        return 0

    folder = args.dir or tempfile.mkdtemp(prefix="onnxtrain-large-")
    path = os.path.join(folder, "large.onnx")
    mib = 2**20
    results = {"export": _child(["export", path, str(args.gb), str(args.tensors)])}
    nbytes = results["export"]["tensor_bytes"]
    results["raw"] = _child(["raw", path])
    results["load"] = _child(["load", path])
    if args.session:
        results["session"] = _child(["session", path])
    model_file = os.path.getsize(path)
    print(f"model: {nbytes / mib:.0f} MiB of tensors in {args.tensors} tensor(s); "
          f"model file {model_file / 1024:.1f} KiB + data file {results['raw']['bytes'] / mib:.0f} MiB")
    for name, r in results.items():
        peak = (r["peak"] - r["before"]) / mib
        rate = nbytes / mib / r["seconds"]
        print(f"{name:8s} {r['seconds']:7.2f} s  {rate:7.0f} MiB/s  peak +{peak:7.0f} MiB "
              f"({peak * mib / nbytes:.2f}x the model)")
    load = results["load"]
    print(f"load / raw read speed: {results['raw']['seconds'] / load['seconds']:.2f}; "
          f"validate after load: {load['validate_seconds']:.2f} s, "
          f"peak with validate +{(load['peak_with_validate'] - load['before']) / mib:.0f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gb": args.gb, "tensors": args.tensors, "tensor_bytes": nbytes,
                       "model_file_bytes": model_file, **results}, f, indent=1)
    if not args.dir:
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
