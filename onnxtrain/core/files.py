"""Atomic file writes, the one way onnxtrain writes a file that must never be
seen half written: a temporary file in the destination's folder, written,
flushed and fsynced, then renamed over the destination, then the folder
fsynced.  The destination holds the old file or the new one, never a part,
whatever interrupts the write (SIGKILL, power loss after the fsync, a full
disk, an exception).  Temporary files are named ``.<name>.<pid>.<random>.tmp``.
A folder of files that belong together (a training bundle) is written the
same way as a whole (``write_folder``).
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import os
import re
import shutil
import stat
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Callable

from ..errors import OutputExists

try:
    import fcntl
except ImportError:  # (not POSIX: no locks, and no folder is removed but at exit)
    fcntl = None  # type: ignore[assignment]

#: Run-time state (the locks of this process's folders): no cache key covers it.
__fingerprint__ = False

#: Temporary files and folders older than this are stale even if their pid seems alive.
STALE_TEMP_SECONDS = 24 * 3600


def write_atomically(path: str | os.PathLike, content: bytes | Callable[[BinaryIO], object]) -> Path:
    """Write a file the way ``write_model`` does (temporary file in the same
    folder, fsync, rename): ``path`` holds the old file or the new one, never
    a part.  ``content``: the bytes, or a function that writes them."""
    target = Path(path)
    refuse_special(target)
    folder = Path(os.path.abspath(target)).parent
    folder.mkdir(parents=True, exist_ok=True)
    replace_with(folder, target.name, content)
    return target


def refuse_special(path: str | os.PathLike) -> None:
    """FileExistsError when ``path`` exists and is not a regular file (a
    folder, a device, a FIFO, a socket; links followed): the rename of an
    atomic write would replace it (``/dev/null`` by a regular file)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return  # nothing there (or a dangling link, which the write replaces)
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file"
        raise FileExistsError(f"{os.fspath(path)}: exists and is {kind}; refusing to write over it "
                              "(give the path of a file)")


def replace_with(folder: Path, name: str, data: bytes | Callable[[BinaryIO], object]) -> None:
    tmp = write_temp(folder, name, data)
    try:
        os.replace(tmp, folder / name)
    except BaseException:
        unlink_quietly(tmp)
        raise
    fsync_dir(folder)


def write_temp(
    folder: Path, name: str, content: bytes | Callable[[BinaryIO], object]
) -> str:
    """A fully written and fsynced temporary file for ``folder / name``; returns its path.

    ``content``: the bytes, or a function that writes them to the open file.
    An OSError names ``folder / name``, the file the caller asked for, never
    the temporary file."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.{os.getpid()}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise _named(exc, folder / name) from None
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        unlink_quietly(tmp)
        if exc.filename is None or exc.filename == tmp:
            raise _named(exc, folder / name) from None
        raise  # about another file (a mapped source, ...): as it is
    except BaseException:
        unlink_quietly(tmp)
        raise
    return tmp


def _named(exc: OSError, path: Path) -> OSError:
    """``exc`` again, naming ``path`` (the destination) as its file."""
    return type(exc)(exc.errno, exc.strerror or str(exc), str(path))


def fsync_dir(folder: Path) -> None:
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def unlink_quietly(path: str | os.PathLike) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _umask() -> int:
    """The process umask, read without changing it (Linux); 0o022 elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


@contextmanager
def replacing(target: str | os.PathLike) -> Iterator[str]:
    """A temporary path beside ``target`` for another program to write (a
    compiler's output); renamed over ``target`` when the block ends without
    an exception, removed otherwise."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, target)
        fsync_dir(target.parent)
    finally:
        unlink_quietly(tmp)


def write_folder(target: str | os.PathLike, fill: Callable[[Path], object], overwrite: bool = False) -> Path:
    """Write a folder the way ``write_atomically`` writes a file: ``fill(tmp)``
    fills a temporary folder beside ``target`` (its files written and
    fsynced), which is then renamed to ``target``.  ``target`` is never seen
    half written: it holds the old content or the new one.

    Refused (OutputExists, a FileExistsError, before ``fill`` runs, nothing changed): a
    ``target`` that is not a folder (a file, a link, a device), and a
    non-empty folder unless ``overwrite``.  With ``overwrite``, the old folder
    and the new one exchange places in one atomic step where the system can
    (Linux), else the old one is moved aside and the new one renamed into
    place (the old one moved back if that fails); then the old one is
    removed.  Temporary folders are named ``.<name>.<pid>.<random>.tmp``."""
    given = target
    target = Path(os.path.abspath(target))
    parent = target.parent
    remove_stale_temp_folders(parent, target.name)
    check_folder_target(given, overwrite)
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp", dir=parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        fill(tmp)
        fsync_dir(tmp)
        check_folder_target(given, overwrite)  # (again: it may have changed meanwhile)
        _rename_folder(tmp, target, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(parent)
    return Path(given)


def remove_stale_temp_folders(parent: Path, name: str) -> list[str]:
    """Remove the temporary folders that interrupted ``write_folder`` writes of
    ``parent/name`` left: those whose writer (its pid is in the name) is gone,
    or older than a day.  An old folder moved aside (``.old``) by a writer
    killed before the new one took its place is renamed back instead."""
    pattern = re.compile(rf"^\.{re.escape(name)}\.(\d+)\.[A-Za-z0-9_]+\.(tmp|old)$")
    removed = []
    now = time.time()
    for entry, m in _named_folders(parent, pattern):
        try:
            old = now - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMP_SECONDS
        except OSError:
            continue
        if old or not pid_alive(int(m.group(1))):
            if m.group(2) == "old" and not os.path.lexists(parent / name):
                os.rename(entry.path, parent / name)
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.name)
    return removed


# ------------------------------------------------------------ process folders
#: Open descriptors of this process's folders (``process_folder``), by
#: folder, each holding its folder's lock until the process ends, however it ends.
_held_locks: dict[str, int] = {}


def process_folder(kind: str = "", parent: str | os.PathLike | None = None) -> Path:
    """A fresh folder for this process's working files,
    ``<parent>/onnxtrain-<pid>-[<kind>-]<random>`` (``parent``: the temporary
    folder by default), removed at exit.

    The process holds a lock on it (``flock``) for as long as it lives, and
    the system lets go of the lock when it ends, SIGKILL and the out-of-memory
    killer included, which never run the exit hooks.  So a folder left
    behind is known by its free lock: making a folder removes, beside it,
    the ones of processes gone (``remove_abandoned_folders``), which in
    ``/dev/shm`` would otherwise keep their memory until the machine
    restarts."""
    stem = f"onnxtrain-{os.getpid()}-" + (f"{kind}-" if kind else "")
    folder = Path(tempfile.mkdtemp(prefix=stem, dir=parent))
    _lock(folder)
    atexit.register(_remove_at_exit, folder, os.getpid())
    remove_abandoned_folders(folder.parent)
    return folder


def _remove_at_exit(folder: Path, owner: int) -> None:
    """The exit hook of a process folder: only the process that made it
    removes it (a child forked later runs its parent's hooks as it exits),
    and only when no child it forked still holds the folder's lock: such a
    child may still read the files, and a later sweep removes the folder
    once it is gone too."""
    if os.getpid() != owner:
        return
    fd = _held_locks.pop(str(folder), None)
    if fd is None:  # (never locked: no locks here)
        shutil.rmtree(folder, ignore_errors=True)
        return
    os.close(fd)  # a forked child's copy of it keeps the lock held
    _remove_unheld(folder)


def _lock(folder: Path) -> None:
    """Lock ``folder`` for the rest of this process's life (kept unlocked where that fails)."""
    fd = _locked(folder)
    if fd is not None:
        _held_locks[str(folder)] = fd


def _locked(folder: str | os.PathLike) -> int | None:
    """A descriptor of ``folder`` (never through a link) holding its lock, or
    None: no locks here, the folder gone, or its lock held by someone."""
    if fcntl is None:
        return None
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


_PROCESS_FOLDER = re.compile(r"^onnxtrain-(\d+)-[A-Za-z0-9_-]+$")


def remove_abandoned_folders(parent: str | os.PathLike) -> list[str]:
    """Remove the folders of ``process_folder`` in ``parent`` that no process
    holds any more: this user's, whose process (the pid in the name) is
    gone and whose lock is free.  A live process's folder stays, and so
    does one whose lock is still held (by a child it forked), or whose pid
    names a live process (which may be another one with the same pid: the
    folder is then left for a later sweep)."""
    removed: list[str] = []
    if fcntl is None:
        return removed
    for entry, m in _named_folders(parent, _PROCESS_FOLDER):
        if pid_alive(int(m.group(1))):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        if _remove_unheld(entry.path):
            removed.append(entry.name)
    return removed


def _remove_unheld(folder: str | os.PathLike) -> bool:
    """Remove ``folder`` under its lock, unless someone holds the lock (False)."""
    fd = _locked(folder)
    if fd is None:
        return False
    try:
        shutil.rmtree(folder, ignore_errors=True)
    finally:
        os.close(fd)
    return True


def _named_folders(parent: str | os.PathLike, pattern: re.Pattern) -> list[tuple[os.DirEntry, re.Match]]:
    """The folders (not links) of ``parent`` whose name ``pattern`` matches, with the match."""
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return []
    out = []
    for entry in entries:
        m = pattern.match(entry.name)
        try:
            if m and entry.is_dir(follow_symlinks=False):
                out.append((entry, m))
        except OSError:
            continue
    return out


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (this one included)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0
    return True


def check_folder_target(target: str | os.PathLike, overwrite: bool, how: str = "overwrite=True") -> None:
    """OutputExists (a FileExistsError and a ValueError) unless ``target`` may become a folder ``write_folder`` writes:
    absent, an empty folder, or (``overwrite``) a folder; never a link or a file.
    ``how``: what the message says replaces a non-empty folder."""
    path = os.fspath(target)
    if os.path.islink(path):
        raise OutputExists(f"{path}: exists and is a symbolic link; refusing to write over it "
                              "(give the path of a folder)")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        kind = "a file" if stat.S_ISREG(mode) else "not a regular file or folder"
        raise OutputExists(f"{path}: exists and is {kind}; refusing to write over it "
                              "(give the path of a folder)")
    if not overwrite and any(os.scandir(path)):
        raise OutputExists(f"{path}: the folder exists and is not empty; refusing to write into it "
                              f"(give a new or empty folder, or {how} to replace it)")


def _rename_folder(tmp: Path, target: Path, overwrite: bool) -> None:
    """Rename ``tmp`` to ``target`` (absent, empty, or with ``overwrite`` replaced)."""
    try:
        os.rename(tmp, target)  # absent, or an empty folder (POSIX replaces it)
        return
    except OSError:
        if not target.is_dir() or target.is_symlink():
            raise
        if not any(os.scandir(target)):  # (Windows does not replace an empty folder)
            os.rmdir(target)
            os.rename(tmp, target)
            return
        if not overwrite:
            raise
    if _exchange(tmp, target):  # one atomic step: ``tmp`` now holds the old folder
        shutil.rmtree(tmp, ignore_errors=True)
        return
    # Elsewhere two renames: for a moment ``target`` is absent (the old folder
    # waits beside it as ``.<name>.<pid>.<random>.old``).
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".old",
                                dir=target.parent))
    os.rmdir(old)  # (only its unique name is wanted)
    os.rename(target, old)
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``);
    False where the system or file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), os.fspath(b))


def _temp_pattern(name: str) -> re.Pattern:
    """The temporary files of writes of ``name``, and of its data files (``io.storage``'s ``<name>.<hex>.data``)."""
    data = r"(?:\.[0-9a-f]{8}\.data)?"
    return re.compile(rf"^\.{re.escape(name)}{data}\.(?:(\d+)\.)?[A-Za-z0-9_]+\.tmp$")


def remove_stale_temp_files(folder: str | os.PathLike, name: str) -> list[str]:
    """Remove temporary files that interrupted writes of ``folder/name`` left.

    A temporary file is stale when the process that wrote it (its pid is in
    the name) is gone, or when it is older than a day.  Returns the removed
    names.  Files of live writers are kept, so concurrent exports of other
    paths in the same folder are never disturbed."""
    pattern = _temp_pattern(name)
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        m = pattern.match(entry.name)
        if not m or not entry.is_file(follow_symlinks=False):
            continue
        pid = int(m.group(1)) if m.group(1) else None
        try:
            old = now - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMP_SECONDS
        except OSError:
            continue
        if old or (pid is not None and not pid_alive(pid)):
            try:
                os.unlink(entry.path)
                removed.append(entry.name)
            except OSError:
                pass
    return removed
