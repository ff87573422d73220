"""Data-parallel training: the gradient buffers and the collectives of a step.

A data-parallel session (``TrainingSession(model, comm=...)``) runs each
algorithm as its two cut programs (``onnxtrain.lower.split``): A writes the values
to reduce straight into ``GradientBuffers``, one flat numpy buffer per
dtype that onnxruntime sees as OrtValues through IOBinding (no copies);
``DataParallel.reduce`` scales them and sums them across ranks in place, in
buckets of about ``bucket_bytes``; B reads them from the same memory.

``DataParallel.agree`` is the step's transaction across ranks: every rank
says whether its part succeeded (and how many rows its batch had) before
anything is reduced or committed, so a failure on one rank fails the step on
every rank, names the rank, and commits nothing anywhere, without a hang.

How local gradients combine (``reduction``):

- ``"weighted"`` (default): Σ_r (n_r / N) g_r with n_r the rows of rank r's
  batch and N = Σ n_r: the gradient of a mean-reduced loss over the global
  batch, exactly, uneven last batches included;
- ``"mean"``: (1/size) Σ_r g_r;
- ``"sum"``: Σ_r g_r (for sum-reduced losses).

BatchNormalization running statistics are averaged whatever ``reduction``
says: weighted by rows ("weighted", "sum") or equally ("mean").
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import numpy as np

from ..runtime.executor import wrap_buffer
from .comm import Communicator, agree

REDUCTIONS = ("weighted", "mean", "sum")
#: Default bucket size of the gradient all-reduce (bytes), as PyTorch DDP's.
BUCKET_BYTES = 25 * 2**20


@dataclass
class GradientBuffers:
    """The values one algorithm reduces, laid out in flat buffers per dtype.

    ``views[name]`` is the numpy view of a value, ``ortvalues[name]`` the
    OrtValue over the same memory, ``buckets`` the slices reduced together.
    ``flats`` pairs each flat buffer with whether it holds statistics to
    average (BatchNormalization's) rather than gradients."""

    flats: list[tuple[np.ndarray, bool]]
    views: dict[str, np.ndarray]
    ortvalues: dict[str, Any]
    buckets: list[np.ndarray]

    @classmethod
    def allocate(cls, reduced: Sequence[Any], bucket_bytes: int) -> GradientBuffers:
        groups: dict[tuple[np.dtype, bool], list[Any]] = {}
        for r in reduced:
            groups.setdefault((r.dtype, r.key is not None), []).append(r)
        flats, views, ortvalues, buckets = [], {}, {}, []
        for (dtype, statistics), values in groups.items():
            # Backward passes produce the last layers' gradients first: lay them
            # out first, so the first bucket is the first one complete.
            values = values[::-1]
            flat = np.empty(sum(r.size for r in values), dtype=dtype)
            flats.append((flat, statistics))
            at = 0
            start = 0
            for r in values:
                view = flat[at:at + r.size].reshape(r.shape)
                views[r.name] = view
                ortvalues[r.name] = wrap_buffer(view)
                at += r.size
                if (at - start) * dtype.itemsize >= bucket_bytes:
                    buckets.append(flat[start:at])
                    start = at
            if at > start:
                buckets.append(flat[start:at])
        return cls(flats, views, ortvalues, buckets)


class DataParallel:
    """The collectives of data-parallel steps over one communicator."""

    def __init__(self, comm: Communicator, reduction: str = "weighted",
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self.reduction = reduction
        self.bucket_bytes = bucket_bytes
        #: Seconds spent in collectives since the last ``reset_timing`` (benchmarks).
        self.comm_seconds = 0.0

    def buffers(self, reduced: Sequence[Any]) -> GradientBuffers:
        return GradientBuffers.allocate(reduced, self.bucket_bytes)

    # ----------------------------------------------------------- transaction
    def agree(self, error: BaseException | None, rows: int, what: str) -> int:
        """Every rank's outcome of one phase of the step (``comm.agree``: if
        any rank failed, every rank raises); the global row count."""
        return int(self._timed(agree, self.comm, error, rows, what).sum())

    # ----------------------------------------------------------------- reduce
    def reduce(self, buffers: GradientBuffers, rows: int, total_rows: int) -> None:
        """Combine the ranks' values in place: gradients as ``reduction``
        says, statistics always averaged (by rows, or equally for "mean")."""
        weight = rows / total_rows if total_rows else 1.0 / self.size
        for flat, statistics in buffers.flats:
            if self.reduction == "mean":
                scale = 1.0 / self.size
            elif self.reduction == "weighted" or statistics:
                scale = weight
            else:
                scale = 1.0
            if scale != 1.0:
                np.multiply(flat, flat.dtype.type(scale), out=flat)
        for bucket in buffers.buckets:
            self._timed(self.comm.allreduce_sum, bucket)

    def broadcast_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Rank 0's values of ``arrays`` into every rank's (in place, in key order)."""
        for name in sorted(arrays):
            self.comm.broadcast(arrays[name], 0)

    def _timed(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, its time added to ``comm_seconds``."""
        t = perf_counter()
        try:
            return fn(*args)
        finally:
            self.comm_seconds += perf_counter() - t


def threads_per_rank(local_ranks: int) -> int:
    """onnxruntime intra-op threads for one of ``local_ranks`` ranks on this
    machine: the cores this process may use, shared out (ranks that each spin
    a pool of one thread per core would fight over the cores, and the slowest
    rank sets the pace of every all-reduce).  A launcher that bound the rank
    to some cores (Open MPI's default, ``--map-by ...:PE=n``) has decided:
    all of them."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    if cores < (os.cpu_count() or cores):
        return max(1, cores)
    return max(1, cores // max(1, local_ranks))


def rows_of(feeds: Mapping[str, Any]) -> int:
    """The rows of a batch: the leading dimension of its first non-scalar
    feed (arrays, or anything numpy can take the shape of)."""
    for value in feeds.values():
        shape = np.shape(value)
        if shape:
            return int(shape[0])
    return 1
