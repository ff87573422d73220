"""Large models (issue 14): memory against the model's size, time against the disk.

The model is the issue's: ``Y = X·W`` with one weight ``W [4096, cols]`` in
external data (1 GiB by default), trained with an MSE loss.  Every phase runs
in a fresh process, so its peak resident memory (VmHWM, reset before the
phase where the kernel allows) is its own, reported over the process's RSS
after ``import onnxtrain`` (the import baseline):

- ``disk``: sequential write (with fsync) and read of a file of the model's
  size, the speed the I/O phases are compared with;
- ``build``: ``build.training_model(path, ...)`` and writing the training model;
- ``session``: ``TrainingSession(train.onnx)``, ``initialize()``, 2 steps,
  ``run()``, and the export (merged for LoRA), each timed, peak over all;
- ``torch`` (``--torch PYTHON``): the same full fine-tune in PyTorch, with
  ``torch.optim.SGD`` or ``AdamW`` on ``nn.Linear(4096, cols, bias=False)``.

Modes: ``lora`` (W frozen, rank-8 adapters: the memory bound of the issue is
1.3·S + 300 MB with S the frozen bytes), ``sgd`` and ``adam`` (full fine-tune;
S is then the trainable bytes, compared with PyTorch), and ``sgd-lean``,
``adam-lean`` (the same with ``TrainingSession(memory="lean")``).

    python benchmarks/large_models.py --gb 1 --modes lora sgd adam \\
        --torch benchmarks/.venv-ort-training/bin/python --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from large_model import _reset_peak, _status  # the same /proc readings

K = 4096
BATCH = 64


def make_model(folder: str, gb: float) -> tuple[str, int]:
    """The inference model, its weight streamed straight to the data file."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    cols = max(1, int(gb * 2**30) // (K * 4))
    data = os.path.join(folder, "model.onnx.data")
    rng = np.random.default_rng(0)
    with open(data, "wb") as f:
        for start in range(0, K, 256):  # 256 rows at a time
            block = rng.standard_normal((min(256, K - start), cols), dtype=np.float32)
            block *= 0.01
            block.tofile(f)
    w = TensorProto()
    w.name, w.data_type = "W", TensorProto.FLOAT
    w.dims.extend([K, cols])
    w.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "model.onnx.data"), ("offset", "0"), ("length", str(K * cols * 4))):
        w.external_data.add(key=key, value=value)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])], "big",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", K])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", cols])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = os.path.join(folder, "model.onnx")
    onnx.save(model, path)
    return path, K * cols * 4


# ------------------------------------------------------------------ phases
def _drop_caches() -> bool:
    """With ``--cold`` (root on Linux): empty the page cache, so reads hit the disk."""
    if not os.environ.get("LARGE_MODELS_COLD"):
        return False
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def phase_disk(folder: str, nbytes: int) -> dict:
    import numpy as np

    path = os.path.join(folder, "disk.bin")
    block = np.ones(64 * 2**20 // 4, np.float32)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // block.nbytes)):
            f.write(memoryview(block).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    write = time.perf_counter() - t0
    buf = bytearray(64 * 2**20)
    cold = _drop_caches()
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    read = time.perf_counter() - t0
    size = os.path.getsize(path)
    os.unlink(path)
    return {"write_MBps": size / write / 1e6, "read_MBps": size / read / 1e6, "cold": cold}


def _optimizer(mode: str):
    from onnxtrain import build

    return build.AdamW(lr=1e-4) if mode == "adam" else build.SGD(lr=1e-3)


def phase_build(folder: str, mode: str) -> dict:
    import onnxtrain  # noqa: F401  (the baseline includes the import)
    from onnxtrain import build
    from onnxtrain.io.storage import write_model

    base = _status("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    lora = build.LoRA(rank=8, alpha=16) if mode == "lora" else None
    tm = build.training_model(os.path.join(folder, "model.onnx"), loss="mse", target="T",
                              optimizer=_optimizer(mode), lora=lora)
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    write_model(tm, os.path.join(folder, f"train_{mode}.onnx"))
    t_write = time.perf_counter() - t0
    return {"build_s": t_build, "write_s": t_write, "peak": _status("VmHWM") - base}


def phase_session(folder: str, mode: str, nbytes: int) -> dict:
    import numpy as np

    from onnxtrain import TrainingSession

    base = _status("VmRSS")
    times = {"cold": _drop_caches()}
    _reset_peak()
    t0 = time.perf_counter()
    kind, _, memory = mode.partition("-")
    sess = TrainingSession(os.path.join(folder, f"train_{kind}.onnx"), memory=memory or "safe")
    times["construct_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    sess.initialize()
    times["initialize_s"] = time.perf_counter() - t0
    cols = nbytes // (K * 4)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((BATCH, K), dtype=np.float32)
    t = rng.standard_normal((BATCH, cols), dtype=np.float32)
    steps = []
    for _ in range(2):
        t0 = time.perf_counter()
        sess.train_step({"X": x, "T": t})
        steps.append(time.perf_counter() - t0)
    times["step_s"] = steps
    t0 = time.perf_counter()
    sess.run({"X": x})
    times["run_s"] = time.perf_counter() - t0
    peak_steps = _status("VmHWM") - base
    out = os.path.join(folder, f"export_{mode}", "model.onnx")
    os.environ["ONNXTRAIN_EXTERNAL_DATA_THRESHOLD"] = str(2**20)
    t0 = time.perf_counter()
    sess.export(out)
    times["export_s"] = time.perf_counter() - t0
    exported = sum(os.path.getsize(os.path.join(os.path.dirname(out), n))
                   for n in os.listdir(os.path.dirname(out)))
    return {**times, "peak_steps": peak_steps, "peak": _status("VmHWM") - base,
            "export_bytes": exported}


TORCH_CODE = r"""
import json, sys, time
import numpy as np, torch
def status(field):
    for line in open('/proc/self/status'):
        if line.startswith(field + ':'):
            return int(line.split()[1]) * 1024
torch.set_num_threads(2)
mode, path, cols = sys.argv[1], sys.argv[2], int(sys.argv[3])
base = status('VmRSS')
lin = torch.nn.Linear(4096, cols, bias=False)
with torch.no_grad():
    lin.weight.copy_(torch.from_numpy(np.fromfile(path, np.float32).reshape(4096, cols).T))
opt = torch.optim.AdamW(lin.parameters(), lr=1e-4) if mode == 'adam' else torch.optim.SGD(lin.parameters(), lr=1e-3)
rng = np.random.default_rng(1)
x = torch.from_numpy(rng.standard_normal((64, 4096), dtype=np.float32))
t = torch.from_numpy(rng.standard_normal((64, cols), dtype=np.float32))
steps = []
for _ in range(2):
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(lin(x), t)
    loss.backward()
    opt.step()
    steps.append(time.perf_counter() - t0)
print(json.dumps({"peak": status('VmHWM') - base, "step_s": steps}))
"""


def _child(args: list[str], python: str = sys.executable) -> dict:
    out = subprocess.run([python, __file__, "--phase", *args], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"phase {args[0]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--modes", nargs="+", default=["lora", "sgd", "sgd-lean", "adam", "adam-lean"])
    ap.add_argument("--torch", help="a python with torch, for the PyTorch full fine-tune")
    ap.add_argument("--dir", help="work folder (default: a temporary one, removed)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--cold", action="store_true",
                    help="empty the page cache before the disk read and each session (needs root)")
    ap.add_argument("--phase", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.phase:
        name, folder, *rest = args.phase
        result = {
            "disk": lambda: phase_disk(folder, int(rest[0])),
            "build": lambda: phase_build(folder, rest[0]),
            "session": lambda: phase_session(folder, rest[0], int(rest[1])),
        }[name]()
        print(json.dumps(result))
        return 0
    if args.cold:
        os.environ["LARGE_MODELS_COLD"] = "1"
    folder = args.dir or tempfile.mkdtemp(prefix="onnxtrain-large-")
    try:
        t0 = time.perf_counter()
        _, nbytes = make_model(folder, args.gb)
        results: dict = {"S_bytes": nbytes, "make_s": time.perf_counter() - t0}
        results["disk"] = _child(["disk", folder, str(nbytes)])
        for mode in args.modes:
            kind = mode.partition("-")[0]
            r = {"build": results[kind]["build"] if kind in results else _child(["build", folder, kind]),
                 "session": _child(["session", folder, mode, str(nbytes)])}
            if args.torch and mode in ("sgd", "adam"):
                proc = subprocess.run([args.torch, "-c", TORCH_CODE, mode,
                                       os.path.join(folder, "model.onnx.data"), str(nbytes // (K * 4))],
                                      capture_output=True, text=True, check=True)
                r["torch"] = json.loads(proc.stdout.strip().splitlines()[-1])
            results[mode] = r
            shutil.rmtree(os.path.join(folder, f"export_{mode}"), ignore_errors=True)
    finally:
        if not args.dir:
            shutil.rmtree(folder, ignore_errors=True)
    report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def report(results: dict) -> None:
    s = results["S_bytes"]
    mib = 2**20
    disk = results["disk"]
    print(f"S = {s / mib:.0f} MiB; disk: write {disk['write_MBps']:.0f} MB/s (fsync), read "
          f"{disk['read_MBps']:.0f} MB/s ({'cold: page cache emptied' if disk.get('cold') else 'page cache'})")
    for mode in ("lora", "sgd", "sgd-lean", "adam", "adam-lean"):
        if mode not in results:
            continue
        b, r = results[mode]["build"], results[mode]["session"]
        export_rate = r["export_bytes"] / r["export_s"] / 1e6
        load_rate = s / r["construct_s"] / 1e6 if mode != "lora" else float("nan")
        print(f"[{mode}] build {b['build_s']:.2f} s + write {b['write_s']:.2f} s (peak +{b['peak'] / mib:.0f} MiB); "
              f"construct {r['construct_s']:.2f} s ({load_rate:.0f} MB/s of state, "
              f"{load_rate / disk['read_MBps']:.0%} of the read), steps {', '.join(f'{x:.2f}' for x in r['step_s'])} s, "
              f"run {r['run_s']:.2f} s, export {r['export_s']:.2f} s ({export_rate:.0f} MB/s, "
              f"{export_rate / disk['write_MBps']:.0%} of disk write)")
        print(f"       peak RSS +{r['peak'] / mib:.0f} MiB = {r['peak'] / s:.2f}·S "
              f"(steps alone +{r['peak_steps'] / mib:.0f} MiB)"
              + (f"; bound 1.3·S + 300 MB = {(1.3 * s + 300e6) / mib:.0f} MiB" if mode == "lora" else ""))
        if "torch" in results[mode]:
            t = results[mode]["torch"]
            print(f"       PyTorch: peak +{t['peak'] / mib:.0f} MiB = {t['peak'] / s:.2f}·S, "
                  f"steps {', '.join(f'{x:.2f}' for x in t['step_s'])} s")


if __name__ == "__main__":
    sys.exit(main())
