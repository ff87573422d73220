"""Communicators for data-parallel training: the few collectives it needs.

``TrainingSession(model, comm=...)`` takes an mpi4py communicator (wrapped in
``MPICommunicator``; mpi4py is imported only then) or any ``Communicator``.
``local_group(n)`` makes ``n`` communicators whose ranks are threads of one
process: a simulated MPI world for tests and for trying things out.

Every collective is called by every rank in the same order.  Buffers are
numpy arrays, reduced or broadcast in place (no pickling on the hot path).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ..errors import DistributedStepError


class Communicator:
    """The collectives data-parallel training uses (all blocking, all in place)."""

    rank: int = 0
    size: int = 1

    def allreduce_sum(self, buf: np.ndarray) -> None:
        """Replace ``buf`` (contiguous) by its elementwise sum over the ranks."""
        raise NotImplementedError

    def broadcast(self, buf: np.ndarray, root: int = 0) -> None:
        """Copy ``root``'s ``buf`` into every rank's ``buf``."""
        raise NotImplementedError

    def allgather(self, row: np.ndarray) -> np.ndarray:
        """Every rank's int64 ``row``, stacked by rank: shape [size, len(row)]."""
        raise NotImplementedError

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's (picklable) ``obj``, by rank; for messages, off the hot path."""
        raise NotImplementedError

    def local_size(self) -> int:
        """How many ranks share this machine (collective); they share its cores."""
        return self.size

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"


class MPICommunicator(Communicator):
    """An mpi4py communicator (``MPI.COMM_WORLD`` or any other intracommunicator)."""

    def __init__(self, comm: Any) -> None:
        try:
            from mpi4py import MPI
        except ImportError as exc:  # pragma: no cover - comm= given without mpi4py
            raise ImportError(
                "data-parallel training needs mpi4py: pip install 'onnxtrain[mpi]'"
            ) from exc
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(
                f"comm must be an mpi4py intracommunicator (e.g. MPI.COMM_WORLD) or an "
                f"onnxtrain.comm.Communicator, not {type(comm).__name__}"
            )
        self._MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()

    def allreduce_sum(self, buf: np.ndarray) -> None:
        if self.size > 1:
            self.comm.Allreduce(self._MPI.IN_PLACE, buf, op=self._MPI.SUM)

    def broadcast(self, buf: np.ndarray, root: int = 0) -> None:
        if self.size > 1:
            self.comm.Bcast(buf, root=root)

    def allgather(self, row: np.ndarray) -> np.ndarray:
        row = np.ascontiguousarray(row, dtype=np.int64)
        out = np.empty((self.size, row.size), dtype=np.int64)
        self.comm.Allgather(row, out)
        return out

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.comm.allgather(obj)

    def local_size(self) -> int:
        node = self.comm.Split_type(self._MPI.COMM_TYPE_SHARED)
        try:
            return node.Get_size()
        finally:
            node.Free()


def world() -> MPICommunicator:
    """``MPI.COMM_WORLD`` as a Communicator; ImportError without mpi4py."""
    from mpi4py import MPI

    return MPICommunicator(MPI.COMM_WORLD)


class SingleProcess(Communicator):
    """A world of one: every collective is the identity (the memory-lean
    mode's cut step runs through the data-parallel path with it)."""

    def allreduce_sum(self, buf: np.ndarray) -> None:
        pass

    def broadcast(self, buf: np.ndarray, root: int = 0) -> None:
        pass

    def allgather(self, row: np.ndarray) -> np.ndarray:
        return np.asarray(row, dtype=np.int64).reshape(1, -1)

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]


def as_communicator(comm: Any) -> Communicator:
    """``comm`` as a Communicator (an mpi4py communicator is wrapped)."""
    return comm if isinstance(comm, Communicator) else MPICommunicator(comm)


def agree(comm: Communicator, error: BaseException | None, value: int = 0,
          what: str = "the step") -> np.ndarray:
    """Every rank's outcome of a phase; every rank's ``value`` if all succeeded.

    If any rank failed, every rank raises: the failing ones their own
    ``error``, the others ``DistributedStepError`` naming the failing ranks
    and their messages.  Called by every rank, so nobody waits forever."""
    table = comm.allgather(np.array([error is None, value], dtype=np.int64))
    failed = [r for r in range(comm.size) if not table[r, 0]]
    if failed:
        mine = None if error is None else f"{type(error).__name__}: {error}"
        messages = comm.allgather_object(mine)
        if error is not None:
            raise error
        named = "; ".join(f"rank {r}: {messages[r]}" for r in failed)
        raise DistributedStepError(
            f"{what} failed on rank{'s' if len(failed) > 1 else ''} "
            f"{', '.join(map(str, failed))} ({named}); nothing was committed on any rank",
            failed,
        )
    return table[:, 1]


def together(comm: Communicator, what: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on every rank: its result, or, if it raised on any rank,
    an error on every rank (see ``agree``)."""
    error, result = None, None
    try:
        result = fn(*args)
    except Exception as exc:
        error = exc
    agree(comm, error, 0, what)
    return result


# ------------------------------------------------------------- simulated world
class _World:
    """What the threads of a local group share: one slot per rank, two barriers."""

    def __init__(self, size: int, timeout: float) -> None:
        self.size = size
        self.slots: list[Any] = [None] * size
        self.gathered = threading.Barrier(size, timeout=timeout)
        self.read = threading.Barrier(size, timeout=timeout)

    def exchange(self, rank: int, value: Any) -> list[Any]:
        """Every rank's ``value``, by rank (a barrier before and after reading)."""
        self.slots[rank] = value
        self.gathered.wait()
        values = list(self.slots)
        self.read.wait()
        return values


class LocalCommunicator(Communicator):
    """One rank of ``local_group``: ranks are threads of this process.

    Sums are taken in rank order, so every rank gets the same bits."""

    def __init__(self, world: _World, rank: int) -> None:
        self._world = world
        self.rank = rank
        self.size = world.size

    def allreduce_sum(self, buf: np.ndarray) -> None:
        if self.size == 1:
            return
        values = self._world.exchange(self.rank, np.array(buf, copy=True))
        total = values[0].copy()
        for v in values[1:]:
            total += v
        buf[...] = total

    def broadcast(self, buf: np.ndarray, root: int = 0) -> None:
        if self.size == 1:
            return
        values = self._world.exchange(self.rank, np.array(buf, copy=True))
        buf[...] = values[root]

    def allgather(self, row: np.ndarray) -> np.ndarray:
        values = self._world.exchange(self.rank, np.asarray(row, dtype=np.int64).copy())
        return np.stack(values)

    def allgather_object(self, obj: Any) -> list[Any]:
        return self._world.exchange(self.rank, obj)


def local_group(size: int, timeout: float = 60.0) -> list[LocalCommunicator]:
    """``size`` communicators of one simulated world, one per rank: run each
    rank in its own thread.  A rank that does not reach a collective within
    ``timeout`` seconds breaks it for all (``threading.BrokenBarrierError``)."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"local_group: size must be a positive integer, got {size!r}")
    world = _World(size, timeout)
    return [LocalCommunicator(world, r) for r in range(size)]
