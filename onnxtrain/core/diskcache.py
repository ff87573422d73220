"""A verified, bounded on-disk store: the startup cache's entries (docs/startup.md).

Generic: an entry is ``(kind, key) -> (meta, payload)``; what is stored, and
under which key, is decided by each client next to its user (shape
inference in ``core.graph``, lowered programs in ``lower.program_cache``,
onnxruntime's optimized models in ``runtime.ortcache``).  Entries live under
``<cache dir>/startup/`` (``cache_dir()``: ``$ONNXTRAIN_CACHE_DIR``, else
``$XDG_CACHE_HOME/onnxtrain``, else ``~/.cache/onnxtrain``; the fused-kernel
library is built there too).

Safety:

- writes are atomic (a temporary file in the same folder, fsync, rename) and
  racing writers of one key write the same bytes; they run on a background
  thread (``flush`` waits for them; so does interpreter exit, for up to 5 s);
  clients can queue other background jobs there (``submit``);
- every read is verified: a magic line, the full key (not only the file
  name), and the SHA-256 of the payload; an entry that fails any check is
  deleted and rebuilt, never used;
- a store that cannot be read or written (permissions, full disk) is a miss,
  never an error;
- no entry is over ``MAX_ENTRY_BYTES``, and the store holds at most
  ``MAX_ENTRIES`` entries: a write past that deletes the least recently used
  ones (a hit touches its entry).

``ONNXTRAIN_PROGRAM_CACHE=0`` (or ``false``/``no``/``off``) turns the store
off: nothing is read or written.  The fused-kernel library has its own switch.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import struct
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable

from .files import write_atomically

#: Module state that changes at run time: not part of any cache key
#: (``core.fingerprint.module_digest`` skips such modules).
__fingerprint__ = False

ENV = "ONNXTRAIN_PROGRAM_CACHE"
#: Bump when the entry layout or the meaning of a key changes.
FORMAT = 3
MAGIC = b"onnxtrain-startup-cache\n"
#: Entries kept (each a few KB to a few hundred KB); older ones go first.
MAX_ENTRIES = 2000
#: No entry is larger: models with more non-state data (frozen weights) than
#: this are not cached (their programs would copy the weights to disk).
MAX_ENTRY_BYTES = 64 << 20

_HEADER = struct.Struct("<32s32sII")  # key, sha256(meta + payload), len(meta), len(payload)

_lock = threading.Lock()
#: Hits and misses by kind, for tests and docs/startup.md.
stats: Counter[str] = Counter()
_stats_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    """onnxtrain's cache folder: ``$ONNXTRAIN_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/onnxtrain``, else ``~/.cache/onnxtrain``."""
    env = os.environ.get("ONNXTRAIN_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "onnxtrain" if xdg else Path.home() / ".cache" / "onnxtrain"


def directory() -> Path:
    return cache_dir() / "startup"


def count(what: str) -> None:
    with _stats_lock:
        stats[what] = stats.get(what, 0) + 1



def make_key(kind: str, *parts: bytes | str) -> bytes:
    h = hashlib.sha256(f"{kind}\0{FORMAT}\0".encode())
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.digest()


# ------------------------------------------------------------------ entries
def entry_path(kind: str, key: bytes) -> Path:
    return directory() / f"{kind}-{key.hex()[:40]}"


#: The name ``entry_path`` gives an entry, of any kind: what eviction counts.
_ENTRY_NAME = re.compile(r"[a-z]+-[0-9a-f]{40}")


def read(kind: str, key: bytes) -> tuple[dict, bytes] | None:
    """(meta, payload) of a verified entry, or None (missing, unreadable,
    corrupt, another key: a bad entry is removed)."""
    path = entry_path(kind, key)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    entry = _verify(data, key)
    if entry is None:
        count(f"{kind}.corrupt")
        remove(path)
        return None
    try:
        os.utime(path)  # least recently used goes first
    except OSError:
        pass
    return entry


def _verify(data: bytes, key: bytes) -> tuple[dict, bytes] | None:
    n = len(MAGIC)
    if len(data) < n + _HEADER.size or data[:n] != MAGIC:
        return None
    stored_key, digest, meta_len, payload_len = _HEADER.unpack_from(data, n)
    body = memoryview(data)[n + _HEADER.size:]  # (a view: the payload is copied once, at the end)
    if stored_key != key or len(body) != meta_len + payload_len:
        return None
    if hashlib.sha256(body).digest() != digest:
        return None
    try:
        meta = json.loads(bytes(body[:meta_len]).decode())
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(meta, dict):
        return None
    return meta, bytes(body[meta_len:])


def write(kind: str, key: bytes, meta: dict, payload: bytes) -> None:
    """Store an entry atomically, in the background: a writer thread does
    the file work (an fsync costs milliseconds) WRITE_DELAY seconds later,
    so that a cold start neither waits for the disk nor shares the
    interpreter with the writer (``flush`` writes at once; so does
    interpreter exit).  Failures are ignored (the cache is an optimization);
    an entry that a crash leaves half written fails verification and is
    rebuilt."""
    submit(lambda: write_now(kind, key, meta, payload), WRITE_DELAY)


def submit(job: Callable[[], None], delay: float, optional: bool = False) -> None:
    """Run ``job`` on the writer thread, ``delay`` seconds from now at the
    earliest (and at the latest when ``flush`` or interpreter exit asks).
    An ``optional`` job is dropped at exit once ``EXIT_BUDGET`` is spent."""
    global _writer, _outstanding
    with _lock:
        if _writer is None:
            writer = threading.Thread(target=_work, name="onnxtrain-cache", daemon=True)
            try:
                writer.start()
            except RuntimeError:  # no new threads (interpreter shutdown): not cached
                return
            _writer = writer
        _jobs.append((time.monotonic() + delay, optional, job))
        _outstanding += 1
        _cv.notify_all()


def flush(timeout: float | None = None) -> bool:
    """Run every pending job now (deferred ones too) and wait until they
    are done; False on timeout."""
    global _force
    with _cv:
        _force = True
        _cv.notify_all()
        try:
            return _cv.wait_for(lambda: _outstanding == 0, timeout)
        finally:
            _force = False


#: Seconds between storing an entry and writing it (see ``write``).
WRITE_DELAY = 0.5
#: Seconds interpreter exit spends on optional jobs (optimized onnxruntime
#: models not made yet); the entry writes always run.
EXIT_BUDGET = 1.0
#: Pending jobs of the writer thread: (earliest start, optional, job).
_jobs: list = []
_outstanding = 0
_force = False
_exit_deadline: float | None = None
_cv = threading.Condition(_lock)
_writer: threading.Thread | None = None


def _work() -> None:
    global _writer, _outstanding
    try:  # the writer yields to the threads doing real work (Linux: per-thread nice)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass
    while True:
        with _lock:
            while True:
                now = time.monotonic()
                ready = next((j for j in _jobs if _force or j[0] <= now), None)
                if ready is not None:
                    _jobs.remove(ready)
                    break
                if not _jobs:
                    _writer = None
                    return
                _cv.wait(min(j[0] for j in _jobs) - now)
        try:
            if not (ready[1] and _exit_deadline is not None and time.monotonic() > _exit_deadline):
                ready[2]()
        except Exception:  # pragma: no cover  (the writer must not die with jobs queued)
            pass
        finally:
            with _lock:
                _outstanding -= 1
                _cv.notify_all()


@atexit.register
def _flush_at_exit() -> None:
    """Finish the writes; give optional jobs EXIT_BUDGET seconds.  The job
    under way is always let finish (never a thread left inside onnxruntime
    while the interpreter shuts down); 30 s bounds the wait all the same."""
    global _exit_deadline
    _exit_deadline = time.monotonic() + EXIT_BUDGET
    flush(timeout=30.0)


def _after_fork_in_child() -> None:
    """A forked child has no writer thread: its queue starts empty."""
    global _lock, _stats_lock, _cv, _writer, _jobs, _outstanding, _force
    _lock = threading.Lock()
    _stats_lock = threading.Lock()
    _cv = threading.Condition(_lock)
    _writer, _jobs, _outstanding, _force = None, [], 0, False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def write_now(kind: str, key: bytes, meta: dict, payload: bytes) -> None:
    folder = directory()
    meta_bytes = json.dumps(meta, sort_keys=True).encode()
    body = meta_bytes + payload
    data = MAGIC + _HEADER.pack(key, hashlib.sha256(body).digest(), len(meta_bytes), len(payload)) + body
    path = entry_path(kind, key)
    try:
        write_atomically(path, data)
        count(f"{kind}.write")
        _evict(folder)
    except OSError:
        pass


def remove(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _evict(folder: Path) -> None:
    """Keep at most MAX_ENTRIES entries, dropping the least recently used,
    and remove temporary files a killed writer left (older than an hour)."""
    try:
        now = time.time()
        entries = []
        with os.scandir(folder) as it:
            for e in it:
                if not e.is_file(follow_symlinks=False):
                    continue
                if e.name.startswith("."):
                    if e.name.endswith(".tmp") and now - e.stat().st_mtime > 3600:
                        remove(Path(e.path))
                elif _ENTRY_NAME.fullmatch(e.name):
                    entries.append(e)
        if len(entries) <= MAX_ENTRIES:
            return
        entries.sort(key=lambda e: e.stat().st_mtime_ns)
        for e in entries[: len(entries) - MAX_ENTRIES * 3 // 4]:
            remove(Path(e.path))
    except OSError:
        pass



def clear() -> None:
    """Delete every entry (tests)."""
    flush()
    folder = directory()
    try:
        with os.scandir(folder) as it:
            for e in it:
                if e.is_file(follow_symlinks=False):
                    remove(Path(e.path))
    except OSError:
        pass
