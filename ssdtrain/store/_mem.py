"""Small helpers shared by the backends: raw byte views of tensors, joining chunk futures."""

from __future__ import annotations

import contextlib
import ctypes
import threading
from concurrent.futures import Future

import torch

from ssdtrain.store._pool import IOFuture


def profiled(name: str):
    """A ``torch.profiler`` range while a profiler runs; nothing otherwise (the I/O path is hot)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def host_view(t: torch.Tensor, start: int, n: int) -> memoryview:
    """A writable memoryview of ``n`` bytes of a CPU tensor's memory, from byte ``start``.

    The caller keeps ``t`` alive while the view is used (it does not hold a reference).
    """
    assert t.device.type == "cpu", "host_view needs host memory"
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr() + start)).cast("B")


def capacity(t: torch.Tensor) -> int:
    """Bytes of the storage available from ``t``'s first byte on (room for padded direct I/O)."""
    return t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()


def gather(futures: list[Future], *, flatten: bool = False) -> Future:
    """A future that completes when every one of ``futures`` has: with their results (joined
    into one list with ``flatten``, for futures whose results are lists), or with the first
    exception. It never completes while a chunk is still in flight, so an extent is not freed
    (and reused) under a late write."""
    out = IOFuture()  # Note [no Python-level lock on the training thread]
    if not futures:
        out.set_result([])
        return out
    results: list = [None] * len(futures)
    errors: list[BaseException] = []
    left = [len(futures)]
    lock = threading.Lock()

    def done(i: int, f: Future) -> None:
        exc = f.exception()
        with lock:
            if exc is not None:
                errors.append(exc)
            else:
                results[i] = f.result()
            left[0] -= 1
            last = left[0] == 0
        if last:
            if errors:
                out.set_exception(errors[0])
            else:
                out.set_result([x for r in results for x in r] if flatten else results)

    for i, f in enumerate(futures):
        f.add_done_callback(lambda f, i=i: done(i, f))
    return out
