"""One benchmark child process: one framework training one workload, or one side task.

``run.py`` starts it with the interpreter of the framework's environment and
talks to it in JSON lines: the child's stdout carries only the protocol (any
library output is moved to stderr).

Trainers (``python worker.py train FRAMEWORK WORKDIR``):

    start          -> {"ready": true, "build_ms", "first_step_ms", "losses", "info"}
                      (build the trainer, run ``--check-steps`` steps recording losses)
    {"run": n}     -> {"times_ms": [...]}   n timed steps, one perf_counter pair each
    {"exit": true} -> {"maxrss_kb": ...}    the high-water mark of this process

Frameworks: onnxtrain, torch (default optimizer), torch-fused (``fused=True``),
onnx2torch (the inference model converted, trained in torch),
ort-training (onnxruntime.training.api on artifacts from ``ort-artifacts``).

Side tasks (one JSON line, then exit): ``ort-artifacts WORKDIR``,
``overhead WORKDIR``, ``profile WORKDIR``, ``ort-profile WORKDIR``, ``ceiling``.

WORKDIR (written by run.py) holds ``spec.json``, ``model.onnx`` (inference
model), ``params.npz``, ``batch.npz`` and, for ort-training, ``ort/``.  The
torch peers read their weights from ``params.pt`` (``torch.save``, written
from ``params.npz`` before the first one's clock) inside the clock, as
onnxtrain and onnx2torch read ``model.onnx`` and ORT training its artifacts.
"""

from __future__ import annotations

import os
import sys
import time

_T0 = time.perf_counter()

if __name__ == "__main__":
    _threads = os.environ.get("BENCH_THREADS", "2")
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "ONNXTRAIN_THREADS"):
        os.environ.setdefault(_var, _threads)

import argparse  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

THREADS = int(os.environ.get("BENCH_THREADS", "2"))
#: "0": onnxruntime's intra-op threads block instead of spinning while idle (run.py --wait passive).
ORT_SPIN = os.environ.get("BENCH_ORT_SPIN", "0")


# ----------------------------------------------------------------- protocol
class Channel:
    """JSON lines on the original stdout; fd 1 then points at stderr."""

    def __init__(self) -> None:
        self._out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr

    def send(self, obj) -> None:
        self._out.write(json.dumps(obj) + "\n")
        self._out.flush()

    @staticmethod
    def receive():
        line = sys.stdin.readline()
        return json.loads(line) if line else {"exit": True}


def load_workdir(workdir: Path):
    spec = json.loads((workdir / "spec.json").read_text())
    params = dict(np.load(workdir / "params.npz"))
    batch = dict(np.load(workdir / "batch.npz"))
    return spec, params, batch


def _status_kb(field: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_kb() -> int:
    """The current resident set size (KiB)."""
    return _status_kb("VmRSS")


def maxrss_kb() -> int:
    """Peak RSS of this process (KiB).

    ``getrusage(RUSAGE_SELF).ru_maxrss`` is the natural measure, but Linux
    carries it across fork+exec: a child starts with its parent's high-water
    mark (run.py's, ~100+ MB).  VmHWM is the high-water mark of this process
    image alone; ru_maxrss is the fallback where /proc is missing."""
    return _status_kb("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def onnxtrain_defaults() -> None:
    """Set the benchmark's thread count and spin setting where onnxtrain's own
    defaults read them (the environment): a trainer then passes no options and
    gets those defaults (the memory pattern by model size, docs/performance.md)."""
    os.environ["ONNXTRAIN_THREADS"] = str(THREADS)
    os.environ["ONNXTRAIN_SPINNING"] = ORT_SPIN


def onnxtrain_session_options():
    """onnxtrain's default options as an object, with the benchmark's thread
    count and spin setting: for the sessions a profile makes itself."""
    from onnxtrain.runtime.executor import default_session_options

    so = default_session_options(THREADS)
    so.add_session_config_entry("session.intra_op.allow_spinning", ORT_SPIN)
    return so


# ----------------------------------------------------------------- trainers
class OnnxtrainTrainer:
    """onnxtrain.TrainingSession on the workload's training model; timed with fetch=False."""

    def __init__(self, workdir: Path, spec, params, batch) -> None:
        import onnx
        from training_model import training_session
        from workloads import WORKLOADS

        import onnxtrain

        workload = WORKLOADS[spec["key"]]
        inference = onnx.load(str(workdir / "model.onnx"))
        onnxtrain_defaults()
        self.sess, how = training_session(inference, workload, use_builder=spec.get("builder", True))
        self.feeds = dict(batch)
        self.info = {"framework": "onnxtrain", "onnxtrain": onnxtrain.__version__,
                     "training_model": how}
        import onnxruntime

        self.info["onnxruntime"] = onnxruntime.__version__
        self.info["onnx"] = onnx.__version__

    def step(self) -> None:
        self.sess.train_step(self.feeds, fetch=False)

    def step_loss(self) -> float:
        # The loss only, as the peers compute it: fetching every output would
        # also run a BatchNorm model's inference-mode forward pass (W5: 75 ms).
        return float(self.sess.train_step(self.feeds, fetch=["loss"])["loss"])


class TorchTrainer:
    """torch eager: zero_grad, forward, loss, backward, optimizer step."""

    def __init__(self, workdir: Path, spec, params, batch, fused: bool, module=None) -> None:
        import torch
        import torch_models

        torch.set_num_threads(THREADS)
        self.torch = torch
        self.model = module if module is not None else torch_models.build(spec["key"], params)
        self.model.train()
        self.xs = [torch.from_numpy(batch[n]) for n in spec.get("inputs", ["X"])]
        self.y = torch.from_numpy(batch[spec["target"]])
        if spec["loss"] == "cross_entropy":
            self.loss_fn = torch.nn.CrossEntropyLoss()
        else:
            self.loss_fn = torch.nn.MSELoss()
        kwargs = {"fused": True} if fused else {}
        if spec["optimizer"] == "adamw":
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=spec["lr"],
                                         weight_decay=spec["weight_decay"], **kwargs)
        else:
            self.opt = torch.optim.SGD(self.model.parameters(), lr=spec["lr"],
                                       momentum=spec.get("momentum", 0.0), **kwargs)
        group = self.opt.param_groups[0]
        impl = "fused" if group.get("fused") else ("foreach" if group.get("foreach") else "for-loop")
        self.info = {"framework": "torch-fused" if fused else "torch", "torch": torch.__version__,
                     "optimizer_impl": impl, "threads": torch.get_num_threads()}

    def spec_adamw_losses(self, spec, params, batch, steps: int) -> list[float]:
        """Losses of ``steps`` steps from the same weights with the update onnxtrain's
        model asks for (the spec's Adam op, T from 1, norm_coefficient_post = lr*wd),
        written in torch: isolates the epsilon/decay convention from everything else."""
        import torch
        import torch_models

        model = torch_models.build(spec["key"], params)
        lr, wd, b1, b2, eps = spec["lr"], spec["weight_decay"], 0.9, 0.999, 1e-8
        ps = list(model.parameters())
        v = [torch.zeros_like(p) for p in ps]
        h = [torch.zeros_like(p) for p in ps]
        losses = []
        for t in range(1, steps + 1):
            for p in ps:
                p.grad = None
            loss = self.loss_fn(model(*self.xs), self.y)
            loss.backward()
            losses.append(float(loss.item()))
            r = lr * (1 - b2 ** t) ** 0.5 / (1 - b1 ** t)
            with torch.no_grad():
                for p, vi, hi in zip(ps, v, h):
                    g = p.grad
                    vi.mul_(b1).add_(g, alpha=1 - b1)
                    hi.mul_(b2).addcmul_(g, g, value=1 - b2)
                    p.sub_(r * vi / (hi.sqrt() + eps)).mul_(1 - lr * wd)
        return losses

    def float64_losses(self, spec, params, steps: int) -> list[float]:
        """Losses of ``steps`` steps of the same training in float64 (module, batch and
        optimizer converted): the exact answer float32 runs approximate.  Where float32
        rounding is amplified (W5: BatchNorm, ReLU masks flipping near zero, SGD with
        momentum), two float32 implementations of the same training drift apart by as
        much as each drifts from this one."""
        import torch
        import torch_models

        model = torch_models.build(spec["key"], params).double()
        model.train()
        xs = [x.double() if x.is_floating_point() else x for x in self.xs]
        y = self.y.double() if self.y.is_floating_point() else self.y
        if spec["optimizer"] == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=spec["weight_decay"])
        else:
            opt = torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=spec.get("momentum", 0.0))
        losses = []
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = self.loss_fn(model(*xs), y)
            loss.backward()
            opt.step()
            losses.append(float(loss.item()))
        return losses

    def _forward_backward(self):
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(*self.xs), self.y)
        loss.backward()
        self.opt.step()
        return loss

    def step(self) -> None:
        self._forward_backward()

    def step_loss(self) -> float:
        return float(self._forward_backward().item())


class Onnx2TorchTrainer(TorchTrainer):
    """The route users have besides onnxtrain: convert the workload's inference
    model (``model.onnx``, the same weights) with onnx2torch, then train the
    converted module in torch eager with the torch peer's loss and optimizer."""

    def __init__(self, workdir: Path, spec, params, batch) -> None:
        from importlib.metadata import version

        import onnx
        import torch
        from onnx2torch import convert

        model = onnx.load(str(workdir / "model.onnx"))
        outputs = [o.name for o in model.graph.output]
        index = outputs.index(spec["output"]) if spec.get("output") in outputs else 0
        converted = convert(model)

        class Picked(torch.nn.Module):
            """The converted module's output the loss reads."""

            def __init__(self, inner) -> None:
                super().__init__()
                self.inner = inner

            def forward(self, *xs):
                out = self.inner(*xs)
                return out[index] if isinstance(out, (tuple, list)) else out

        super().__init__(workdir, spec, params, batch, fused=False, module=Picked(converted))
        self.info = dict(self.info, framework="onnx2torch", onnx2torch=version("onnx2torch"))


def ort_session_options(ort, profile_prefix: str | None = None):
    so = ort.SessionOptions()
    so.intra_op_num_threads = THREADS
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", ORT_SPIN)
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    return so


class OrtTrainingTrainer:
    """onnxruntime.training.api: Module forward+backward, Optimizer.step, lazy_reset_grad."""

    def __init__(self, workdir: Path, spec, params, batch, profile_prefix: str | None = None) -> None:
        import onnxruntime as ort
        from onnxruntime.training.api import CheckpointState, Module, Optimizer

        art = workdir / "ort"
        self.state = CheckpointState.load_checkpoint(str(art / "checkpoint"))
        so = ort_session_options(ort, profile_prefix and profile_prefix + "_train")
        self.module = Module(str(art / "training_model.onnx"), self.state, None, "cpu", so)
        if profile_prefix:
            # The optimizer session takes the module's options: give it its own file.
            so.profile_file_prefix = profile_prefix + "_optimizer"
        self.opt = Optimizer(str(art / "optimizer_model.onnx"), self.module)
        self.opt.set_learning_rate(spec["lr"])
        self.module.train()
        names = self.module.input_names()
        aliases = {"labels": spec["target"], "target": spec["target"]}
        self.inputs = [batch[n] if n in batch else batch[aliases[n]] for n in names]
        self.info = {"framework": "ort-training", "onnxruntime": ort.__version__,
                     "input_names": names}
        import onnx

        self.info["onnx"] = onnx.__version__

    def step_loss(self) -> float:
        loss = self.module(*self.inputs)
        self.opt.step()
        self.module.lazy_reset_grad()
        return float(loss)

    def step(self) -> None:
        self.module(*self.inputs)
        self.opt.step()
        self.module.lazy_reset_grad()


def import_framework(framework: str) -> None:
    """Import the framework's modules up front: imports are not part of time-to-first-step."""
    if framework == "onnxtrain":
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
        import training_model  # noqa: F401  (the benchmark's own modules, as the peers' are)
        import workloads  # noqa: F401

        import onnxtrain  # noqa: F401
        import onnxtrain.build  # noqa: F401
        import onnxtrain.runtime.executor  # noqa: F401
    elif framework in ("torch", "torch-fused"):
        import torch  # noqa: F401
        import torch._dynamo  # noqa: F401  (torch.optim imports it lazily on first use)
        import torch.optim  # noqa: F401
    elif framework == "ort-training":
        import onnxruntime.training.api  # noqa: F401
    elif framework == "onnx2torch":
        import types

        # torchvision's registry wheel is a CUDA build: its compiled operator
        # registrations cannot load here, and onnx2torch needs only its Python parts.
        sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("stub"))
        import onnx2torch  # noqa: F401
        import torch.optim  # noqa: F401


#: The torch peers' weights as a PyTorch user keeps them: a ``torch.save``d state dict.
TORCH_WEIGHTS = "params.pt"


def save_torch_weights(workdir: Path, params: dict) -> None:
    """``params`` as ``TORCH_WEIGHTS`` in ``workdir``, once (atomically)."""
    import torch

    path = workdir / TORCH_WEIGHTS
    if path.exists():
        return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.save({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in params.items()}, tmp)
    os.replace(tmp, path)


def read_torch_weights(workdir: Path) -> dict:
    """The torch peers' weights, read from their file (inside the clock, as
    onnxtrain's ``onnx.load`` of the model is): numpy views of the tensors."""
    import torch

    return {k: v.numpy() for k, v in torch.load(workdir / TORCH_WEIGHTS, weights_only=True).items()}


def make_trainer(framework: str, workdir: Path, spec, params, batch):
    if framework == "onnxtrain":
        return OnnxtrainTrainer(workdir, spec, params, batch)
    if framework == "torch":
        return TorchTrainer(workdir, spec, read_torch_weights(workdir), batch, fused=False)
    if framework == "torch-fused":
        return TorchTrainer(workdir, spec, read_torch_weights(workdir), batch, fused=True)
    if framework == "ort-training":
        return OrtTrainingTrainer(workdir, spec, params, batch)
    if framework == "onnx2torch":
        return Onnx2TorchTrainer(workdir, spec, params, batch)
    raise SystemExit(f"unknown framework {framework!r}")


def serve_trainer(framework: str, workdir: Path, check_steps: int) -> None:
    chan = Channel()
    spec, params, batch = load_workdir(workdir)
    import_framework(framework)
    if framework in ("torch", "torch-fused") and spec["key"] in ("W5", "W6"):
        import torch_models  # torchvision / transformers: imports, not construction

        torch_models.import_libraries(spec["key"])
    if framework in ("torch", "torch-fused"):
        save_torch_weights(workdir, params)
    rss_imported = rss_kb()
    t_start = time.perf_counter()
    trainer = make_trainer(framework, workdir, spec, params, batch)
    t_built = time.perf_counter()
    losses = [trainer.step_loss()]
    t_first = time.perf_counter()
    losses += [trainer.step_loss() for _ in range(check_steps - 1)]
    info = dict(trainer.info, python=sys.version.split()[0], numpy=np.__version__)
    extra = {}
    if framework == "torch" and spec["optimizer"] == "adamw":
        extra["spec_adamw_losses"] = trainer.spec_adamw_losses(spec, params, batch, check_steps)
    if framework == "torch" and spec.get("float64_reference"):
        extra["float64_losses"] = trainer.float64_losses(spec, params, check_steps)
    chan.send({
        "ready": True,
        "import_ms": (t_start - _T0) * 1e3,
        "build_ms": (t_built - t_start) * 1e3,
        "first_step_ms": (t_first - t_built) * 1e3,
        "losses": losses,
        "rss_after_import_kb": rss_imported,
        "info": info,
        **extra,
    })
    perf = time.perf_counter
    while True:
        msg = chan.receive()
        if msg.get("exit"):
            chan.send({"maxrss_kb": maxrss_kb(),
                       "ru_maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss})
            return
        n = int(msg["run"])
        times = []
        step = trainer.step
        for _ in range(n):
            t0 = perf()
            step()
            times.append(perf() - t0)
        chan.send({"times_ms": [t * 1e3 for t in times]})


# ----------------------------------------------------------------- side tasks
def ort_artifacts(workdir: Path) -> dict:
    """generate_artifacts from the inference model (AdamW with torch's eps/weight decay)."""
    import onnx
    from onnxruntime.training import artifacts, onnxblock

    spec, params, _ = load_workdir(workdir)
    t0 = time.perf_counter()
    model = onnx.load(str(workdir / "model.onnx"))
    _name_rnn_optional_inputs(model)
    loss = {"cross_entropy": artifacts.LossType.CrossEntropyLoss,
            "mse": artifacts.LossType.MSELoss}[spec["loss"]]
    if spec["optimizer"] == "adamw":
        optimizer = onnxblock.optim.AdamW(betas=(0.9, 0.999), eps=1e-8,
                                          weight_decay=spec["weight_decay"])
    else:
        optimizer = onnxblock.optim.SGD()
    out = workdir / "ort"
    out.mkdir(exist_ok=True)
    # SGD: ORT training 1.19's onnxblock.optim.SGD has no momentum (run.py marks a
    # momentum workload's ORT training run as not the same training).
    trainable = spec.get("trainable", list(params))
    artifacts.generate_artifacts(model, requires_grad=trainable, frozen_params=[], loss=loss,
                                 optimizer=optimizer, artifact_directory=str(out))
    return {"generate_ms": (time.perf_counter() - t0) * 1e3}


#: Inputs through ``sequence_lens``/``initial_h``/``initial_c`` (empty names: absent).
_RNN_INPUTS = {"LSTM": 7, "GRU": 6}


def _name_rnn_optional_inputs(model) -> None:
    """List an LSTM's or GRU's absent optional inputs as empty names (the same
    model): ORT training 1.19's LSTMGrad/GRUGrad take the forward node's inputs
    by position, and with ``sequence_lens``, ``initial_h``, ``initial_c`` left
    off the list, the stashed hidden states land on ``sequence_lens`` (int32)
    and generate_artifacts fails with a type error (W7)."""
    for node in model.graph.node:
        want = _RNN_INPUTS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        if want and len(node.input) < want:
            node.input.extend([""] * (want - len(node.input)))


def _stats_us(times_s) -> dict:
    arr = np.asarray(times_s) * 1e6
    return {"median_us": float(np.median(arr)), "p90_us": float(np.percentile(arr, 90)),
            "n": int(arr.size)}


def overhead(workdir: Path, steps: int, rounds: int) -> dict:
    """train_step against a bare InferenceSession.run and an IOBinding run of the same program."""
    import onnx
    import onnxruntime as ort
    from training_model import training_model
    from workloads import WORKLOADS

    import onnxtrain

    spec, params, batch = load_workdir(workdir)
    workload = WORKLOADS[spec["key"]]
    model, _ = training_model(onnx.load(str(workdir / "model.onnx")), workload,
                              use_builder=spec.get("builder", True))
    sess = onnxtrain.TrainingSession(model, session_options=onnxtrain_session_options())
    label = "training_info[0].algorithm"
    program = sess.programs()[label]
    bare = ort.InferenceSession(program.SerializeToString(), onnxtrain_session_options(),
                                providers=["CPUExecutionProvider"])
    state = dict(sess.state)
    feeds = {i.name: (batch[i.name] if i.name in batch else state[i.name]) for i in bare.get_inputs()}

    # IOBinding: every input an OrtValue bound once, every output into a preallocated OrtValue.
    binding = bare.io_binding()
    keep = []
    for name, arr in feeds.items():
        v = ort.OrtValue.ortvalue_from_numpy(np.array(arr, order="C"))  # 0-d stays 0-d
        keep.append(v)
        binding.bind_ortvalue_input(name, v)
    first = bare.run(None, feeds)
    for meta, arr in zip(bare.get_outputs(), first):
        v = ort.OrtValue.ortvalue_from_numpy(np.empty_like(arr))
        keep.append(v)
        binding.bind_ortvalue_output(meta.name, v)

    variants = {
        "onnxtrain train_step(fetch=False)": lambda: sess.train_step(batch, fetch=False),
        "onnxtrain train_step(fetch=True)": lambda: sess.train_step(batch),
        "InferenceSession.run (numpy in/out)": lambda: bare.run(None, feeds),
        "run_with_iobinding (OrtValues bound once)": lambda: bare.run_with_iobinding(binding),
    }
    times = {k: [] for k in variants}
    per_round = max(1, steps // rounds)
    perf = time.perf_counter
    for fn in variants.values():  # warm-up
        for _ in range(min(50, per_round)):
            fn()
    for r in range(rounds):
        keys = list(variants)
        keys = keys[r % len(keys):] + keys[: r % len(keys)]
        for k in keys:
            fn = variants[k]
            for _ in range(per_round):
                t0 = perf()
                fn()
                times[k].append(perf() - t0)
    # Where train_step's Python time goes: cProfile over a few hundred steps.
    import cProfile
    import pstats

    prof = cProfile.Profile()
    n_prof = max(200, per_round)
    prof.enable()
    for _ in range(n_prof):
        sess.train_step(batch, fetch=False)
    prof.disable()
    st = pstats.Stats(prof)
    rows = []
    for (file, line, func), (cc, nc, tt, ct, callers) in st.stats.items():
        rows.append({"function": f"{Path(file).name}:{line}({func})", "calls_per_step": nc / n_prof,
                     "tottime_us": tt / n_prof * 1e6, "cumtime_us": ct / n_prof * 1e6})
    rows.sort(key=lambda r: -r["tottime_us"])
    return {"variants": {k: _stats_us(v) for k, v in times.items()},
            "program_nodes": len(program.graph.node), "cprofile": rows[:15]}


def _aggregate_profile(path: str, skip_runs: int) -> dict:
    """Kernel time per step by op type and by node, from an onnxruntime profile.

    Each node's time is its median over the profiled runs (after ``skip_runs``),
    so a load spike in one run does not move the ranking; op totals are sums
    of node medians."""
    events = json.loads(Path(path).read_text())
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                  if e.get("cat") == "Session" and e.get("name") == "model_run")
    runs = runs[skip_runs:]
    if not runs:
        return {}
    starts = [a for a, _ in runs]
    per_node: dict[str, list[float]] = {}
    op_of: dict[str, str] = {}
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        if e["ts"] < starts[0] or e["ts"] > runs[-1][1]:
            continue
        node = e["name"][: -len("_kernel_time")]
        op_of[node] = e.get("args", {}).get("op_name", "?")
        per_node.setdefault(node, []).append(e["dur"])
    n = len(runs)
    node_us = {node: float(np.median(d + [0.0] * max(0, n - len(d)))) for node, d in per_node.items()}
    by_op: dict[str, float] = {}
    count: dict[str, int] = {}
    for node, us in node_us.items():
        by_op[op_of[node]] = by_op.get(op_of[node], 0.0) + us
        count[op_of[node]] = count.get(op_of[node], 0) + 1
    kernel_us = sum(node_us.values())
    ops = sorted(by_op.items(), key=lambda kv: -kv[1])
    nodes = sorted(node_us.items(), key=lambda kv: -kv[1])
    return {
        "runs": n,
        "run_us_median": float(statistics.median(b - a for a, b in runs)),
        "kernel_us_per_run": kernel_us,
        "nodes": len(node_us),
        "ops": [{"op": op, "us": us, "share": us / kernel_us if kernel_us else 0.0,
                 "count": count[op]} for op, us in ops],
        "top_nodes": [{"node": node, "op": op_of[node], "us": us} for node, us in nodes[:12]],
    }


def profile(workdir: Path, steps: int, warmup: int) -> dict:
    """Profile the onnxtrain algorithm program (run as train_step runs it: IOBinding)."""
    import onnx
    import onnxruntime as ort
    from training_model import training_model
    from workloads import WORKLOADS

    import onnxtrain
    import onnxtrain.kernels.fuse
    import onnxtrain.kernels.library

    spec, params, batch = load_workdir(workdir)
    workload = WORKLOADS[spec["key"]]
    model, _ = training_model(onnx.load(str(workdir / "model.onnx")), workload,
                              use_builder=spec.get("builder", True))
    sess = onnxtrain.TrainingSession(model, session_options=onnxtrain_session_options())
    # What onnxruntime runs: with fused optimizer kernels where they apply.
    program = sess.programs(executed=True)["training_info[0].algorithm"]
    so = onnxtrain_session_options()
    if any(n.domain == onnxtrain.kernels.fuse.KERNEL_DOMAIN for n in program.graph.node):
        so.register_custom_ops_library(onnxtrain.kernels.library.library())
    so.enable_profiling = True
    so.profile_file_prefix = str(workdir / "onnxtrain_profile")
    psess = ort.InferenceSession(program.SerializeToString(), so, providers=["CPUExecutionProvider"])
    state = dict(sess.state)
    binding = psess.io_binding()
    keep = []
    for i in psess.get_inputs():
        arr = batch[i.name] if i.name in batch else state[i.name]
        v = ort.OrtValue.ortvalue_from_numpy(np.array(arr, order="C"))  # 0-d stays 0-d
        keep.append(v)
        binding.bind_ortvalue_input(i.name, v)
    for o in psess.get_outputs():
        binding.bind_output(o.name, "cpu")
    for _ in range(warmup + steps):
        psess.run_with_iobinding(binding)
    path = psess.end_profiling()
    out = _aggregate_profile(path, warmup)
    out["optimized_graph_ops"] = _optimized_op_counts(program, so_factory=onnxtrain_session_options,
                                                      ort=ort, workdir=workdir)
    out["program_nodes"] = len(program.graph.node)
    return out


def _optimized_op_counts(program, so_factory, ort, workdir: Path) -> dict:
    """Op counts of the program after onnxruntime's graph optimizations."""
    import onnx

    so = so_factory()
    if any(n.domain == "ai.onnxtrain.kernels" for n in program.graph.node):
        import onnxtrain.kernels.library

        so.register_custom_ops_library(onnxtrain.kernels.library.library())
    path = workdir / "onnxtrain_optimized.onnx"
    so.optimized_model_filepath = str(path)
    ort.InferenceSession(program.SerializeToString(), so, providers=["CPUExecutionProvider"])
    counts: dict[str, int] = {}
    for n in onnx.load(str(path)).graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def ort_profile(workdir: Path, steps: int, warmup: int) -> dict:
    """Profile ONNX Runtime training's training session (forward+backward) for comparison."""
    spec, params, batch = load_workdir(workdir)
    prefix = str(workdir / "ort_profile")
    trainer = OrtTrainingTrainer(workdir, spec, params, batch, profile_prefix=prefix)
    for _ in range(warmup + steps):
        trainer.step()
    # The training api has no end_profiling: the sessions write their profiles when destroyed.
    trainer.inputs = None
    del trainer.opt
    del trainer.module
    del trainer.state
    del trainer
    import gc

    gc.collect()
    result = {}
    for part in ("train", "optimizer"):
        files = sorted(glob.glob(f"{prefix}_{part}*.json"), key=os.path.getmtime)
        if files:
            result[part] = _aggregate_profile(files[-1], warmup)
    return result


def ceiling(size: int, repeats: int) -> dict:
    """float32 matmul GFLOP/s on THREADS threads: numpy, onnxruntime MatMul, torch.mm."""
    flops = 2.0 * size ** 3
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    out: dict[str, float] = {}

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return flops / min(times) / 1e9

    out["numpy"] = best(lambda: a @ b)
    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper

        g = helper.make_graph([helper.make_node("MatMul", ["A", "B"], ["C"])], "mm",
                              [helper.make_tensor_value_info("A", TensorProto.FLOAT, [size, size]),
                               helper.make_tensor_value_info("B", TensorProto.FLOAT, [size, size])],
                              [helper.make_tensor_value_info("C", TensorProto.FLOAT, [size, size])])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        s = ort.InferenceSession(m.SerializeToString(), ort_session_options(ort),
                                 providers=["CPUExecutionProvider"])
        out["onnxruntime"] = best(lambda: s.run(None, {"A": a, "B": b}))
    except Exception as exc:  # report, don't die
        out["onnxruntime_error"] = str(exc)
    try:
        import torch

        torch.set_num_threads(THREADS)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        out["torch"] = best(lambda: torch.mm(ta, tb))
    except Exception as exc:
        out["torch_error"] = str(exc)
    out["size"] = size
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("task")
    ap.add_argument("args", nargs="*")
    ap.add_argument("--check-steps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--size", type=int, default=2048)
    a = ap.parse_args()
    if a.task == "train":
        serve_trainer(a.args[0], Path(a.args[1]), a.check_steps)
        return
    chan = Channel()
    if a.task == "ort-artifacts":
        result = ort_artifacts(Path(a.args[0]))
    elif a.task == "overhead":
        result = overhead(Path(a.args[0]), a.steps, a.rounds)
    elif a.task == "profile":
        result = profile(Path(a.args[0]), a.steps, a.warmup)
    elif a.task == "ort-profile":
        result = ort_profile(Path(a.args[0]), a.steps, a.warmup)
    elif a.task == "ceiling":
        result = ceiling(a.size, a.steps)
    else:
        raise SystemExit(f"unknown task {a.task!r}")
    result["maxrss_kb"] = maxrss_kb()
    chan.send(result)


if __name__ == "__main__":
    main()
