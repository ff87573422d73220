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

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Callable


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

    Refused (FileExistsError, before ``fill`` runs, nothing changed): a
    ``target`` that is not a folder (a file, a link, a device), and a
    non-empty folder unless ``overwrite``.  With ``overwrite``, the old folder
    is moved aside, the new one renamed into place (the old one is moved back
    if that fails), then the old one is removed.  Temporary folders are named
    ``.<name>.<pid>.<random>.tmp``."""
    given = target
    target = Path(os.path.abspath(target))
    check_folder_target(given, overwrite)
    parent = target.parent
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


def check_folder_target(target: str | os.PathLike, overwrite: bool, how: str = "overwrite=True") -> None:
    """FileExistsError unless ``target`` may become a folder ``write_folder`` writes:
    absent, an empty folder, or (``overwrite``) a folder; never a link or a file.
    ``how``: what the message says replaces a non-empty folder."""
    path = os.fspath(target)
    if os.path.islink(path):
        raise FileExistsError(f"{path}: exists and is a symbolic link; refusing to write over it "
                              "(give the path of a folder)")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        kind = "a file" if stat.S_ISREG(mode) else "not a regular file or folder"
        raise FileExistsError(f"{path}: exists and is {kind}; refusing to write over it "
                              "(give the path of a folder)")
    if not overwrite and any(os.scandir(path)):
        raise FileExistsError(f"{path}: the folder exists and is not empty; refusing to write into it "
                              f"(give a new or empty folder, or {how} to replace it)")


def _rename_folder(tmp: Path, target: Path, overwrite: bool) -> None:
    """Rename ``tmp`` to ``target`` (absent, empty, or with ``overwrite`` replaced)."""
    try:
        os.rename(tmp, target)  # absent, or an empty folder (POSIX replaces it)
        return
    except OSError:
        if not overwrite or not target.is_dir() or target.is_symlink():
            raise
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
