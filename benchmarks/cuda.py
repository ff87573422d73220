"""W1, W5, W6 and L1 on onnxruntime's CUDA execution provider against PyTorch CUDA.

    python benchmarks/cuda.py [--workloads W1,W5,W6,L1] [--steps 50] [--device cuda] [--out DIR]

onnxtrain runs ``TrainingSession(model, providers=[CUDA, CPU])``: its state
lives on the GPU (OrtValues on ('cuda', 0), bound in place), the batch is fed
from host memory each step as a user's loop would, and ``fetch=False`` keeps
the loss on the device.  PyTorch trains the same weights on the same batch
(kept on the GPU) with the same optimizer, eager mode, and is synchronized
after each timed step.  Each (workload, framework) runs in a fresh process
(``--worker``); reported: time to first step (construction + first step,
imports excluded), the median step time after warm-up, the first losses of
both (the equal-work check) and the ratio onnxtrain / PyTorch.

W5 and W6 are exported from PyTorch by ``export_models.py`` with this
Python (``BENCH_EXPORT_PYTHON``); L1 is ``llm.py``'s (a seeded 32 M Llama,
dynamo export, LoRA r=16 on its seven projections; peft on the same weights).
``--device cpu`` runs the same script on CPU (to try it without a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("BENCH_EXPORT_PYTHON", sys.executable)

FRAMEWORKS = ("onnxtrain", "torch")


def providers(device: str) -> list:
    if device == "cuda":
        return [("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


# ------------------------------------------------------------------ W1, W5, W6
def classic_onnxtrain(key: str, device: str, steps: int, warmup: int) -> dict:
    from training_model import training_model
    from workloads import WORKLOADS

    from onnxtrain import TrainingSession

    inference, _, batch = WORKLOADS[key].build()
    t0 = time.perf_counter()
    model, _ = training_model(inference, WORKLOADS[key], use_builder=True)
    sess = TrainingSession(model, providers=providers(device))
    return _measure(lambda: float(sess.train_step(batch)["loss"]), lambda: sess.train_step(batch, fetch=False),
                    t0, steps, warmup, None, lambda: _where(device))


def _where(device: str) -> dict:
    """Where the state lives (what onnxtrain chose from the providers this
    onnxruntime has) and this process's GPU memory as nvidia-smi reports it."""
    from onnxtrain.runtime.executor import state_device

    return {"state_device": list(state_device(providers(device))), "gpu_mib": _gpu_mib()}


def _gpu_mib() -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [line.split(",") for line in out.splitlines() if "," in line]
    return sum(float(mem) for pid, mem in rows if int(pid) == os.getpid())


def classic_torch(key: str, device: str, steps: int, warmup: int) -> dict:
    import torch
    import torch_models
    from workloads import WORKLOADS

    w = WORKLOADS[key]
    inference, params, batch = w.build()
    t0 = time.perf_counter()
    model = torch_models.build(key, params).to(device).train()
    inputs = [i.name for i in inference.graph.input if i.name in batch and i.name != w.target]
    xs = [torch.from_numpy(batch[n]).to(device) for n in inputs]
    y = torch.from_numpy(batch[w.target]).to(device)
    loss_fn = torch.nn.CrossEntropyLoss() if w.loss == "cross_entropy" else torch.nn.MSELoss()
    if w.optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=w.lr, weight_decay=w.weight_decay)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=w.lr, momentum=w.momentum or 0.0)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(*xs), y)
        loss.backward()
        opt.step()
        return loss

    return _measure(lambda: float(step().item()), step, t0, steps, warmup, *_torch_sync_where(device))


# ------------------------------------------------------------------ L1
def l1_files(work: Path) -> dict:
    import llm

    files_json = work / "L1-files.json"
    if not files_json.exists():
        files_json.write_text(json.dumps(llm.prepare("L1", llm.spec_of("L1", False), work)))
    return json.loads(files_json.read_text())


def l1_onnxtrain(device: str, steps: int, warmup: int, work: Path) -> dict:
    import llm
    import numpy as np

    from onnxtrain import TrainingSession, build

    spec, files = llm.spec_of("L1", False), l1_files(work)
    tokens = np.load(work / "L1-tokens.npy")
    feeds = {"input_ids": tokens[0, :, :-1].copy(), "labels": tokens[0, :, 1:].copy()}
    t0 = time.perf_counter()
    sess = TrainingSession(build.training_model(files["onnx"], **llm.build_args(spec)), providers=providers(device))
    return _measure(lambda: float(sess.train_step(feeds)["loss"]), lambda: sess.train_step(feeds, fetch=False),
                    t0, steps, warmup, None, lambda: _where(device))


def l1_torch(device: str, steps: int, warmup: int, work: Path) -> dict:
    import llm
    import numpy as np
    import torch
    from peft import LoraConfig, get_peft_model

    files = l1_files(work)
    vocab = llm.MODELS["32m"]["vocab"]
    tokens = np.load(work / "L1-tokens.npy")
    t0 = time.perf_counter()
    model = llm.load_torch_model(Path(files["folder"])).train()
    model = get_peft_model(model, LoraConfig(r=llm.RANK, lora_alpha=llm.ALPHA, lora_dropout=0.0,
                                             target_modules=list(llm.PROJECTIONS), bias="none"))
    a_init = np.load(work / "L1-lora_A.npz")
    with torch.no_grad():
        for name in a_init.files:
            module = model.base_model.model.get_submodule(name)
            module.lora_A["default"].weight.copy_(torch.from_numpy(a_init[name].T))
    model = model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=llm.LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=llm.WD)
    ids = torch.from_numpy(tokens[0, :, :-1].copy()).to(device)
    labels = torch.from_numpy(tokens[0, :, 1:].copy()).to(device)

    def step():
        logits = model(input_ids=ids, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return _measure(lambda: float(step().detach()), step, t0, steps, warmup, *_torch_sync_where(device))


# ------------------------------------------------------------------ timing and the parent
def _measure(loss_step, step, t0: float, steps: int, warmup: int, sync, where) -> dict:
    """The first step's loss and time since ``t0`` (construction included),
    two more losses (the equal-work check), the timed steps, then ``where()``
    (read after them: the memory they used)."""
    losses = [loss_step()]
    first = time.perf_counter() - t0
    losses += [loss_step() for _ in range(2)]
    timed = _timed(step, steps, warmup, sync)
    return dict(first_s=first, losses=losses, **timed, where=where())


def _torch_sync_where(device: str) -> tuple:
    """PyTorch's synchronization for timing, and where it ran (its GPU memory, read when called)."""
    import torch

    if device != "cuda":
        return None, lambda: {"device": device, "gpu_mib": None, "max_allocated_mib": None}
    return torch.cuda.synchronize, lambda: {"device": device, "gpu_mib": _gpu_mib(),
                                            "max_allocated_mib": torch.cuda.max_memory_allocated() / 2**20}


def _timed(step, steps: int, warmup: int, sync) -> dict:
    for _ in range(warmup):
        step()
    if sync:
        sync()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        if sync:
            sync()
        times.append(time.perf_counter() - t)
    return {"step_ms": statistics.median(times) * 1e3, "p90_ms": sorted(times)[int(0.9 * (len(times) - 1))] * 1e3}


def worker(framework: str, key: str, device: str, steps: int, warmup: int, work: Path) -> dict:
    import onnx  # noqa: F401  (imports before the clock, as for every framework)
    if framework == "torch":
        import torch  # noqa: F401
    else:
        import onnxruntime  # noqa: F401

        import onnxtrain  # noqa: F401
    if key == "L1":
        fn = l1_onnxtrain if framework == "onnxtrain" else l1_torch
        return fn(device, steps, warmup, work)
    fn = classic_onnxtrain if framework == "onnxtrain" else classic_torch
    return fn(key, device, steps, warmup)


def versions() -> dict:
    import onnx
    import onnxruntime
    import torch

    out = {"onnxruntime": onnxruntime.__version__, "ort_providers": onnxruntime.get_available_providers(),
           "onnx": onnx.__version__, "torch": torch.__version__, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="W1,W5,W6,L1")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", default=".", help="where results.json goes")
    ap.add_argument("--work", default=str(HERE / ".cache" / "cuda"))
    ap.add_argument("--worker", nargs=2, metavar=("FRAMEWORK", "KEY"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.worker:
        print(json.dumps(worker(*args.worker, args.device, args.steps, args.warmup, work)))
        return 0
    report = {"versions": versions(), "device": args.device, "steps": args.steps, "results": {}}
    print(json.dumps(report["versions"]), flush=True)
    for key in args.workloads.split(","):
        row = report["results"][key] = {}
        for fw in FRAMEWORKS:
            cmd = [sys.executable, __file__, "--worker", fw, key, "--device", args.device,
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--work", str(work)]
            t = time.perf_counter()
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if out.returncode != 0:
                row[fw] = {"error": out.stderr[-3000:]}
            else:
                row[fw] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{key} {fw} ({time.perf_counter() - t:.0f} s): {json.dumps(row[fw])[:1500]}", flush=True)
        if all("step_ms" in row.get(fw, {}) for fw in FRAMEWORKS):
            a, b = row["onnxtrain"], row["torch"]
            row["ratio"] = a["step_ms"] / b["step_ms"]
            row["first_ratio"] = a["first_s"] / b["first_s"]
            row["loss_rel_diff"] = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a["losses"], b["losses"]))
            print(f"{key}: onnxtrain {a['step_ms']:.2f} ms, torch {b['step_ms']:.2f} ms, ratio {row['ratio']:.2f}; "
                  f"first step {a['first_s']:.2f} s vs {b['first_s']:.2f} s; losses rel diff "
                  f"{row['loss_rel_diff']:.1e}", flush=True)
        Path(args.out, "results.json").write_text(json.dumps(report, indent=1))  # (after each workload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
