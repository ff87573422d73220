"""Training-step time of the JavaScript package against Python, on bundles.

    python benchmarks/js_bundle.py [--quick] [--workloads W1,W2,W4,W7] [--rounds R] [--no-browser]

Each workload of ``workloads.py`` (W1, W2, W4, W7-LSTM, W7-GRU by default)
becomes a training model (``training_model.py``, the builder) and then a
bundle (``onnxtrain.bundle.save``). The same bundle trains, on the same batch:

- **Python** ``bundle.load(folder)``: onnxtrain's default session (fused
  kernels and NCHWc where they pay), and ``fused_kernels=False``: the very
  standard programs the bundle holds;
- **Node**: the npm package on onnxruntime-node (``js_step.mjs node``);
- **browser**: the npm package on onnxruntime-web's WASM build in headless
  Chromium (``js_step.mjs browser``), 1 thread (what a page served without
  COOP/COEP headers gets, e.g. by ``python -m http.server``) and 2 threads
  (a cross-origin isolated page).

Every runner is its own child process with 2 threads (WASM: 1 or 2), idle
threads blocking (as ``run.py``'s runs on this shared machine); after a
warm-up they are driven in interleaved rounds, the order rotating, so that
a change of load hits them alike. Reported: the median and p90 ms per step,
the ratios to Python's, the first steps' losses (Node's equal Python's
standard programs' bit for bit; WASM's to rounding). ``--write`` puts the
table into ``docs/benchmarks.md`` between its markers (``run.py`` keeps
that section when it rewrites the file).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from training_model import training_model  # noqa: E402
from workloads import ALIASES, WORKLOADS  # noqa: E402

DEFAULT = ["W1", "W2", "W4", "W7"]
THREADS = 2
#: Timed steps per runner in a full run (``--quick`` divides by 10, at least 3).
STEPS = {"W1": 200, "W2": 60, "W4": 60, "W7-LSTM": 40, "W7-GRU": 40}
BEGIN, END = "<!-- js_bundle.py: begin -->", "<!-- js_bundle.py: end -->"


# ------------------------------------------------------------------ children
class Child:
    """A runner process speaking JSON lines (start -> ready, run -> times, exit)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None):
        self.name = name
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})}, cwd=ROOT)
        self.ready = self.receive()

    def receive(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: the child exited ({self.proc.wait()})")
        return json.loads(line)

    def run(self, n: int, key: str | None = None) -> list[float]:
        self.proc.stdin.write(json.dumps({"run": n, "key": key}) + "\n")
        self.proc.stdin.flush()
        return self.receive()["times_ms"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write('{"exit": true}\n')
            self.proc.stdin.flush()
            self.receive()
            self.proc.wait(timeout=60)


def python_child(workdir: Path) -> None:
    """The Python runner (``js_bundle.py --child python WORKDIR FUSED``)."""
    from onnxtrain import bundle

    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    fused = sys.argv[4] == "1"
    batch = {k: np.fromfile(workdir / f"{k}.bin", dtype=v["dtype"]).reshape(v["shape"])
             for k, v in json.loads((workdir / "batch.json").read_text()).items()}
    t = time.perf_counter()
    sess = bundle.load(workdir / "bundle", fused_kernels=fused)
    load_ms = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    losses = [float(sess.train_step(batch)["loss"])]
    first_ms = (time.perf_counter() - t) * 1e3
    losses += [float(sess.train_step(batch)["loss"]) for _ in range(4)]
    out.write(json.dumps({"ready": True, "load_ms": load_ms, "first_step_ms": first_ms,
                          "losses": losses}) + "\n")
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("exit"):
            break
        times = []
        for _ in range(msg["run"]):
            start = time.perf_counter()
            sess.train_step(batch, fetch=False)
            times.append((time.perf_counter() - start) * 1e3)
        out.write(json.dumps({"times_ms": times}) + "\n")
    import resource

    out.write(json.dumps({"maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}) + "\n")


# ------------------------------------------------------------------ the run
def prepare(key: str, root: Path) -> Path:
    """root/KEY: the workload's bundle and batch."""
    from onnxtrain import bundle

    w = WORKLOADS[key]
    model, _params, batch = w.builder(w.seed)
    tm, how = training_model(model, w)
    if how != "builder":
        raise SystemExit(f"{key}: the builder cannot make its training model")
    workdir = root / key
    workdir.mkdir(parents=True)
    bundle.save(tm, workdir / "bundle")
    spec = {}
    for name, value in batch.items():
        value = np.ascontiguousarray(value)
        (workdir / f"{name}.bin").write_bytes(value.tobytes())
        spec[name] = {"dtype": value.dtype.name, "shape": list(value.shape)}
    (workdir / "batch.json").write_text(json.dumps(spec))
    return workdir


def stats(times: list[float]) -> dict[str, float]:
    return {"median": statistics.median(times), "p90": float(np.percentile(times, 90)), "n": len(times)}


def measure(keys: list[str], root: Path, rounds: int, quick: bool, browser: bool) -> dict:
    env = {"ONNXTRAIN_THREADS": str(THREADS), "ONNXTRAIN_SPINNING": "0", "OMP_NUM_THREADS": str(THREADS),
           "ONNXTRAIN_PROGRAM_CACHE": "0"}
    node = shutil.which("node")
    browsers = []
    if browser:
        for threads in (1, 2):
            browsers.append(Child(f"WASM {threads} thread{'s' if threads > 1 else ''}",
                                  [node, str(HERE / "js_step.mjs"), "browser", str(root), str(threads),
                                   ",".join(keys)]))
    results = {}
    for key in keys:
        workdir = root / key
        load = os.getloadavg()[0]
        runners = [
            Child("Python (default)", [sys.executable, __file__, "--child", "python", str(workdir), "1"], env),
            Child("Python (standard programs)", [sys.executable, __file__, "--child", "python", str(workdir), "0"], env),
            Child("Node", [node, str(HERE / "js_step.mjs"), "node", str(workdir), str(THREADS)]),
        ]
        everyone = runners + browsers
        steps = max(3, STEPS[key] // 10) if quick else STEPS[key]
        per_round = max(1, steps // rounds)
        times: dict[str, list[float]] = {c.name: [] for c in everyone}
        for c in everyone:  # warm-up
            c.run(max(2, per_round // 2), key)
        for r in range(rounds):
            order = everyone[r % len(everyone):] + everyone[:r % len(everyone)]
            for c in order:
                times[c.name] += c.run(per_round, key)
        for c in runners:
            c.close()
        info = {c.name: c.ready for c in runners}
        info.update({c.name: c.ready["info"][key] for c in browsers})
        results[key] = {"title": WORKLOADS[key].title, "load_at_start": load,
                        "times": {n: stats(t) for n, t in times.items()},
                        "losses": {n: i["losses"] for n, i in info.items()},
                        "load_ms": {n: i["load_ms"] for n, i in info.items()},
                        "first_step_ms": {n: i["first_step_ms"] for n, i in info.items()}}
        print(table([key], results), flush=True)
    for c in browsers:
        c.close()
    return results


# ------------------------------------------------------------------ report
COLUMNS = ["Python (default)", "Python (standard programs)", "Node", "WASM 1 thread", "WASM 2 threads"]


def table(keys: list[str], results: dict) -> str:
    head = ("| workload | Python default | Python, standard programs | Node | Node / Python default "
            "| Node / Python standard | WASM 1 thread | WASM 2 threads | WASM 1 thread / Python default |")
    lines = [head, "|" + "---|" * 10]
    for key in keys:
        t = results[key]["times"]
        med = {n: t[n]["median"] for n in COLUMNS if n in t}

        def cell(name: str) -> str:
            return f"{med[name]:.2f} (p90 {t[name]['p90']:.2f})" if name in med else "–"

        def ratio(a: str, b: str) -> str:
            return f"{med[a] / med[b]:.2f}x" if a in med and b in med else "–"

        lines.append(f"| {key} | {cell(COLUMNS[0])} | {cell(COLUMNS[1])} | {cell('Node')} "
                     f"| {ratio('Node', COLUMNS[0])} | {ratio('Node', COLUMNS[1])} | {cell(COLUMNS[3])} "
                     f"| {cell(COLUMNS[4])} | {ratio(COLUMNS[3], COLUMNS[0])} |")
    return "\n".join(lines)


def equal_work(keys: list[str], results: dict) -> list[str]:
    out = []
    for key in keys:
        losses = results[key]["losses"]
        standard = losses["Python (standard programs)"]
        parts = []
        for name in ["Python (default)", "Node"] + [n for n in COLUMNS[3:] if n in losses]:
            diff = max(abs(a - b) for a, b in zip(losses[name], standard))
            parts.append(f"{name} {'identical' if diff == 0 else f'max |diff| {diff:.1e}'}")
        out.append(f"- {key}: first 5 losses against Python's standard programs: {', '.join(parts)}.")
    return out


def report(keys: list[str], results: dict, meta: dict) -> str:
    lines = [BEGIN, "## JavaScript: Node and the browser (training bundles)", "",
             "The same bundle (`onnxtrain.bundle.save` of the builder's training model) trained on the same "
             "batch by Python (`onnxtrain.bundle.load`: the default session, and `fused_kernels=False`, "
             "which runs exactly the bundle's standard programs), by the npm package on onnxruntime-node, "
             "and by the npm package on onnxruntime-web's WASM build in headless Chromium. "
             "Median ms per training step (p90), interleaved rounds in one run. Produced by:", "",
             "```bash", "python benchmarks/js_bundle.py --write", "```", "",
             table(keys, results), "",
             f"- Machine: {meta['machine']}; load average (1 min) {meta['load_before']:.2f} before, "
             f"{meta['load_after']:.2f} after, at each workload's start: "
             + ", ".join(f"{k} {results[k]['load_at_start']:.2f}" for k in keys) + ".",
             f"- Versions: {meta['versions']}.",
             f"- Threads: {THREADS} intra-op threads for Python and Node, idle threads blocking; WASM 1 thread "
             "(a page without COOP/COEP headers) or 2 (cross-origin isolated). "
             f"{meta['rounds']} rounds; timed steps per runner: "
             + ", ".join(f"{k} {results[k]['times']['Node']['n']}" for k in keys) + ".",
             f"- Date: {meta['date']}; wall time {meta['wall']:.0f} s.", ""] + oversubscribed(meta) + [
             
"Equal work:", ""] + equal_work(keys, results) + ["",
             "Why Node is behind Python's default session where it is: the default session runs fused C "
             "kernels for the optimizers and NCHWc convolutions (`docs/fused-kernels.md`), which a bundle "
             "cannot hold (JavaScript cannot load them); against the same standard programs Node adds "
             "one copy of the new state per step (onnxruntime-node returns outputs in new arrays; Python "
             "binds double buffers in place). WASM adds a copy of the state into and out of its heap "
             "each step, and its kernels are slower than the native ones.", END]
    return "\n".join(lines)


def oversubscribed(meta: dict) -> list[str]:
    """A warning when the machine ran more than one runnable thread per CPU."""
    cpus = os.cpu_count() or 1
    load = max(meta["load_before"], meta["load_after"])
    if load <= cpus:
        return []
    return [f"**The machine was oversubscribed** (load average up to {load:.1f} on {cpus} CPUs, other "
            "jobs running): every runner waited for CPU, steps took several times their quiet-machine "
            "time, and the ratios move by tens of percent from run to run. The rounds interleave the "
            "runners so that the load hits them alike; rerun `python benchmarks/js_bundle.py --write` "
            "on a quiet machine for numbers to rely on.", ""]


def write_section(text: str) -> Path:
    path = ROOT / "docs" / "benchmarks.md"
    doc = path.read_text()
    if BEGIN in doc:
        doc = doc[:doc.index(BEGIN)] + text + doc[doc.index(END) + len(END):]
    else:
        doc = doc.rstrip("\n") + "\n\n" + text + "\n"
    path.write_text(doc)
    return path


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        python_child(Path(sys.argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=",".join(DEFAULT))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-browser", action="store_true")
    ap.add_argument("--write", action="store_true", help="write the section of docs/benchmarks.md")
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--from-json", help="rewrite the report of an earlier --json run (no measuring)")
    args = ap.parse_args()
    keys = [k for name in args.workloads.split(",") for k in ALIASES.get(name, [name])]
    keys = [k for k in keys if k in STEPS]
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        text = report([k for k in keys if k in saved["results"]], saved["results"], saved["meta"])
        print(text)
        if args.write:
            print(f"wrote {write_section(text)}")
        return 0
    if shutil.which("node") is None or not (ROOT / "js" / "node_modules" / "onnxruntime-node").is_dir():
        raise SystemExit("js_bundle: needs node and js/node_modules (cd js && ONNXRUNTIME_NODE_INSTALL=skip npm ci)")
    import tempfile

    import onnxruntime

    start = time.time()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="onnxtrain-js-bench-") as tmp:
        for key in keys:
            prepare(key, Path(tmp))
        results = measure(keys, Path(tmp), args.rounds, args.quick, not args.no_browser)
    node_version = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()
    lock = json.loads((ROOT / "js" / "package-lock.json").read_text())["packages"]
    chromium = subprocess.run([os.environ.get("CHROMIUM", "/usr/bin/chromium"), "--version"],
                              capture_output=True, text=True).stdout.strip() if not args.no_browser else "–"
    meta = {"machine": f"{os.cpu_count()} logical CPUs, {os.uname().sysname} {os.uname().machine}",
            "load_before": load_before, "load_after": os.getloadavg()[0], "rounds": args.rounds,
            "versions": f"Python {sys.version.split()[0]} with onnxruntime {onnxruntime.__version__}; Node "
                        f"{node_version} with onnxruntime-node {lock['node_modules/onnxruntime-node']['version']}; "
                        f"onnxruntime-web {lock['node_modules/onnxruntime-web']['version']} in {chromium}",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(start)), "wall": time.time() - start}
    text = report(keys, results, meta)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "meta": meta}, indent=1))
    if args.write and not args.quick:
        print(f"wrote {write_section(text)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
