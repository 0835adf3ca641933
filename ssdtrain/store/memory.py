"""Host RAM as the store: for tests, and for GPU users without NVMe (activations go to host)."""

from __future__ import annotations

import ctypes
import itertools
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import Future

import torch

from ssdtrain.device import cuda as device
from ssdtrain.config import OffloadConfig
from ssdtrain.store._mem import host_view
from ssdtrain.store._pool import IOPool
from ssdtrain.store.base import Backend, ChecksumError, Extent


class MemoryBackend(Backend):
    """Copies tensors into host memory (pinned for CUDA tensors) on I/O threads."""

    name = "memory"

    def __init__(self, cfg: OffloadConfig) -> None:
        self._ids = itertools.count()
        self._blobs: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._pool = IOPool(cfg.io_threads, "ssdtrain-mem")
        self._written = 0
        self._closed = False
        self._watch_fork()  # no threads in a forked child (Note [an offloader does not cross a fork])

    def allocate(self, nbytes: int) -> Extent:
        self._check_process()
        return Extent(0, next(self._ids), nbytes, nbytes)

    def free(self, extent: Extent) -> None:
        self._check_process()
        with self._lock:
            self._blobs.pop(extent.offset, None)

    def submit_write(self, extent: Extent, src: torch.Tensor, *, checksum: bool = False,
                     ready: Callable[[], None] | None = None) -> Future:
        self._check_process()

        def work() -> int | None:
            if ready is not None:
                ready()
            if device.is_cuda(src):
                blob = device.pinned_empty(extent.nbytes)
                device.copy_on_side_stream(blob, src)
            else:
                blob = torch.empty(extent.nbytes, dtype=torch.uint8)
                ctypes.memmove(blob.data_ptr(), src.data_ptr(), extent.nbytes)  # no OpenMP team here
            with self._lock:
                self._blobs[extent.offset] = blob
                self._written += extent.nbytes
            return zlib.crc32(host_view(blob, 0, extent.nbytes)) if checksum else None
        return self._pool.submit(work)

    def submit_read(self, extent: Extent, dst: torch.Tensor, *, checksum: object = None,
                    ready: Callable[[], None] | None = None) -> Future:
        self._check_process()

        def work() -> None:
            if ready is not None:
                ready()
            with self._lock:
                blob = self._blobs[extent.offset]
            if checksum is not None and zlib.crc32(host_view(blob, 0, extent.nbytes)) != checksum:
                raise ChecksumError(5, f"checksum mismatch reading {extent.nbytes} bytes from host memory")
            if device.is_cuda(dst):
                device.copy_on_side_stream(dst, blob)
            else:
                ctypes.memmove(dst.data_ptr(), blob.data_ptr(), extent.nbytes)
        return self._pool.submit(work)

    def written_bytes_by_path(self) -> dict[str, int]:
        return {"<memory>": self._written}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=not self._forked)
            self._blobs.clear()
