"""Dedicated CUDA streams for the I/O threads, made through the driver (Note [a side stream of our
own]); :func:`ssdtrain.device.cuda.side_stream` hands them out, one per thread."""

from __future__ import annotations

import ctypes
import logging
import threading

__all__ = ["stream_source"]

log = logging.getLogger("ssdtrain.device.cuda")  # its messages are the seam's


# Note [a side stream of our own]
# I/O copies run on a stream of each I/O thread, never on the compute stream. ``torch.cuda.Stream()``
# does not create a stream: it hands out the next of 32 pooled streams per priority per device,
# round robin, to everyone in the process -- a framework's collective or prefetch stream can be
# the same CUDA stream as ours. Then our copies queue behind its work, its work queues behind
# our fences, and our synchronisation waits for both. So each I/O thread gets a stream created
# for ssdtrain alone through the driver (``cuStreamCreateWithPriority``, non-blocking: the legacy
# default stream, where most training computes, neither waits for it nor makes it wait) and
# wrapped with ``torch.cuda.ExternalStream``. Streams are never destroyed: torch's pinned-memory
# allocator records events on every stream a pinned block was copied on when the block is freed,
# which may happen after the thread is gone. A thread that ends gives its stream back to a
# process-wide free list, so threads of later offloaders reuse it (one stream per I/O thread
# alive at once, at most). Where the driver cannot be reached, a pooled stream is used and
# :func:`stream_source` says so.
class _DriverStreams:
    """Dedicated CUDA streams from the driver API, reused across threads, never destroyed."""

    CU_STREAM_NON_BLOCKING = 1

    def __init__(self, libname: str = "libcuda.so.1") -> None:
        self._lib = ctypes.CDLL(libname)
        for name in ("cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease_v2", "cuCtxPushCurrent_v2",
                     "cuCtxPopCurrent_v2", "cuStreamCreateWithPriority"):
            getattr(self._lib, name)  # AttributeError now, not halfway through creating a stream
        self._lock = threading.Lock()
        self._free: dict[int, list[int]] = {}

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self._lib.cuGetErrorName(rc, ctypes.byref(name))
            raise RuntimeError(f"{what} failed: {(name.value or b'?').decode()} ({rc})")

    def take(self, index: int) -> int:
        with self._lock:
            free = self._free.get(index)
            if free:
                return free.pop()
        lib = self._lib
        dev, ctx, popped, stream = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        self._check(lib.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
        # The primary context is the one the CUDA runtime, and so torch, uses.
        self._check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        try:
            self._check(lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
            try:
                self._check(lib.cuStreamCreateWithPriority(ctypes.byref(stream), self.CU_STREAM_NON_BLOCKING, 0),
                            "cuStreamCreateWithPriority")
            finally:
                lib.cuCtxPopCurrent_v2(ctypes.byref(popped))
        finally:
            lib.cuDevicePrimaryCtxRelease_v2(dev)  # the runtime keeps its own reference
        return int(stream.value)

    def give_back(self, index: int, handle: int) -> None:
        with self._lock:
            self._free.setdefault(index, []).append(handle)


class _Lease:
    """A dedicated stream held by this thread; back to the free list when the thread ends."""

    def __init__(self, streams: _DriverStreams, index: int, handle: int) -> None:
        self.streams, self.index, self.handle = streams, index, handle

    def __del__(self) -> None:
        try:
            self.streams.give_back(self.index, self.handle)
        except Exception:  # interpreter shutdown
            pass


_driver_lock = threading.Lock()
_driver: list = []  # [streams or None, where streams come from]: process-wide, as streams are


def _driver_streams() -> _DriverStreams | None:
    with _driver_lock:
        if not _driver:
            try:
                _driver[:] = [_DriverStreams(), "dedicated"]
            except (OSError, AttributeError) as e:
                _driver[:] = [None, f"pool (the CUDA driver library cannot be used: {e})"]
                log.info("ssdtrain: I/O streams come from torch's pool: %s", e)
        return _driver[0]


def pool_instead(why: str) -> None:
    """Streams come from torch's pool from now on (``why``: the driver's pool failed to give one)."""
    with _driver_lock:
        _driver[:] = [None, f"pool ({why})"]
    log.info("ssdtrain: I/O streams come from torch's pool: %s", why)


def stream_source() -> str:
    """Where I/O side streams come from: ``"dedicated"`` (Note [a side stream of our own]) or
    ``"pool (why)"``; ``"none yet"`` before the first one was made."""
    with _driver_lock:
        return _driver[1] if _driver else "none yet"
