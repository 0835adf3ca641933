"""A drive of a set speed around any backend: writes and reads finish no sooner than they would
on a drive that moves ``write_bps`` and ``read_bps`` bytes per second.

``ssdtrain bench --drive-gbps X`` uses it (where no blkio cgroup can throttle the real drive) to
show the drive-limited regime on any machine, and tests use it with a fake clock::

    store = ThrottledBackend(make_backend(cfg), write_bps=1e8, read_bps=1e8)   # 0.1 GB/s each way
    off = ssdtrain.Offloader(model, config=cfg, store=store)

Each direction is a virtual drive with one queue, like blkio's separate ``read_bps_device`` and
``write_bps_device`` caps: a request of ``n`` bytes submitted at ``now`` completes, in the
model, at ``max(now, completion of the previous request in that direction) + n / bps``, so
requests queued together serialise as on a saturated drive, and a drive left idle does not bank
credit. The inner backend runs the request at once; the future returned resolves only when both
the modelled time has come and the inner I/O is done. A failed inner request fails its future at
once (its time on the virtual drive stays taken). After :meth:`ThrottledBackend.close` begins,
nothing waits for modelled time any more: futures resolve when their inner I/O is done.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from typing import Any

import torch

from ssdtrain.store._pool import IOFuture
from ssdtrain.store.base import Backend, Extent

__all__ = ["ThrottledBackend"]


class _Pending:
    """One request: resolves its future when the modelled time has come and the inner I/O is done."""

    __slots__ = ("future", "_inner", "_left", "_lock")

    def __init__(self) -> None:
        self.future = IOFuture()  # Note [no Python-level lock on the training thread]
        self._inner: Future | None = None
        self._left = 2  # the modelled time, and the inner I/O
        self._lock = threading.Lock()

    def inner_done(self, inner: Future) -> None:
        with self._lock:
            self._inner = inner
            failed = inner.cancelled() or inner.exception() is not None
            self._left = 0 if failed else self._left - 1
            done = self._left == 0
        if done:
            self._resolve(inner)

    def time_come(self) -> None:
        with self._lock:
            if self._left == 0:  # failed already
                return
            self._left -= 1
            inner = self._inner if self._left == 0 else None
        if inner is not None:
            self._resolve(inner)

    def _resolve(self, inner: Future) -> None:
        exc = CancelledError() if inner.cancelled() else inner.exception()
        if exc is not None:
            self.future.set_exception(exc)
        else:
            self.future.set_result(inner.result())


class _VirtualDrive:
    """One direction of the drive: a FIFO whose requests complete ``n / bps`` seconds apart."""

    def __init__(self, name: str, bps: float, clock: Callable[[], float], sleep: Callable[[float], Any] | None) -> None:
        self.name = name
        self.bps = bps
        self._clock = clock
        self._wake = threading.Event()  # set by close(): the default sleep returns at once
        self._sleep = sleep if sleep is not None else self._wake.wait
        self._busy_until = -math.inf  # modelled completion of the last request admitted
        self._queue: deque[tuple[float, _Pending]] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None

    def admit(self, nbytes: int, pending: _Pending) -> float:
        """Queues a request; returns its modelled completion time."""
        with self._cond:
            if self._closing:
                pending.time_come()
                return self._clock()
            self._busy_until = max(self._clock(), self._busy_until) + nbytes / self.bps
            self._queue.append((self._busy_until, pending))  # deadlines only grow: FIFO order
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"ssdtrain-throttle-{self.name}", daemon=True)
                self._thread.start()
            self._cond.notify()
            return self._busy_until

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                deadline, pending = self._queue[0]
                closing = self._closing
            if not closing:
                remaining = deadline - self._clock()
                if remaining > 0:
                    self._sleep(remaining)  # may return early (close, a fake clock): look again
                    continue
            with self._cond:
                self._queue.popleft()
            pending.time_come()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
            thread = self._thread
        self._wake.set()
        if thread is not None:
            thread.join()


class ThrottledBackend(Backend):
    """Wraps ``inner`` so that its writes and reads take as long as on a drive of the given speed.

    Args:
        inner: any :class:`~ssdtrain.store.Backend`; allocation, freeing, buffers and counters
            are its own.
        write_bps: bytes per second the virtual drive writes (``math.inf``: no limit).
        read_bps: bytes per second it reads. The two caps are separate, like blkio's
            ``write_bps_device`` and ``read_bps_device``: a drive that writes at its cap can
            still read at its cap.
        clock: the time, in seconds (``time.monotonic``; tests pass a fake one).
        sleep: called as ``sleep(seconds)`` by the scheduler threads to wait for modelled time;
            it may return early. Default: a wait on real time that :meth:`close` interrupts.
            With a fake clock, make it return when the fake time moves.

    One scheduler thread per direction, started with its first request.
    """

    def __init__(self, inner: Backend, *, write_bps: float, read_bps: float,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], Any] | None = None) -> None:
        for name, value in (("write_bps", write_bps), ("read_bps", read_bps)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"ThrottledBackend.{name} must be a positive number of bytes per second "
                                 f"(math.inf for no limit), got {value!r}")
        self.inner = inner
        self.name = inner.name
        self.write_bps = float(write_bps)
        self.read_bps = float(read_bps)
        self._write = _VirtualDrive("write", self.write_bps, clock, sleep)
        self._read = _VirtualDrive("read", self.read_bps, clock, sleep)
        self._closed = False

    def allocate(self, nbytes: int) -> Extent:
        return self.inner.allocate(nbytes)

    def free(self, extent: Extent) -> None:
        self.inner.free(extent)

    def submit_write(self, extent: Extent, src: torch.Tensor, *, checksum: bool = False,
                     ready: Callable[[], None] | None = None) -> Future:
        inner = self.inner.submit_write(extent, src, checksum=checksum, ready=ready)
        return self._throttle(self._write, extent.nbytes, inner)

    def submit_read(self, extent: Extent, dst: torch.Tensor, *, checksum: object = None,
                    ready: Callable[[], None] | None = None) -> Future:
        inner = self.inner.submit_read(extent, dst, checksum=checksum, ready=ready)
        return self._throttle(self._read, extent.nbytes, inner)

    @staticmethod
    def _throttle(drive: _VirtualDrive, nbytes: int, inner: Future) -> Future:
        pending = _Pending()
        if math.isinf(drive.bps):
            pending.time_come()
        else:
            drive.admit(nbytes, pending)
        inner.add_done_callback(pending.inner_done)
        return pending.future

    def alloc_buffer(self, nbytes: int, device: torch.device, extent: Extent | None = None) -> torch.Tensor:
        return self.inner.alloc_buffer(nbytes, device, extent=extent)

    def written_bytes_by_path(self) -> dict[str, int]:
        return self.inner.written_bytes_by_path()

    def heal(self) -> None:
        self.inner.heal()

    def describe(self) -> str:
        return (f"{self.inner.describe()}, throttled to write {_gbps(self.write_bps)}, "
                f"read {_gbps(self.read_bps)}")

    def close(self) -> None:
        """Stops waiting for modelled time, then closes the inner backend (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._write.close()
        self._read.close()
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        # Anything else a backend offers (a backend's own extras) is the inner backend's.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def _gbps(bps: float) -> str:
    return "unlimited" if math.isinf(bps) else f"{bps / 1e9:.3g} GB/s"
