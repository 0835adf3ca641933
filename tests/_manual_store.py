"""A store whose writes and reads complete only when the test says so (or when waited on)."""

from __future__ import annotations

import itertools
from concurrent.futures import Future

import torch

from ssdtrain.store.base import Backend, Extent, StorageError


class _ReadFuture(Future):
    """A read completes when someone waits for it: the 'read-complete' event, on demand."""

    def __init__(self, finish):
        super().__init__()
        self._finish = finish

    def exception(self, timeout=None):
        if not self.done():
            self._finish(self)
        return super().exception(timeout)

    def result(self, timeout=None):
        if not self.done():
            self._finish(self)
        return super().result(timeout)


class ManualStore(Backend):
    name = "manual"

    def __init__(self, read_error: bool = False):
        self._ids = itertools.count()
        self.blobs: dict[int, torch.Tensor] = {}
        self.live: set[int] = set()
        self.writing: set[int] = set()
        self.pending_writes: list[tuple[Extent, torch.Tensor, Future]] = []
        self.pending_reads: list[tuple[Extent, torch.Tensor, Future]] = []
        self.written = 0
        self.closed = False

    def allocate(self, nbytes: int) -> Extent:
        e = Extent(0, next(self._ids), nbytes, nbytes)
        self.live.add(e.offset)
        return e

    def free(self, extent: Extent) -> None:
        assert extent.offset in self.live, "extent freed twice or never allocated"
        assert extent.offset not in self.writing, "extent freed while a write into it is in flight"
        assert not any(x.offset == extent.offset for x, _, f in self.pending_reads if not f.done()), \
            "extent freed while a read from it is in flight"
        self.live.discard(extent.offset)
        self.blobs.pop(extent.offset, None)

    def submit_write(self, extent, src, *, checksum=False, ready=None) -> Future:
        fut: Future = Future()
        fut.set_running_or_notify_cancel()
        self.writing.add(extent.offset)
        self.pending_writes.append((extent, src, fut))
        return fut

    def complete_write(self, i: int, *, fail: bool = False) -> None:
        extent, src, fut = self.pending_writes.pop(i)
        self.writing.discard(extent.offset)
        if fail:
            fut.set_exception(StorageError(28, "No space left on device (injected)"))
        else:
            self.blobs[extent.offset] = src.clone()
            self.written += extent.nbytes
            fut.set_result(None)

    def submit_read(self, extent, dst, *, checksum=None, ready=None) -> Future:
        fut = _ReadFuture(self._finish_read)
        fut.set_running_or_notify_cancel()
        fut.extent, fut.dst = extent, dst
        self.pending_reads.append((extent, dst, fut))
        return fut

    def _finish_read(self, fut) -> None:
        for i, (_, _, f) in enumerate(self.pending_reads):
            if f is fut:
                self.complete_read(i)
                return

    def complete_read(self, i: int, *, fail: bool = False) -> None:
        extent, dst, fut = self.pending_reads.pop(i)
        assert extent.offset in self.blobs, "read of an extent that was never written"
        if fail:
            dst.fill_(0xEE)  # whatever a failed read leaves behind must never be used
            fut.set_exception(StorageError(5, "Input/output error (injected)"))
            return
        dst.copy_(self.blobs[extent.offset])
        fut.set_result(None)

    def close(self) -> None:
        self.closed = True
