"""onnxtrain's training benchmark suite: onnxtrain against PyTorch eager and ONNX Runtime training.

    python benchmarks/run.py [--quick] [--workloads W1,W3] [--steps N]

Every framework trains the same model from the same initial weights on the
same batch with the same optimizer (``workloads.py``), each in its own child
process (``worker.py``) with 2 threads.  The children are driven in
interleaved rounds (round r runs a slice of timed steps of every framework,
the order rotating), so a change of machine load hits all of them alike.

Reported per workload and framework: median and p90 ms per training step
after warm-up, the ratio to the best peer, time to first step (construction +
first step; the median over ``--first-step-samples`` fresh children, 5 by
default), peak RSS of the child, GFLOP/s (analytic FLOPs per step) and its
share of the machine's measured float32 matmul ceiling.  Also: the
equal-work check (losses of the first steps across frameworks), onnxtrain's
per-step overhead on W3 against bare onnxruntime runs of the same program, and
onnxruntime profiles (top ops) of onnxtrain's program next to ONNX Runtime
training's.  Results are printed and, for full runs, written to
``docs/benchmarks.md``.

The ONNX Runtime training peer lives in ``benchmarks/.venv-ort-training``,
created by ``benchmarks/setup_ort_training.sh``, and the onnx2torch peer (the
inference model converted to PyTorch and trained there) in
``benchmarks/.venv-onnx2torch``, from ``benchmarks/setup_onnx2torch.sh``; both
are made automatically if missing (``--no-setup`` skips them and their peers).
W5 and W6 are PyTorch modules exported to ONNX by ``export_models.py`` in the
ORT training environment (which holds torchvision and transformers for it and
for their torch peer); the exports are cached in ``benchmarks/.cache/``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from workloads import ALIASES, WORKLOADS  # noqa: E402

ORT_VENV = HERE / ".venv-ort-training"
ORT_PYTHON = ORT_VENV / "bin" / "python"
ONNX2TORCH_PYTHON = HERE / ".venv-onnx2torch" / "bin" / "python"
#: PyTorch + peft + onnxruntime-genai, for the LLM workloads (``llm.py``, ``setup_peft.sh``).
PEFT_PYTHON = HERE / ".venv-peft" / "bin" / "python"
PEFT_CHECK = "import torch, transformers, peft, onnxscript, onnxruntime_genai, onnxtrain"
#: LLM fine-tuning workloads, run by ``llm.py`` (fresh processes, PyTorch + peft as the peer).
LLM_KEYS = ["L1", "L2", "L3", "L3r", "L4"]
#: Peers that train a converted model; their losses must match torch's to count.
CONVERTERS = ("onnx2torch",)
#: Workloads exported from PyTorch modules (``export_models.py``, in the ORT training environment).
EXPORTED = {"W5", "W6"}
#: Relative difference of the first losses above which a converted model is not equal work.
UNEQUAL_LOSSES = 1e-4
FRAMEWORKS = ["onnxtrain", "torch", "torch-fused", "ort-training", "onnx2torch"]
THREADS = 2
CHECK_STEPS = 5
#: "passive" (default): idle worker threads block (OMP_WAIT_POLICY=PASSIVE for torch,
#: session.intra_op.allow_spinning=0 for onnxruntime); "spin": each framework's default.
WAIT = {"mode": "passive"}
#: onnxtrain's startup cache for the children (set by main: empty at the start of a run).
CACHE_DIR = {"path": None}


def log(msg: str) -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------ child processes
def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["BENCH_THREADS"] = str(THREADS)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "ONNXTRAIN_THREADS"):
        env[var] = str(THREADS)
    if WAIT["mode"] == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
        env["BENCH_ORT_SPIN"] = "0"
    else:
        env.pop("OMP_WAIT_POLICY", None)
        env["BENCH_ORT_SPIN"] = "1"
    # benchmarks/ for the workers; the root so that every interpreter (the peft
    # environment's included) measures this checkout's onnxtrain.
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent)] + [p for p in [env.get("PYTHONPATH")] if p])
    # A startup cache of the run's own: each workload's first onnxtrain child starts cold.
    if CACHE_DIR["path"]:
        env["ONNXTRAIN_CACHE_DIR"] = CACHE_DIR["path"]
    return env


def python_for(framework: str) -> str | None:
    """The interpreter that runs a framework's child (None: not available)."""
    if framework == "ort-training":
        return str(ORT_PYTHON) if ORT_PYTHON.exists() else None
    if framework == "onnx2torch":  # benchmarks/setup_onnx2torch.sh makes it
        return str(ONNX2TORCH_PYTHON) if ONNX2TORCH_PYTHON.exists() else None
    if framework in ("torch", "torch-fused"):
        if importlib.util.find_spec("torch") is not None:
            return sys.executable
        return str(ORT_PYTHON) if ORT_PYTHON.exists() else None
    return sys.executable


class Worker:
    """A trainer child: JSON lines over its stdin/stdout, stderr into a log file."""

    def __init__(self, framework: str, workdir: Path, logdir: Path, env: dict[str, str] | None = None) -> None:
        self.framework = framework
        self.log_path = logdir / f"{workdir.name}-{framework}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [python_for(framework), str(HERE / "worker.py"), "train", framework, str(workdir),
             "--check-steps", str(CHECK_STEPS)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env=env or child_env(), cwd=str(workdir),
        )

    def receive(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self._log.flush()
            tail = self.log_path.read_text()[-2000:]
            raise RuntimeError(f"{self.framework} child exited ({self.proc.returncode}):\n{tail}")
        return json.loads(line)

    def ask(self, msg: dict) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self.receive()

    def close(self) -> dict:
        try:
            out = self.ask({"exit": True})
        finally:
            self.proc.wait(timeout=60)
            self._log.close()
        return out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def error_summary(error: str | None, width: int = 140) -> str:
    """A failed run in one table cell: who failed, and the exception's last
    line (the reason), pipes escaped."""
    lines = [ln.strip() for ln in (error or "no data").splitlines() if ln.strip()]
    text = lines[0] if len(lines) == 1 else f"{lines[0].rstrip(':')}: {lines[-1]}"
    text = text if len(text) <= width else text[: width - 3] + "..."
    return text.replace("|", "\\|")


def side_task(python: str, args: list[str], logdir: Path, name: str, timeout: float = 900) -> dict:
    """Run a one-shot worker task in a fresh child; its one JSON line is the result."""
    log_path = logdir / f"{name}.log"
    with open(log_path, "w") as logf:
        proc = subprocess.run([python, str(HERE / "worker.py")] + args, stdout=subprocess.PIPE,
                              stderr=logf, text=True, env=child_env(), timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        tail = log_path.read_text()[-2000:]
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{tail}")
    return json.loads(lines[-1])


# ------------------------------------------------------------------ machine
def machine_info() -> dict:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = int(line.split()[1]) / 2**20
    except OSError:
        pass
    versions = {"python": platform.python_version(), "numpy": np.__version__}
    from importlib.metadata import PackageNotFoundError, version

    for mod in ("onnx", "onnxruntime", "onnxtrain", "torch"):
        try:  # metadata only: importing torch here would bloat every child's fork
            versions[mod] = version(mod)
        except PackageNotFoundError:  # reported by its child instead
            pass
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": round(mem_gib, 1) if mem_gib else None,
        "os": platform.platform(),
        "versions": versions,
    }


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "load average: %.2f, %.2f, %.2f" % os.getloadavg()


# ------------------------------------------------------------------ workloads
def prepare(key: str, root: Path, use_builder: bool) -> Path:
    """Write one workload's shared inputs: inference model, weights, batch, spec."""
    import onnx

    w = WORKLOADS[key]
    model, params, batch = w.build()
    d = root / key
    d.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(d / "model.onnx"))
    np.savez(d / "params.npz", **params)
    np.savez(d / "batch.npz", **batch)
    from training_model import trainable

    spec = {"key": key, "loss": w.loss, "optimizer": w.optimizer, "lr": w.lr,
            "weight_decay": w.weight_decay, "momentum": w.momentum, "output": w.output,
            "target": w.target, "builder": use_builder,
            "inputs": [i.name for i in model.graph.input],
            # BatchNormalization statistics are initializers too, but no parameters.
            "trainable": trainable(model),
            "float64_reference": bool(w.extra.get("float64_reference"))}
    (d / "spec.json").write_text(json.dumps(spec))
    return d


@dataclass
class Result:
    framework: str
    ready: dict = field(default_factory=dict)
    times_ms: list = field(default_factory=list)
    #: Median of each round's steps (for ratios paired round by round).
    round_medians: list = field(default_factory=list)
    maxrss_kb: int | None = None
    artifacts_ms: float = 0.0
    error: str | None = None
    #: Why this run is not the same training as the others (then it is no peer).
    unequal: str | None = None
    #: Time to first step of every fresh child (the timed one first), in ms.
    ttfs_samples: list = field(default_factory=list)

    @property
    def ttfs_warm_samples(self) -> list:
        """The samples with a warm startup cache: onnxtrain's after its first child."""
        cold = self.framework == "onnxtrain" and len(self.ttfs_samples) > 1
        return self.ttfs_samples[1:] if cold else self.ttfs_samples

    @property
    def ttfs_cold_ms(self) -> float | None:
        """onnxtrain's first child of the workload: an empty startup cache."""
        return self.ttfs_samples[0] if self.framework == "onnxtrain" and self.ttfs_samples else None

    @property
    def ttfs_ms(self) -> float:
        """Time to first step: the median over the fresh children (``--first-step-samples``);
        for onnxtrain over those that found its startup cache warm (all but the first)."""
        if self.ttfs_samples:
            return float(np.median(self.ttfs_warm_samples))
        return self.artifacts_ms + self.ready.get("build_ms", 0.0) + self.ready.get("first_step_ms", 0.0)

    def stats(self) -> dict:
        t = np.asarray(self.times_ms)
        return {"median": float(np.median(t)), "p90": float(np.percentile(t, 90)),
                "mean": float(t.mean()), "min": float(t.min()), "n": int(t.size)}


def first_step_sample(fw: str, key: str, workdir: Path, logdir: Path) -> tuple[float, Worker | None, dict]:
    """One fresh child of ``fw`` up to its first step: (time to first step in ms,
    the worker, still running, its ready message).  For ORT training the
    artifacts are made again first, in a child of their own, and count."""
    artifacts = 0.0
    if fw == "ort-training":
        artifacts = side_task(str(ORT_PYTHON), ["ort-artifacts", str(workdir)], logdir,
                              f"{key}-ort-artifacts")["generate_ms"]
    w = Worker(fw, workdir, logdir)
    try:
        ready = w.receive()
    except Exception:
        w.kill()
        raise
    ready["artifacts_ms"] = artifacts
    return artifacts + ready["build_ms"] + ready["first_step_ms"], w, ready


def bench_workload(key: str, workdir: Path, frameworks: list[str], steps: int, rounds: int,
                   warmup: int, logdir: Path, first_samples: int = 1) -> dict:
    results = {fw: Result(fw) for fw in frameworks}
    workers: dict[str, Worker] = {}
    # Start the children one at a time, so construction and first step run alone.
    for fw in frameworks:
        try:
            ttfs, workers[fw], results[fw].ready = first_step_sample(fw, key, workdir, logdir)
            results[fw].artifacts_ms = results[fw].ready["artifacts_ms"]
            results[fw].ttfs_samples.append(ttfs)
        except Exception as exc:
            results[fw].error = str(exc)
        status = "error" if results[fw].error else (
            f"ready: build {results[fw].ready['build_ms']:.0f} ms, "
            f"first step {results[fw].ready['first_step_ms']:.1f} ms")
        log(f"  {fw:13s} {status}")
    live = [fw for fw in frameworks if fw in workers]
    try:
        for fw in live:
            workers[fw].ask({"run": warmup})
        per_round = max(1, steps // rounds)
        for r in range(rounds):
            order = live[r % len(live):] + live[: r % len(live)] if live else []
            for fw in order:
                times = workers[fw].ask({"run": per_round})["times_ms"]
                results[fw].times_ms += times
                results[fw].round_medians.append(float(np.median(times)))
    finally:
        for fw, w in workers.items():
            try:
                results[fw].maxrss_kb = w.close()["maxrss_kb"]
            except Exception as exc:
                results[fw].error = results[fw].error or f"close: {exc}"
                w.kill()
    # More samples of the time to first step, which varies by ±10 ms from one
    # process to the next: fresh children, one at a time, in a rotating order.
    live = [fw for fw in frameworks if not results[fw].error]
    for r in range(1, first_samples):
        for fw in live[r % len(live):] + live[: r % len(live)]:
            try:
                ttfs, w, _ = first_step_sample(fw, key, workdir, logdir)
                w.close()
                results[fw].ttfs_samples.append(ttfs)
            except Exception as exc:  # the timed child's sample stands
                log(f"  {fw:13s} first-step sample {r + 1} failed: {str(exc).splitlines()[0][:80]}")
    if first_samples > 1:
        log("  first step (median of fresh children): " + ", ".join(
            f"{fw} {results[fw].ttfs_ms:.1f} ms" for fw in live))
    # A converted model that does not train like the original (onnx2torch where
    # its conversion changes the model) is reported, but it is not a peer.
    eq = equal_work(results)
    diffs = eq.get("max_rel_diff", {})
    for fw in CONVERTERS:
        if fw in results and diffs.get(fw, 0.0) > unequal_threshold(eq):
            results[fw].unequal = f"not the same training: first losses differ from torch's by {diffs[fw]:.1e}"
    spec = json.loads((workdir / "spec.json").read_text())
    if "ort-training" in results and spec.get("optimizer") == "sgd" and spec.get("momentum"):
        results["ort-training"].unequal = ("not the same training: SGD without momentum "
                                           "(onnxruntime-training 1.19 has no momentum SGD)")
    return {"results": results, "loadavg": os.getloadavg()}


def unequal_threshold(eq: dict) -> float:
    """Relative difference of the first losses from torch's above which a converted model
    is not the same training: UNEQUAL_LOSSES, or where torch's float32 run itself drifts
    from its float64 run by more (W5), twice that drift: float32 rounding alone moves two
    implementations of the same training that far apart."""
    drift = eq.get("max_rel_diff_float64", {}).get("torch")
    return max(UNEQUAL_LOSSES, 2 * drift) if drift is not None else UNEQUAL_LOSSES


def _max_rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12)))


def equal_work(results: dict[str, Result]) -> dict:
    """Max relative difference of the first losses against torch's (else the first framework's).

    For AdamW also against torch running the spec-convention update (``spec_adamw_losses``),
    which separates "same work" from "same epsilon convention"."""
    have = {fw: r.ready["losses"] for fw, r in results.items() if r.ready.get("losses")}
    if not have:
        return {}
    ref_fw = "torch" if "torch" in have else next(iter(have))
    out = {"reference": ref_fw, "losses": have,
           "max_rel_diff": {fw: _max_rel(l, have[ref_fw]) for fw, l in have.items()}}
    spec_ref = results.get("torch", Result("torch")).ready.get("spec_adamw_losses")
    if spec_ref:
        out["spec_reference"] = spec_ref
        out["max_rel_diff_spec"] = {fw: _max_rel(l, spec_ref) for fw, l in have.items()}
    f64 = results.get("torch", Result("torch")).ready.get("float64_losses")
    if f64:
        out["float64_reference"] = f64
        out["max_rel_diff_float64"] = {fw: _max_rel(l, f64) for fw, l in have.items()}
    return out


# ------------------------------------------------------------------ reporting
def fmt_ms(ms: float) -> str:
    if ms < 1:
        return f"{ms:.3f}"
    if ms < 10:
        return f"{ms:.2f}"
    return f"{ms:.1f}"


def paired_ratio(r: Result, best: Result) -> float | None:
    """Median over rounds of (this round's median / the best peer's in the same round).

    The frameworks of one round run seconds apart, so a change of machine load
    between rounds cancels out of this ratio."""
    pairs = [a / b for a, b in zip(r.round_medians, best.round_medians) if b > 0]
    return float(np.median(pairs)) if pairs else None


def main_table(all_results: dict, ceiling_gflops: float | None) -> list[str]:
    head = ("| workload | framework | median ms | p90 ms | × best peer | × best peer, paired | "
            "first step ms | peak RSS MB | GFLOP/s | % ceiling |")
    rows = [head, "|" + "---|" * 10]
    for key, wres in all_results.items():
        res: dict[str, Result] = wres["results"]
        w = WORKLOADS[key]
        ok = {fw: r for fw, r in res.items() if r.times_ms}
        peers = {fw: r for fw, r in ok.items() if fw != "onnxtrain" and not r.unequal}
        best_fw = min(peers, key=lambda fw: peers[fw].stats()["median"]) if peers else None
        best_peer = peers[best_fw].stats()["median"] if best_fw else None
        for fw, r in res.items():
            if not r.times_ms:
                rows.append(f"| {key} | {fw} | error: {error_summary(r.error)} "
                            "| | | | | | | |")
                continue
            s = r.stats()
            ratio = f"{s['median'] / best_peer:.2f}" if best_peer else "-"
            paired = paired_ratio(r, peers[best_fw]) if best_fw else None
            paired_txt = f"{paired:.2f}" if paired is not None else "-"
            gflops = w.flops_per_step / (s["median"] * 1e-3) / 1e9
            pct = f"{100 * gflops / ceiling_gflops:.1f}" if ceiling_gflops else "-"
            rss = f"{r.maxrss_kb / 1024:.0f}" if r.maxrss_kb else "-"
            gf = f"{gflops:.2f}" if gflops < 10 else f"{gflops:.1f}"
            if gflops < 0.01:
                gf = f"{gflops:.4f}"
            name = f"**{fw}**" if fw == "onnxtrain" else fw
            if r.unequal:
                name = f"{fw} ({r.unequal}; no peer)"
            rows.append(f"| {key} | {name} | {fmt_ms(s['median'])} | {fmt_ms(s['p90'])} | {ratio} | "
                        f"{paired_txt} | {fmt_ms(r.ttfs_ms)} | {rss} | {gf} | {pct} |")
    return rows


def startup_table(all_results: dict) -> list[str]:
    rows = ["| workload | framework | import ms | build ms | first step ms | artifacts ms | "
            "time to first step ms: median (range, children) | cold startup cache ms | "
            "RSS after import MB | peak RSS MB |",
            "|" + "---|" * 10]
    for key, wres in all_results.items():
        for fw, r in wres["results"].items():
            if not r.ready:
                continue
            rd = r.ready
            art = f"{r.artifacts_ms:.0f}" if r.artifacts_ms else "-"
            rss = f"{r.maxrss_kb / 1024:.0f}" if r.maxrss_kb else "-"
            warm = r.ttfs_warm_samples or [r.ttfs_ms]
            spread = f"{r.ttfs_ms:.1f} ({min(warm):.0f}–{max(warm):.0f}, {len(warm)})"
            cold = f"{r.ttfs_cold_ms:.1f}" if r.ttfs_cold_ms is not None else "-"
            rows.append(f"| {key} | {fw} | {rd['import_ms']:.0f} | {rd['build_ms']:.0f} | "
                        f"{rd['first_step_ms']:.1f} | {art} | {spread} | {cold} | "
                        f"{rd['rss_after_import_kb'] / 1024:.0f} | {rss} |")
    return rows


def equal_work_table(all_results: dict) -> list[str]:
    rows = [f"| workload | framework | vs torch | vs torch, spec-convention AdamW | "
            f"vs torch in float64 | first {CHECK_STEPS} losses |", "|---|---|---|---|---|---|"]
    for key, wres in all_results.items():
        eq = wres.get("equal_work") or {}
        spec = eq.get("max_rel_diff_spec", {})
        f64 = eq.get("max_rel_diff_float64", {})
        for fw, diff in eq.get("max_rel_diff", {}).items():
            losses = ", ".join(f"{v:.6f}" for v in eq["losses"][fw])
            sp = f"{spec[fw]:.1e}" if fw in spec else "-"
            f6 = f"{f64[fw]:.1e}" if fw in f64 else "-"
            rows.append(f"| {key} | {fw} | {diff:.1e} | {sp} | {f6} | {losses} |")
        if eq.get("spec_reference"):
            losses = ", ".join(f"{v:.6f}" for v in eq["spec_reference"])
            rows.append(f"| {key} | (torch, spec-convention AdamW) | | 0 | | {losses} |")
        if eq.get("float64_reference"):
            losses = ", ".join(f"{v:.6f}" for v in eq["float64_reference"])
            rows.append(f"| {key} | (torch in float64) | | | 0 | {losses} |")
    return rows


def overhead_table(ov: dict) -> list[str]:
    rows = ["| W3 step, same program | median µs | p90 µs | steps |", "|---|---|---|---|"]
    for name, s in ov["variants"].items():
        rows.append(f"| {name} | {s['median_us']:.1f} | {s['p90_us']:.1f} | {s['n']} |")
    if ov.get("cprofile"):
        rows += ["", "cProfile of `train_step(fetch=False)` on W3 (per step; cProfile inflates "
                 "the absolute times, the ranking is what counts):", "",
                 "| function | calls/step | own µs/step | cumulative µs/step |", "|---|---|---|---|"]
        for r in ov["cprofile"][:12]:
            rows.append(f"| `{r['function']}` | {r['calls_per_step']:.0f} | {r['tottime_us']:.1f} | "
                        f"{r['cumtime_us']:.1f} |")
    return rows


def profile_section(key: str, prof: dict, ort_prof: dict | None, top: int = 10) -> list[str]:
    lines = []
    if not prof or "ops" not in prof:
        return [f"{key}: no profile ({prof.get('error', 'empty') if prof else 'not run'})"]
    lines.append(
        f"**{key}** — onnxtrain program: {prof['program_nodes']} nodes before, {prof['nodes']} kernels "
        f"after onnxruntime's optimizations; run {prof['run_us_median'] / 1e3:.2f} ms median, "
        f"kernels {prof['kernel_us_per_run'] / 1e3:.2f} ms per run ({prof['runs']} profiled runs).")
    ort_ops = {}
    ort_train = (ort_prof or {}).get("train") or {}
    ort_opt = (ort_prof or {}).get("optimizer") or {}
    for part in (ort_train, ort_opt):
        for o in part.get("ops", []):
            cur = ort_ops.setdefault(o["op"], {"us": 0.0, "count": 0})
            cur["us"] += o["us"]
            cur["count"] += o["count"]
    if ort_train:
        total = ort_train.get("kernel_us_per_run", 0) + ort_opt.get("kernel_us_per_run", 0)
        lines.append(
            f"ONNX Runtime training for comparison: {ort_train.get('nodes', 0)} + "
            f"{ort_opt.get('nodes', 0)} kernels (train + optimizer session), kernels "
            f"{total / 1e3:.2f} ms per step.")
    lines.append("")
    lines.append("| op | onnxtrain µs/step | share | kernels | ORT training µs/step | kernels |")
    lines.append("|---|---|---|---|---|---|")
    for o in prof["ops"][:top]:
        peer = ort_ops.get(o["op"])
        peer_txt = f"{peer['us']:.0f} | {peer['count']}" if peer else "- | -"
        lines.append(f"| {o['op']} | {o['us']:.0f} | {100 * o['share']:.1f}% | {o['count']} | {peer_txt} |")
    lines.append("")
    lines.append("Top onnxtrain nodes: " + "; ".join(
        f"`{n['node']}` ({n['op']}) {n['us']:.0f} µs" for n in prof["top_nodes"][:6]))
    if ort_ops:
        mine = {o["op"] for o in prof["ops"]}
        only_peer = sorted(((v["us"], k) for k, v in ort_ops.items() if k not in mine), reverse=True)
        if only_peer:
            lines.append("")
            lines.append("Ops only ORT training uses (its fused training kernels): " + ", ".join(
                f"{k} {us:.0f} µs" for us, k in only_peer[:8]))
    return lines


def write_doc(path: Path, report: dict, command: str) -> None:
    m = report["machine"]
    v = m["versions"]
    ceil = report.get("ceiling", {})
    out = [
        "# Benchmarks",
        "",
        "Training-step time of onnxtrain against PyTorch eager and ONNX Runtime training on the "
        "same models, weights, batches and optimizers. Produced by:",
        "",
        "```bash",
        command,
        "```",
        "",
        "(`python benchmarks/run.py --quick` for a short run; `--workloads W1,W3`, `--steps N`, "
        "`--frameworks onnxtrain,torch`; `bash benchmarks/setup_ort_training.sh` creates the ONNX "
        "Runtime training environment, and run.py calls it when it is missing.)",
        "",
        "## Machine and run",
        "",
        f"- CPU: {m['cpu']}, {m['logical_cpus']} logical CPUs ({m['usable_cpus']} usable), "
        f"{m['memory_gib']} GiB RAM; {m['os']}",
        f"- Threads: {THREADS} for every framework (onnxruntime intra-op threads, "
        "torch.set_num_threads, OMP/OpenBLAS/MKL).",
        f"- Versions: Python {v.get('python')}, onnxtrain {v.get('onnxtrain')}, onnxruntime "
        f"{v.get('onnxruntime')}, onnx {v.get('onnx')}, numpy {v.get('numpy')}, torch "
        f"{report.get('torch_version', v.get('torch', '?'))}; ONNX Runtime training "
        f"{report.get('ort_training_versions', '?')}.",
        f"- Idle threads: {report['wait']} (`--wait`): " + (
            "OMP_WAIT_POLICY=PASSIVE for torch and `session.intra_op.allow_spinning=0` for "
            "onnxruntime (onnxtrain, ORT training). On this shared, oversubscribed machine "
            "spin-waiting OpenMP threads made torch 5-10x slower, so every framework runs with "
            "blocking waits." if report["wait"] == "passive" else "each framework's default (spinning).")
        + "",
        f"- Mode: {'quick' if report['quick'] else 'full'}; {report['rounds']} interleaved rounds; "
        f"timed steps per framework: {report['steps']}; warm-up steps: {report['warmup']}.",
        f"- Load before: `{report['uptime_before']}`",
        f"- Load after: `{report['uptime_after']}`",
        "- Load average (1 min) when each workload started: "
        + ", ".join(f"{k} {r['loadavg'][0]:.2f}" for k, r in report["workloads"].items()),
        f"- Date: {report['date']}; wall time {report['wall_s']:.0f} s.",
        "",
        "The machine is shared (other engineers' test runs); the rounds interleave the "
        "frameworks so load hits them alike, but absolute numbers move with the load above.",
        "",
        "## float32 matmul ceiling",
        "",
        f"{ceil.get('size', '?')}×{ceil.get('size', '?')} float32 MatMul on {THREADS} threads, "
        f"measured {ceil.get('measurements', 0)} times (before the first workload and after each), "
        "best of 5-10 repeats each: " + ", ".join(
            f"{k} {ceil[k]:.1f} GFLOP/s" for k in ("numpy", "onnxruntime", "torch") if ceil.get(k))
        + f". Ceiling used below: **{report.get('ceiling_gflops') or 0:.1f} GFLOP/s** (the best); "
        f"the worst of the measurements was {ceil.get('lowest', 0):.1f} GFLOP/s, which shows how "
        "much the load took away.",
        "",
        "## Results",
        "",
        "Per training step (forward, loss, backward, optimizer update), after warm-up. "
        "*× best peer*: median over the fastest of PyTorch / PyTorch fused / ORT training / "
        "onnx2torch (the inference model converted by onnx2torch and trained in PyTorch, where the "
        "converted model trains like the original: first losses within 1e-4 of PyTorch's); "
        "*paired*: the median over rounds of the same ratio taken within each round (the "
        "frameworks of a round run seconds apart, so load changes between rounds cancel). "
        "*first step*: construction from the inference ONNX model (or the torch module) plus the "
        "first step, imports excluded; for ORT training it includes `generate_artifacts`; the "
        f"median over {report.get('first_samples', 1)} fresh child processes per framework, "
        "started one at a time (see *Time to first step and memory*). "
        "*peak RSS*: high-water mark (VmHWM) of the child that only built and trained that "
        "framework on that workload, imports included (`ru_maxrss` would include run.py's own, "
        "inherited across fork+exec). *GFLOP/s*: analytic forward+backward FLOPs (3 × forward "
        "MatMul/Gemm/Conv FLOPs) over the median.",
        "",
    ]
    out += main_table(report["workloads"], report.get("ceiling_gflops"))
    out += ["", "FLOPs per step: " + ", ".join(
        f"{k} {WORKLOADS[k].flops_per_step / 1e6:.1f} M" if WORKLOADS[k].flops_per_step > 1e5
        else f"{k} {WORKLOADS[k].flops_per_step:.0f}" for k in report["workloads"]) + ".", ""]
    how = report.get("training_model", "?")
    out += ["## Equal work", "",
            f"Every framework starts from the same weights and trains on the same batch; the table gives "
            f"the max relative difference of the losses of the first {CHECK_STEPS} steps. onnxtrain's "
            f"training models came from: **{how}** "
            "(`onnxtrain.build.training_model`, whose AdamW follows torch.optim.AdamW's rule; the "
            "hand-built fallback uses the spec's `Adam` op). ORT training's AdamW (`adam_mode=1`, the "
            "Hugging Face convention, also the spec `Adam` op's) adds epsilon to sqrt(v) *before* the "
            "bias correction and decays *after* the update; torch adds epsilon after the correction "
            "(an effective epsilon 1/sqrt(1-beta2^T) ≈ 32× smaller at T=1) and decays before. Weights "
            "whose gradients are near epsilon then move differently, ~1e-4 to 1e-3 on the losses after "
            "a few steps. So the AdamW workloads are also compared with torch running the "
            "spec-convention update (same module and weights, update written in torch): ORT training "
            "agrees with that one to ~1e-7. W5 is also compared with torch training the same module "
            "in float64 (*vs torch in float64*): that is how far float32 rounding alone (ReLU masks "
            "flipping near zero, amplified through BatchNorm) moves each implementation; a converted "
            "model counts as the same training within twice torch's own float32 drift (or 1e-4).", ""]
    out += equal_work_table(report["workloads"])
    if report.get("overhead"):
        out += ["", "## Per-step overhead (W3)", "",
                "W3's step is almost all overhead (a 32×10 Gemm). The same onnxruntime program "
                "(`sess.programs()['training_info[0].algorithm']`) run three ways, interleaved:", ""]
        out += overhead_table(report["overhead"])
    out += ["", "## Time to first step and memory", "",
            "Import, build and first step of the child that was then timed. *Time to first step*: "
            "build plus first step (plus artifacts for ORT training) of each fresh child of that "
            f"framework, {report.get('first_samples', 1)} in all: the timed one, then the others "
            "once the timing is over, one at a time in a rotating order (from one process to the "
            "next it varies by about ±10 ms on this machine, for every framework); its median is "
            "the *first step* column above.", ""]
    out += startup_table(report["workloads"])
    if report.get("profiles"):
        out += ["", "## Where onnxtrain's step goes (onnxruntime profiler)", "",
                "onnxtrain's algorithm program run with `SessionOptions.enable_profiling` through "
                "IOBinding as `train_step` runs it; kernel time per step by op type, after "
                "onnxruntime's graph optimizations. ORT training's train and optimizer sessions "
                "profiled the same way, for comparison.", ""]
        for key in report["workloads"]:
            out += profile_section(key, report["profiles"].get(key, {}),
                                   report.get("ort_profiles", {}).get(key))
            out.append("")
    if report.get("llm"):
        out += llm_lines(report["llm"]) + [""]
    out += ["## Gaps", "",
            "Where onnxtrain is slower than the best peer, why, and what would close each gap: "
            "`docs/performance.md` (written from the profiles above).", ""]
    out += ["## Method", "",
            "- One inference ONNX model per workload (`benchmarks/workloads.py`, onnx.helper, opset 17, "
            "static shapes) with numpy weights (torch's default init distributions, one seed). "
            "onnxtrain trains it through a standard training model (`benchmarks/training_model.py`: "
            "`onnxtrain.build` when available, otherwise training_info built by hand); ORT training "
            "through `generate_artifacts` on the same file; PyTorch through the equivalent "
            "`torch.nn` modules (`benchmarks/torch_models.py`, `nn.TransformerEncoderLayer` for W4) "
            "loaded with the same weights.",
            "- W5 and W6 are PyTorch modules (torchvision's `resnet18(num_classes=10)`; transformers' "
            "`BertForSequenceClassification` from a 4-layer, hidden-256 config with dropout 0) exported "
            "by `benchmarks/export_models.py` with `torch.onnx.export(dynamo=False)` (opset 17, IR 8, "
            "eval mode, no constant folding; LayerNormalization with its Mean/InvStdDev outputs "
            "declared, which ORT training's gradient needs), cached in `benchmarks/.cache/`. Norm "
            "scales, zero biases and BatchNorm statistics are drawn distinct first (the exporter "
            "stores equal initializers once). The torch peer trains the same module loaded with the "
            "exported initializers; every framework trains BatchNormalization in training mode "
            "(batch statistics). W6's token ids avoid 0, BERT's padding index (torch never trains "
            "its embedding row; the exported Gather does). onnxruntime-training 1.19 has no SGD "
            "with momentum, so its W5 row trains plain SGD and is no peer.",
            "- onnxtrain steps are `train_step(feeds, fetch=False)`; torch steps are `zero_grad`, "
            "forward, loss, `backward`, `step` (torch's default optimizer implementation on CPU: "
            f"{report.get('torch_impl', '?')}; `fused=True` in the torch-fused rows); ORT training steps are `Module(...)` (returns the "
            "loss), `Optimizer.step()`, `lazy_reset_grad()`. The same batch every step.",
            "- Each framework runs in its own child process; children are started one at a time "
            "(construction and first step alone), then warmed up, then driven in interleaved rounds.",
            ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    # js_bundle.py's section (Node and the browser) comes from its own run: keep it.
    old = path.read_text() if path.exists() else ""
    begin, end = "<!-- js_bundle.py: begin -->", "<!-- js_bundle.py: end -->"
    if begin in old and end in old:
        out += ["", old[old.index(begin):old.index(end) + len(end)], ""]
    path.write_text("\n".join(out))


# ------------------------------------------------------------------ main
def ensure_venv(python: Path, script: str, no_setup: bool, check: str | None = None) -> str | None:
    """None if a peer's environment (``python``, made by ``script``) is usable, else why not.

    ``check``: Python code the environment must run (else ``script`` completes it)."""
    if python.exists() and (check is None or subprocess.run(
            [str(python), "-c", check], capture_output=True).returncode == 0):
        return None
    venv = python.parent.parent
    if no_setup:
        return f"{venv} missing (run benchmarks/{script})"
    log(f"creating {venv} (benchmarks/{script}) ...")
    proc = subprocess.run(["bash", str(HERE / script), sys.executable], capture_output=True, text=True)
    if proc.returncode != 0 or not python.exists():
        return f"{script} failed: {proc.stderr[-500:]}"
    return None


#: What W5/W6 need of the ORT training environment: it exports them and runs their torch peer.
EXPORT_CHECK = ("import sys, types; sys.modules['torchvision._meta_registrations'] = types.ModuleType('s'); "
                "import torch, torchvision, transformers")


def ensure_ort_venv(no_setup: bool, exports: bool = False) -> str | None:
    """None if the ORT training environment is usable, else why not (``exports``: with
    torchvision and transformers, for W5/W6)."""
    return ensure_venv(ORT_PYTHON, "setup_ort_training.sh", no_setup, EXPORT_CHECK if exports else None)


def parse_workloads(text: str | None) -> list[str]:
    if not text:
        return list(WORKLOADS) + LLM_KEYS
    keys: list[str] = []
    aliases = dict(ALIASES, L=LLM_KEYS, **{k.upper(): [k] for k in LLM_KEYS})
    for part in text.split(","):
        part = part.strip()
        for k in aliases.get(part.upper(), [part.upper()]):
            if k not in WORKLOADS and k not in LLM_KEYS:
                raise SystemExit(f"unknown workload {part!r}; choose from "
                                 f"{', '.join(list(WORKLOADS) + LLM_KEYS)}")
            if k not in keys:
                keys.append(k)
    return keys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few steps and rounds (development)")
    ap.add_argument("--workloads", help="comma-separated: W1 (with W1-SGD), W1-SGD, W2, W3, W4, W5, W6, "
                                        "W7 (W7-LSTM and W7-GRU), L1, L2, L3, L3r, L4 (L: all five)")
    ap.add_argument("--steps", type=int, help="timed steps per framework and workload")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default 10, quick 3)")
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS),
                    help=f"comma-separated subset of {','.join(FRAMEWORKS)}")
    ap.add_argument("--wait", choices=["passive", "spin"], default="passive",
                    help="idle threads block (passive, default: fair on a shared machine) or "
                         "spin (each framework's default)")
    ap.add_argument("--no-profile", action="store_true", help="skip the onnxruntime profiles")
    ap.add_argument("--first-step-samples", type=int,
                    help="fresh children per framework whose time to first step is measured "
                         "(default 5, quick 1); the median is reported")
    ap.add_argument("--no-builder", action="store_true",
                    help="hand-build onnxtrain's training model even if onnxtrain.build exists")
    ap.add_argument("--no-setup", action="store_true",
                    help="don't create the ORT training environment when missing (skip that peer)")
    ap.add_argument("--out", help="markdown report (default: docs/benchmarks.md for full runs, "
                                  "none for --quick)")
    ap.add_argument("--json", help="also write the raw results here")
    args = ap.parse_args(argv)

    command = "python benchmarks/run.py" + "".join(f" {a}" for a in (sys.argv[1:] if argv is None else argv))
    keys = parse_workloads(args.workloads)
    llm_keys = [k for k in keys if k in LLM_KEYS]
    keys = [k for k in keys if k not in LLM_KEYS]
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    bad = [f for f in frameworks if f not in FRAMEWORKS]
    if bad:
        raise SystemExit(f"unknown framework(s) {bad}; choose from {FRAMEWORKS}")
    rounds = args.rounds or (3 if args.quick else 10)
    first_samples = max(1, args.first_step_samples or (1 if args.quick else 5))
    WAIT["mode"] = args.wait
    notes: list[str] = []
    if EXPORTED & set(keys):
        why = ensure_ort_venv(args.no_setup, exports=True)
        if why:  # no torch to export them with
            notes.append(f"{', '.join(sorted(EXPORTED & set(keys)))} skipped: {why}")
            keys = [k for k in keys if k not in EXPORTED]
    if any(f in frameworks for f in ("ort-training", "torch", "torch-fused")):
        why = ensure_ort_venv(args.no_setup) if "ort-training" in frameworks else None
        if why:
            notes.append(f"ort-training skipped: {why}")
            frameworks.remove("ort-training")
    if "onnx2torch" in frameworks:
        why = ensure_venv(ONNX2TORCH_PYTHON, "setup_onnx2torch.sh", args.no_setup)
        if why:
            notes.append(f"onnx2torch skipped: {why}")
            frameworks.remove("onnx2torch")
    for fw in list(frameworks):
        if python_for(fw) is None:
            notes.append(f"{fw} skipped: no interpreter with it")
            frameworks.remove(fw)
    if llm_keys and "onnxtrain" in frameworks:
        why = ensure_venv(PEFT_PYTHON, "setup_peft.sh", args.no_setup, PEFT_CHECK)
        if why:
            notes.append(f"{', '.join(llm_keys)} skipped: {why}")
            llm_keys = []

    t_begin = time.time()
    report: dict = {"machine": machine_info(), "quick": args.quick, "rounds": rounds, "wait": args.wait,
                    "uptime_before": uptime(), "date": time.strftime("%Y-%m-%d %H:%M %Z"),
                    "first_samples": first_samples,
                    "workloads": {}, "notes": notes}
    log(f"onnxtrain benchmarks: {', '.join(keys)} × {', '.join(frameworks)}; {THREADS} threads")
    log(f"machine: {report['machine']['cpu']}, {report['machine']['logical_cpus']} CPUs; "
        f"{report['uptime_before']}")
    for n in notes:
        log("note: " + n)

    tmp = Path(tempfile.mkdtemp(prefix="onnxtrain-bench-"))
    logdir = tmp / "logs"
    logdir.mkdir()
    CACHE_DIR["path"] = str(tmp / "startup-cache")
    try:
        # 1. the ceiling: measured now and after every workload; the best one is the machine's
        ceilings: list[dict] = []

        def measure_ceiling() -> None:
            try:
                c = side_task(sys.executable, ["ceiling", "--steps", "5" if args.quick else "10"],
                              logdir, f"ceiling-{len(ceilings)}")
                ceilings.append(c)
                log("ceiling (float32 matmul, GFLOP/s): " + ", ".join(
                    f"{k} {c[k]:.1f}" for k in ("numpy", "onnxruntime", "torch") if k in c))
            except Exception as exc:
                notes.append(f"ceiling failed: {exc}")

        measure_ceiling()

        # 2. the workloads
        steps_used, warmups = {}, {}
        for key in keys:
            w = WORKLOADS[key]
            steps = args.steps or (max(20, w.default_steps // 10) if args.quick else w.default_steps)
            warmup = max(3, min(50, steps // 10))
            steps_used[key], warmups[key] = steps, warmup
            log(f"\n{key}: {w.title} — {steps} timed steps × {len(frameworks)} frameworks, "
                f"{rounds} rounds")
            workdir = prepare(key, tmp, not args.no_builder)
            wres = bench_workload(key, workdir, frameworks, steps, rounds, warmup, logdir, first_samples)
            wres["equal_work"] = equal_work(wres["results"])
            report["workloads"][key] = wres
            measure_ceiling()
            for fw, r in wres["results"].items():
                if r.times_ms:
                    s = r.stats()
                    log(f"  {fw:13s} median {fmt_ms(s['median'])} ms  p90 {fmt_ms(s['p90'])} ms")
                elif r.error:
                    log(f"  {fw:13s} ERROR {r.error.splitlines()[0]}")
                    log("    " + r.error[-800:].replace("\n", "\n    "))
            eq = wres["equal_work"]
            if eq:
                log(f"  equal work (max rel. diff of the first {CHECK_STEPS} losses vs {eq['reference']}): "
                    + ", ".join(f"{fw} {d:.1e}" for fw, d in eq["max_rel_diff"].items()))
                if eq.get("max_rel_diff_float64"):
                    log("  ... vs torch in float64 (float32 rounding drift): " + ", ".join(
                        f"{fw} {d:.1e}" for fw, d in eq["max_rel_diff_float64"].items()))
                if eq.get("max_rel_diff_spec"):
                    log("  ... vs torch running the spec-convention AdamW update: " + ", ".join(
                        f"{fw} {d:.1e}" for fw, d in eq["max_rel_diff_spec"].items()))
            for r in wres["results"].values():
                info = r.ready.get("info", {})
                if info.get("torch") and "torch_version" not in report:
                    report["torch_version"] = info["torch"]
                if info.get("framework") == "torch":
                    report.setdefault("torch_impl", info.get("optimizer_impl"))
                if info.get("framework") == "ort-training":
                    report["ort_training_versions"] = (f"onnxruntime-training {info.get('onnxruntime')}, "
                                                      f"onnx {info.get('onnx')}, numpy {info.get('numpy')}")
                if info.get("training_model"):
                    report.setdefault("training_model", info["training_model"])
        report["steps"] = ", ".join(f"{k} {v}" for k, v in steps_used.items())
        report["warmup"] = ", ".join(f"{k} {v}" for k, v in warmups.items())

        if ceilings:
            best = {k: max(c.get(k, 0.0) for c in ceilings) for k in ("numpy", "onnxruntime", "torch")}
            report["ceiling"] = dict(best, size=ceilings[0]["size"], measurements=len(ceilings),
                                     lowest=min(max(c.get(k, 0.0) for k in best) for c in ceilings))
            report["ceiling_gflops"] = max(best.values())
        else:
            report["ceiling_gflops"] = None

        # 3. per-step overhead on W3
        if "W3" in keys and "onnxtrain" in frameworks:
            n = args.steps or (500 if args.quick else 5000)
            log(f"\nW3 overhead: train_step vs InferenceSession.run vs IOBinding ({n} steps each)")
            try:
                ov = side_task(sys.executable, ["overhead", str(tmp / "W3"), "--steps", str(n),
                                                "--rounds", str(rounds)], logdir, "W3-overhead")
                report["overhead"] = ov
                for name, s in ov["variants"].items():
                    log(f"  {name:45s} median {s['median_us']:.1f} µs  p90 {s['p90_us']:.1f} µs")
            except Exception as exc:
                notes.append(f"overhead failed: {exc}")
                log(f"  failed: {exc}")

        # 4. profiles
        if not args.no_profile and "onnxtrain" in frameworks:
            report["profiles"], report["ort_profiles"] = {}, {}
            n = "5" if args.quick else "20"
            for key in keys:
                log(f"\n{key}: profiling onnxtrain's program" +
                    (" and ORT training's sessions" if "ort-training" in frameworks else ""))
                try:
                    prof = side_task(sys.executable, ["profile", str(tmp / key), "--steps", n,
                                                      "--warmup", "3"], logdir, f"{key}-profile")
                    report["profiles"][key] = prof
                except Exception as exc:
                    report["profiles"][key] = {"error": str(exc)}
                if "ort-training" in frameworks and (tmp / key / "ort").exists():
                    try:
                        report["ort_profiles"][key] = side_task(
                            str(ORT_PYTHON), ["ort-profile", str(tmp / key), "--steps", n, "--warmup", "3"],
                            logdir, f"{key}-ort-profile")
                    except Exception as exc:
                        report["ort_profiles"][key] = {"error": str(exc)}
                for line in profile_section(key, report["profiles"][key], report["ort_profiles"].get(key)):
                    log("  " + line)
        # 5. LLM fine-tuning: llm.py in the peft environment (fresh processes per run)
        if llm_keys:
            log(f"\n{', '.join(llm_keys)}: LLM fine-tuning (benchmarks/llm.py)")
            report["llm"] = run_llm(llm_keys, args.quick, tmp)
    finally:
        report["uptime_after"] = uptime()
        report["wall_s"] = time.time() - t_begin

    # 5. report
    log("")
    log(f"load before: {report['uptime_before']}")
    log(f"load after:  {report['uptime_after']}")
    if report.get("ceiling_gflops"):
        log(f"ceiling: {report['ceiling_gflops']:.1f} GFLOP/s float32 matmul, {THREADS} threads")
    log("")
    for line in main_table(report["workloads"], report.get("ceiling_gflops")):
        log(line)
    log("")
    for line in equal_work_table(report["workloads"]):
        log(line)
    if report.get("llm"):
        log("")
        for line in llm_lines(report["llm"])[2:]:
            log(line)
    out = args.out or (None if args.quick else str(ROOT / "docs" / "benchmarks.md"))
    if out:
        write_doc(Path(out), report, command)
        log(f"\nwrote {out}")
    if args.json:
        Path(args.json).write_text(json.dumps(_jsonable(report), indent=1))
        log(f"wrote {args.json}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def run_llm(keys: list[str], quick: bool, tmp: Path) -> dict:
    """``llm.py`` for ``keys``: its report (or the error)."""
    out = tmp / "llm.json"
    env = child_env()
    env.pop("OMP_WAIT_POLICY", None)  # llm.py runs every framework with its own defaults
    cmd = [str(PEFT_PYTHON), str(HERE / "llm.py"), "--workloads", ",".join(keys), "--json", str(out),
           "--threads", str(THREADS)] + (["--quick"] if quick else [])
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr.splitlines():
        if line.split(":")[0] in LLM_KEYS or line.startswith("  run "):
            log("  " + line.strip())
    if not out.exists():
        return {"error": (proc.stderr or proc.stdout)[-1500:]}
    return json.loads(out.read_text())


def llm_lines(report: dict) -> list[str]:
    if "error" in report:
        return ["## LLM fine-tuning (L1-L4)", "", "llm.py failed:", "", "```", report["error"], "```"]
    import llm

    return llm.section(report)


def _jsonable(obj):
    if isinstance(obj, Result):
        d = dict(obj.__dict__)
        if obj.times_ms:
            d["stats"] = obj.stats()
        d["ttfs_ms"] = obj.ttfs_ms
        d["ttfs_cold_ms"] = obj.ttfs_cold_ms
        return d
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


if __name__ == "__main__":
    raise SystemExit(main())
