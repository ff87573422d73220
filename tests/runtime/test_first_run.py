"""The first run's memory, faulted in ahead (onnxtrain.runtime.firstrun).

A session's programs allocate from one onnxruntime arena of the process; the
first process that trains a model records how much anonymous memory its
first run took (a ``firstrun`` entry of the startup cache), and the next one
faults that much of the arena, and the step's spare state buffers, in on a
thread while it is being built.  Results are the same bit for bit; the
first run of the next process grows by far less; a caller's own options, a
data-parallel session or ``ONNXTRAIN_PREFAULT=0`` keep each session's own
arena.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from test_build import blobs, mlp

from onnxtrain import TrainingSession, build
from onnxtrain.core import diskcache
from onnxtrain.runtime import firstrun
from onnxtrain.runtime.executor import default_session_options

BUILDER_TESTS = str(Path(__file__).resolve().parents[1] / "builder")


#: The build of ``first_run_case``.
CASE_OPTIONS = dict(loss="cross_entropy", target="label", optimizer=build.AdamW(lr=0.01))


def first_run_case():
    """A model whose first run grows onnxruntime's arena by about 24 MB, and its batch."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1024, 64)).astype(np.float32)
    label = rng.integers(0, 4, 1024)
    return x, label, build.training_model(mlp(sizes=(64, 2048, 4)), **CASE_OPTIONS)


SCRIPT = textwrap.dedent("""
    import hashlib, json, sys
    import numpy as np
    sys.path[:0] = [{builder_tests!r}, {here!r}]
    import onnxruntime as ort
    if sys.argv[1] == "registered":  # the application's own arena, first
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(info, ort.OrtArenaCfg({{}}))
    from onnxtrain import TrainingSession, build
    from onnxtrain.core import diskcache
    from onnxtrain.runtime.firstrun import anon_bytes
    from test_build import mlp
    from test_first_run import CASE_OPTIONS, first_run_case
    x, label, model = first_run_case()
    feeds = {{"X": x, "label": label}}
    if sys.argv[1] == "unfetched":  # its pruned program drops the inference-mode forward pass
        from test_unfetched import _bn_model, _feeds
        model, feeds = _bn_model(), _feeds(0)
    if sys.argv[1] == "one call":  # the arena filled from before the build on
        sess = build.training_session(mlp(sizes=(64, 2048, 4)), **CASE_OPTIONS)
    else:
        sess = TrainingSession(model)
    ex = sess._runner.executor(sess._programs.algorithms[0], feeds)  # compiled, and the pages faulted in
    losses, grown, fetch = [], None, sys.argv[1] != "unfetched"
    for step in range(3):
        before = anon_bytes()
        out = sess.train_step(feeds, fetch=fetch)
        losses.append(float(out["loss"]) if fetch else None)
        if step == 0:
            grown = anon_bytes() - before
    h = hashlib.sha256()
    for k in sorted(sess.state):
        h.update(np.ascontiguousarray(sess.state[k]).tobytes())
    diskcache.flush()
    print(json.dumps({{"losses": losses, "state": h.hexdigest(), "grown": grown,
                      "stats": dict(diskcache.stats), "spinning": ex.spinning}}))
""")


def _process(cache: Path, how: str = "", **env: str) -> dict:
    """SCRIPT in a fresh process with the startup cache ``cache`` (and ``env``): its losses,
    state digest, first-run growth, counters, and whether its step's idle threads spin."""
    env = dict(os.environ, ONNXTRAIN_CACHE_DIR=str(cache), ONNXTRAIN_PROGRAM_CACHE="1", ONNXTRAIN_PREFAULT="1",
               **env)
    code = SCRIPT.format(builder_tests=BUILDER_TESTS, here=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", code, how], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def plain_losses_and_state() -> tuple[list[float], str]:
    """Three steps of ``first_run_case`` with options of the caller's (no shared arena)."""
    x, label, model = first_run_case()
    sess = TrainingSession(model, session_options=default_session_options())
    assert not sess._runner.first_run.on
    losses = [float(sess.train_step({"X": x, "label": label})["loss"]) for _ in range(3)]
    return losses, state_digest(sess)


def state_digest(sess) -> str:
    h = hashlib.sha256()
    for k in sorted(sess.state):
        h.update(np.ascontiguousarray(sess.state[k]).tobytes())
    return h.hexdigest()


def recorded_then_made_ahead(cache: Path, how: str, sessions: int) -> tuple[dict, dict]:
    """Two processes of ``how``: the first records ``sessions`` sessions (their
    optimized forms missed), the next makes every one ahead and takes it."""
    recording = _process(cache, how)
    assert recording["stats"].get("ort.miss") == sessions and "ort.ahead" not in recording["stats"]
    later = _process(cache, how)
    assert later["stats"].get("ort.ahead") == sessions
    assert "ort.hit" not in later["stats"] and "ort.miss" not in later["stats"]
    return recording, later


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="measures /proc/self/status")
def test_later_processes_find_their_first_run_memory_in_place_with_equal_results(tmp_path):
    recording = _process(tmp_path)
    assert recording["stats"].get("firstrun.miss") == 1 and recording["stats"].get("firstrun.write") == 1
    assert recording["grown"] > 16 << 20  # (24 MB of arena, here)
    runs = [_process(tmp_path) for _ in range(2)]
    assert all(r["stats"].get("firstrun.hit") == 1 for r in runs)
    # A cold start's record may fall short (with one thread here: 24 of 33 MB
    # of arena); the next run that still grows records more, and is the last.
    assert runs[-1]["grown"] < recording["grown"] / 8
    assert "firstrun.write" not in runs[-1]["stats"]
    losses, state = plain_losses_and_state()
    assert losses == recording["losses"] == runs[0]["losses"] == runs[1]["losses"]
    assert state == recording["state"] == runs[0]["state"] == runs[1]["state"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="measures /proc/self/status")
def test_one_call_faults_the_first_runs_memory_in_from_before_the_build(tmp_path):
    recording = _process(tmp_path, "one call")
    assert recording["stats"].get("firstrun.write") == 2  # (the built model's key, and the source's)
    runs = [_process(tmp_path, "one call") for _ in range(2)]
    assert all(r["stats"].get("firstrun.expected") == 1 for r in runs)
    assert runs[-1]["grown"] < recording["grown"] / 8
    assert recording["losses"] == runs[0]["losses"] == runs[1]["losses"] == plain_losses_and_state()[0]


def test_the_first_steps_session_is_made_ahead_where_the_record_fits(tmp_path, monkeypatch):
    """The first process records its first training program's session (the
    entry of its optimized form and its options' recipe); the next ones
    make it on the first run's thread while the model is built, and train
    the same bit for bit.  With other options (idle threads that block
    instead of spinning) what was made ahead is not taken: the executor
    makes its own, and the record follows the new options."""
    monkeypatch.delenv("ONNXTRAIN_SPINNING", raising=False)
    recording, later = recorded_then_made_ahead(tmp_path, "one call", 1)
    assert later["losses"] == recording["losses"] == plain_losses_and_state()[0]
    assert later["state"] == recording["state"] and later["spinning"] is recording["spinning"] is True
    # Bug planted: the session taken by its entry alone; the one made ahead spins.
    blocking = _process(tmp_path, "one call", ONNXTRAIN_SPINNING="0")
    assert "ort.ahead" not in blocking["stats"] and blocking["stats"].get("ort.hit") == 1
    assert blocking["spinning"] is False and blocking["losses"] == recording["losses"]
    again = _process(tmp_path, ONNXTRAIN_SPINNING="0")  # (TrainingSession: the model's own record)
    assert again["stats"].get("ort.ahead") == 1 and again["spinning"] is False
    assert again["losses"] == recording["losses"]


def test_a_first_run_that_fetches_nothing_has_its_pruned_session_made_ahead_too(tmp_path, monkeypatch):
    """A first step with ``fetch=False`` runs a second session, of the
    program pruned to its state outputs: it is loaded from onnxruntime's
    optimized form as the full program's is (it was made from the model
    itself in every process), and recorded, so that the next process makes
    both ahead.  The state is the same bit for bit as a fetching run's."""
    monkeypatch.delenv("ONNXTRAIN_SPINNING", raising=False)
    recording, later = recorded_then_made_ahead(tmp_path, "unfetched", 2)
    from test_unfetched import _bn_model, _feeds

    plain = TrainingSession(_bn_model(), session_options=default_session_options())
    for _ in range(3):
        plain.train_step(_feeds(0))
    assert later["state"] == recording["state"] == state_digest(plain)


@pytest.mark.parametrize("session", [
    None, "a string", ["zz", [1, None, True, True, None]],  # not hex
    ["ab", [1, 2, True, True, None]], ["ab", [1, None, True, True]], ["ab", ["1", None, True, True, None]],
    ["ab", [1, None, 1, True, None]], ["ab", [1, None, True, True, 7]],
])
def test_a_damaged_record_makes_nothing_ahead(session):
    for sessions in (session, [session], [session, session]):
        (job,) = firstrun._ahead_jobs({"anon_bytes": 4096, "sessions": sessions})
        assert job.func is firstrun._fault_arena and job.args == (4096,)
    # (a damaged one beside a sound one: the sound one only)
    sound = ["ab", [1, None, True, True, None]]
    job = firstrun._ahead_jobs({"sessions": [session, sound]})[0]
    assert job.func.__name__ == "make_ahead" and len(job.args[0]) == 1


def test_a_session_made_ahead_is_taken_once_and_only_with_its_recipe(tmp_path, monkeypatch):
    from onnxtrain.runtime import ortcache
    from onnxtrain.runtime.options import Recipe

    monkeypatch.setenv("ONNXTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(diskcache.ENV, "1")
    monkeypatch.setattr(ortcache, "_ort_submitted", 0)  # (a process makes ORT_MAX_MADE optimized forms at most)
    x, label, model = first_run_case()
    sess = TrainingSession(model)
    loss = float(sess.train_step({"X": x, "label": label})["loss"])
    diskcache.flush()  # (the optimized form, made at the miss)
    ((key, recipe),) = sess._runner.executor(sess._programs.algorithms[0], {"X": x, "label": label}).ahead
    made, jobs = [], firstrun._ahead_jobs({"sessions": [[key.hex(), recipe.as_list()]]})
    assert [getattr(j.func, "__name__", "") for j in jobs] == ["make_ahead", "_fault_arena"]
    real = ortcache._session_of
    monkeypatch.setattr(ortcache, "_session_of", lambda *a: made.append(a) or real(*a))
    jobs[0]()
    jobs[0]()  # (made already: not again)
    assert made == [(key, recipe)]
    other = Recipe(**{**vars(recipe), "mem_pattern": not recipe.mem_pattern})
    assert ortcache.ahead(key, other) is None and not ortcache._ahead  # another recipe: dropped
    ortcache.make_ahead([(key, recipe)])
    diskcache.stats.clear()
    again = TrainingSession(model)
    assert float(again.train_step({"X": x, "label": label})["loss"]) == loss
    assert diskcache.stats.get("ort.ahead") == 1 and not ortcache._ahead
    assert ortcache.ahead(key, recipe) is None  # handed over once


def test_a_session_taking_over_the_thread_begun_before_the_build_makes_nothing_again(tmp_path, monkeypatch):
    """Bug caught: the session's own record asked the thread for the session
    made ahead a second time; where the executor had taken the first one
    already (W5: the arena's filling took longer than the build), a second
    was made, which nobody took and the first run waited for (30-50 ms)."""
    monkeypatch.setenv("ONNXTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(diskcache.ENV, "1")
    monkeypatch.delenv(firstrun.ENV, raising=False)
    asked = []
    monkeypatch.setattr(firstrun, "_run_all", lambda jobs: asked.append([j.func.__name__ for j in jobs]))
    source, model = mlp(sizes=(64, 2048, 4)), first_run_case()[2]
    record = {"anon_bytes": 8 << 20, "sessions": [["ab", [1, None, True, True, None]]]}
    diskcache.write_now("firstrun", firstrun._source_key(source, "options"), record, b"")
    diskcache.write_now("firstrun", firstrun.shape_key(model, firstrun.LARGE_MODEL_BYTES), record, b"")
    with firstrun.expected(source, "options", True):
        firstrun._expected[0][1].join()
        first = firstrun.FirstRun.begin(model, True)
        first.wait()
    assert asked == [["make_ahead", "_fault_arena"], ["_fault_arena"]]
    first = firstrun.FirstRun.begin(model, True)  # (no thread begun before: this one makes it)
    first.wait()
    assert asked[-1] == ["make_ahead", "_fault_arena"]


def test_an_arena_the_application_registered_first_changes_no_result(tmp_path):
    # onnxruntime takes a second registration without a word: the sessions
    # of the application and onnxtrain's then share one arena, and train the same.
    registered = _process(tmp_path, "registered")
    assert registered["losses"] == plain_losses_and_state()[0]


DROPPED = textwrap.dedent("""
    import gc, sys
    sys.path[:0] = [{builder_tests!r}]
    from onnxtrain import TrainingSession, build
    from test_build import mlp
    model = build.training_model(mlp(sizes=(64, 8192, 512)), loss="cross_entropy", target="label",
                                 optimizer=build.AdamW(lr=0.01))  # 40 MB of spares to fault in
    for _ in range(3):
        sess = TrainingSession(model)
        first = sess._runner.first_run
        del sess
        gc.collect()
        first.wait()
    print("ok")
""")


def test_a_session_dropped_while_its_pages_are_faulted_in():
    """Bug caught: the thread wrote through numpy views of the spare buffers,
    which do not keep their memory; a session collected meanwhile freed it
    under the thread (a segmentation fault in the suite)."""
    env = dict(os.environ, ONNXTRAIN_PROGRAM_CACHE="0")
    done = subprocess.run([sys.executable, "-c", DROPPED.format(builder_tests=BUILDER_TESTS)], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ok"]


# ------------------------------------------------------------------ in this process
def small_model():
    return build.training_model(mlp(), loss="cross_entropy", target="label", optimizer=build.AdamW(lr=0.05))


def test_who_uses_the_shared_arena(monkeypatch):
    monkeypatch.delenv(firstrun.ENV, raising=False)
    assert TrainingSession(small_model())._runner.first_run.on == firstrun.shared_arena()
    so = ort.SessionOptions()
    assert not TrainingSession(small_model(), session_options=so)._runner.first_run.on
    monkeypatch.setenv(firstrun.ENV, "0")
    assert not TrainingSession(small_model())._runner.first_run.on
    monkeypatch.setenv(firstrun.ENV, "sometimes")
    with pytest.raises(ValueError, match="ONNXTRAIN_PREFAULT='sometimes'"):
        TrainingSession(small_model())
    monkeypatch.setenv(firstrun.ENV, "1")
    assert firstrun.wanted(None, None, False) and firstrun.wanted(["CPUExecutionProvider"], None, False)
    assert not firstrun.wanted(None, None, data_parallel=True)  # (and memory="lean")
    assert not firstrun.wanted(["CUDAExecutionProvider"], None, False)  # another provider
    assert not firstrun.wanted(None, so, False)  # the caller's options


def test_the_shape_key_follows_shapes_not_values():
    key = firstrun.shape_key(mlp(seed=0), 1 << 30)
    assert key is not None and key == firstrun.shape_key(mlp(seed=1), 1 << 30)
    assert key != firstrun.shape_key(mlp(sizes=(4, 16, 3)), 1 << 30)
    assert firstrun.shape_key(mlp(), large_from=64) is None  # a large model: not faulted ahead


class _Fake:
    """anon_bytes as a script says."""

    def __init__(self, *values: int) -> None:
        self.values = list(values)

    def __call__(self) -> int:
        return self.values.pop(0)


@pytest.mark.parametrize("recorded, grown, left, written", [
    (None, 50, 0, 50),  # no record: what the run took
    (100, 20, 0, 120),  # faulted ahead, still grew by over an eighth: more next time
    (100, 10, 0, None),  # grew by less (what is not the arena's): kept
    (None, -5, 0, None),  # gave memory back: nothing to record
    # Bug caught: the spares the thread had not reached when the run began
    # counted as the arena's, and W5's record grew at every start (233 MB to 796).
    (100, 20, 15, None),
    (None, 50, 20, 30),
])
def test_what_a_first_run_records(tmp_path, monkeypatch, recorded, grown, left, written):
    monkeypatch.setenv("ONNXTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(diskcache.ENV, "1")
    first = firstrun.FirstRun(True, diskcache.make_key("firstrun", "a model"))
    first.recorded, first._measure = recorded, True
    if left:
        first.touch([np.empty(left, np.uint8)])
        first.wait()
        first._touching.left = left  # (as if stopped before it began)
    monkeypatch.setattr(firstrun, "anon_bytes", _Fake(1000, 1000 + grown))
    with first.measured(training=False):  # (not a training run: not measured)
        pass
    with first.measured(training=True):
        pass
    with first.measured(training=True):  # (measured once)
        pass
    diskcache.flush()
    entry = diskcache.read("firstrun", first.key)
    assert (entry[0]["anon_bytes"] if entry else None) == written


def test_the_spares_made_ahead_are_the_ones_the_first_step_writes():
    sess = TrainingSession(small_model(), session_options=ort.SessionOptions())  # (none made ahead)
    store = sess._store
    targets = sess._programs.algorithms[0].target_keys
    made = store.reserve(targets)
    assert len(made) == len(targets) and store.reserve(targets) == []  # made once
    x, label = blobs()
    sess.train_step({"X": x, "label": label})
    for name, buffer in zip(targets, made):  # committed: the step wrote into them
        assert np.shares_memory(buffer.numpy(), store.current([name])[name].numpy())


def test_the_touching_stops_where_the_first_run_begins():
    """Bug caught: the first run waited for the thread to touch every spare,
    and on W5 (90 MB of them, begun late) it waited 70-130 ms, with three
    threads faulting on two cores; it now takes over where the thread stopped."""
    spares = [np.full(1 << 20, 7, np.uint8), np.empty(256 << 20, np.uint8)]
    first = firstrun.FirstRun(True)
    first.touch(spares)
    first.wait()
    assert first._touching.left > 128 << 20  # (at most a few 4 MB pieces were reached)
    whole = firstrun.Touching(spares[:1])
    whole.run()
    assert whole.left == 0 and (spares[0][::firstrun.PAGE_BYTES] == 0).all()
    assert (spares[0][1::firstrun.PAGE_BYTES] == 7).all()  # (one byte per page)
    stopped = firstrun.Touching([np.full(1 << 20, 7, np.uint8)])
    stopped.stop.set()
    stopped.run()
    assert stopped.left == 1 << 20


def test_expected_fills_the_arena_before_the_model_is_built(tmp_path, monkeypatch):
    monkeypatch.setenv("ONNXTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(diskcache.ENV, "1")
    monkeypatch.delenv(firstrun.ENV, raising=False)
    filled = []
    monkeypatch.setattr(firstrun, "_fault_arena", filled.append)
    source = mlp(sizes=(64, 2048, 4))
    with firstrun.expected(source, "options", True):  # no record yet: nothing to fill
        pass
    assert filled == []
    diskcache.write_now("firstrun", firstrun._source_key(source, "options"), {"anon_bytes": 8 << 20}, b"")
    with firstrun.expected(source, "options", True):
        # (before anything is built, the filling is under way)
        (pending,) = firstrun._expected
        pending[1].join()
        assert filled == [8 << 20]
        first = firstrun.FirstRun.begin(first_run_case()[2], True)
        assert first.also == pending[0] and not firstrun._expected  # taken over: recorded there too
        first.wait()
    with firstrun.expected(source, "other options", True):
        assert firstrun._expected == [(firstrun._source_key(source, "other options"), None)]
    assert not firstrun._expected and filled == [8 << 20]
