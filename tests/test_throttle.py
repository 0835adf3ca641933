"""Tests for ssdtrain/store/throttle.py: a backend slowed to a drive of a set speed."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
import torch

from ssdtrain.config import OffloadConfig
from ssdtrain.store import StorageError, make_backend
from ssdtrain.store.base import Backend, Extent
from ssdtrain.store.throttle import ThrottledBackend


class FakeClock:
    """Time that moves only when the test says; ``sleep`` returns whenever it moved (or soon)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._cond = threading.Condition()

    def __call__(self) -> float:
        with self._cond:
            return self.now

    def sleep(self, seconds: float) -> None:
        with self._cond:
            self._cond.wait(0.05)  # the scheduler looks at the clock again either way

    def advance_to(self, t: float) -> None:
        with self._cond:
            self.now = t
            self._cond.notify_all()


class HandDriven(Backend):
    """A backend whose requests finish when the test completes them (or at once)."""

    name = "hand"

    def __init__(self, instant: bool = True) -> None:
        self.instant = instant
        self.futures: list[Future] = []
        self.closed = False

    def allocate(self, nbytes):
        return Extent(0, 0, nbytes, nbytes)

    def free(self, extent):
        pass

    def _submit(self):
        f = Future()
        if self.instant:
            f.set_result(None)
        self.futures.append(f)
        return f

    def submit_write(self, extent, src, *, checksum=False, ready=None):
        return self._submit()

    def submit_read(self, extent, dst, *, checksum=None, ready=None):
        return self._submit()

    def close(self):
        self.closed = True


def _ext(n):
    return Extent(0, 0, n, n)


def _stamp(future, clock, times, key):
    future.add_done_callback(lambda f: times.__setitem__(key, clock()))


def test_requests_complete_when_a_drive_of_that_speed_would_finish_them():
    clock = FakeClock()
    store = ThrottledBackend(HandDriven(), write_bps=100, read_bps=200, clock=clock, sleep=clock.sleep)
    times: dict[str, float] = {}
    buf = torch.empty(0, dtype=torch.uint8)
    a = store.submit_write(_ext(100), buf)  # 0 + 1.0
    b = store.submit_write(_ext(50), buf)  # queued behind a: 1.0 + 0.5
    r = store.submit_read(_ext(200), buf)  # the other direction, its own queue: 0 + 1.0
    for key, f in (("a", a), ("b", b), ("r", r)):
        _stamp(f, clock, times, key)
    assert not a.cancel()  # issued: like a running I/O task
    clock.advance_to(0.99)
    time.sleep(0.1)
    assert not (a.done() or b.done() or r.done())
    clock.advance_to(1.0)
    a.result(timeout=5), r.result(timeout=5)
    assert not b.done()
    clock.advance_to(1.5)
    b.result(timeout=5)
    assert times == {"a": 1.0, "r": 1.0, "b": 1.5}
    # An idle drive banks no credit: the next request starts now, not at b's completion.
    clock.advance_to(5.0)
    c = store.submit_write(_ext(200), buf)
    _stamp(c, clock, times, "c")
    clock.advance_to(6.5)
    time.sleep(0.1)
    assert not c.done()
    clock.advance_to(7.0)
    c.result(timeout=5)
    assert times["c"] == 7.0
    store.close()
    assert store.inner.closed


def test_a_request_waits_for_its_inner_io_and_failures_come_at_once():
    clock = FakeClock()
    inner = HandDriven(instant=False)
    store = ThrottledBackend(inner, write_bps=100, read_bps=100, clock=clock, sleep=clock.sleep)
    buf = torch.empty(0, dtype=torch.uint8)
    slow = store.submit_write(_ext(100), buf)
    failing = store.submit_write(_ext(100), buf)
    clock.advance_to(1.5)
    time.sleep(0.1)
    assert not slow.done()  # its modelled time has come, the inner write has not finished
    inner.futures[0].set_result("crc")
    assert slow.result(timeout=5) == "crc"
    inner.futures[1].set_exception(StorageError(5, "boom"))  # modelled for t=2.0, fails now
    with pytest.raises(StorageError, match="boom"):
        failing.result(timeout=5)
    store.close()


def test_close_stops_waiting_for_modelled_time():
    store = ThrottledBackend(HandDriven(), write_bps=1, read_bps=1)  # 1 byte/s, real clock
    f = store.submit_write(_ext(3600), torch.empty(0, dtype=torch.uint8))
    start = time.monotonic()
    store.close()
    f.result(timeout=5)
    assert time.monotonic() - start < 5


def test_bad_rates_name_the_field():
    with pytest.raises(ValueError, match="write_bps"):
        ThrottledBackend(HandDriven(), write_bps=0, read_bps=1)
    with pytest.raises(ValueError, match="read_bps"):
        ThrottledBackend(HandDriven(), write_bps=1, read_bps=-5)


def test_memory_backend_at_100_mb_per_s(tmp_path):
    inner = make_backend(OffloadConfig(backend="memory", path=str(tmp_path)))
    store = ThrottledBackend(inner, write_bps=100e6, read_bps=100e6)
    assert store.name == "memory" and "throttled to write 0.1 GB/s" in store.describe()
    src = torch.randint(0, 256, (10_000_000,), dtype=torch.uint8)
    ext = store.allocate(src.numel())
    start = time.monotonic()
    store.submit_write(ext, src).result(timeout=30)
    assert time.monotonic() - start >= 0.1
    dst = store.alloc_buffer(src.numel(), src.device, extent=ext)
    start = time.monotonic()
    store.submit_read(ext, dst).result(timeout=30)
    assert time.monotonic() - start >= 0.1
    assert torch.equal(src, dst)
    store.free(ext)
    store.close()
