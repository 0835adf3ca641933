"""Note [a batch of copies releases the GIL once] (``ssdtrain/device/copies.py``): the compiled
loops (``memcpy_many``, ``call_copies`` in ``cuda_ext/_cpack.c``) make the same copies, in the same
order, as one ctypes call a copy; the runtime's loop stops at the first error, which goes the way a
ctypes call's did (cleared, a warning, torch from then on)."""

import contextlib
import ctypes
import threading

import pytest
import torch

from ssdtrain import _ext
from ssdtrain.device import copies

from test_tier import _Fence, _Stream
from test_tier import _Runtime as _TierRuntime

NATIVE, WHY = _ext.compiled()
needs_build = pytest.mark.skipif(NATIVE is None, reason=f"the compiled module: {WHY}")


def _chain(n=4096):
    """Overlapping copies whose result depends on their order: a buffer shifted twice."""
    buf = torch.arange(3 * n, dtype=torch.int32).view(torch.uint8).clone()
    base = buf.data_ptr()
    jobs = [(base + 4 * n, base, 4 * n), (base + 8 * n, base + 4 * n, 4 * n), (base + 2, base + 1, 10)]
    return buf, jobs


@pytest.mark.parametrize("native", [True, False])
def test_host_copies_are_made_in_order(monkeypatch, native):
    if native and NATIVE is None:
        pytest.skip(f"the compiled module: {WHY}")
    monkeypatch.setattr(copies, "_native", NATIVE if native else False)
    buf, jobs = _chain()
    ref = buf.clone()
    for dst, src, n in jobs:  # the reference: byte by byte, in order, as Python sees it
        d, s = dst - buf.data_ptr(), src - buf.data_ptr()
        ref[d:d + n] = ref[s:s + n].clone()
    copies.copy_host(jobs)
    assert torch.equal(buf, ref)


@needs_build
def test_host_copies_let_other_threads_run():
    """The GIL is released for the batch: a thread waiting for it runs meanwhile."""
    n = 64 << 20
    src, dst = torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    ran = []
    started = threading.Event()

    def other():
        started.set()
        while not ran or ran[-1] < 10**6:
            ran.append(len(ran))
            if len(ran) > 10**6:
                break

    t = threading.Thread(target=other)
    t.start()
    started.wait()
    before = len(ran)
    NATIVE.memcpy_many([(dst.data_ptr(), src.data_ptr(), n)] * 8)  # ~0.5 GB: tens of milliseconds
    during = len(ran) - before
    t.join()
    assert torch.equal(dst, src)
    assert during > 0


@needs_build
def test_bad_copies_are_refused_before_any_is_made():
    buf = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(TypeError, match="tuple"):
        NATIVE.memcpy_many([(buf.data_ptr(), buf.data_ptr() + 8, 8), [1, 2, 3]])
    with pytest.raises(TypeError):
        NATIVE.memcpy_many(5)
    with pytest.raises(ValueError, match="no function"):
        NATIVE.call_copies(0, 0, 4, [])


_COPY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                         ctypes.c_void_p)


_WAIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)


class _Runtime(_TierRuntime):
    """test_tier's stand-in runtime, with ``cudaMemcpyAsync`` and ``cudaStreamWaitEvent`` C
    functions too (their addresses in ``memcpy_async_address`` and ``wait_event_address``, as
    ``copies._load_cudart`` sets them) that record each call and answer ``fail`` from the call
    after the ``fail_at``-th on (waits and copies counted together)."""

    def __init__(self, fail_at=None, fail=700):
        super().__init__([])

        def answer():
            return fail if fail_at is not None and len(self.calls) > fail_at else 0

        def memcpy(dst, src, n, kind, stream):
            self.calls.append(("copy", dst, src, n, kind, stream))
            return answer()

        def wait(stream, event, flags):
            self.calls.append(("wait", stream, event, flags))
            return answer()

        self._fn, self._wait = _COPY(memcpy), _WAIT(wait)  # kept alive with the runtime
        self.memcpy_async_address = ctypes.cast(self._fn, ctypes.c_void_p).value
        self.wait_event_address = ctypes.cast(self._wait, ctypes.c_void_p).value
        self.cudaMemcpyAsync, self.cudaStreamWaitEvent = memcpy, wait


def _stand_ins(monkeypatch, rt, native):
    monkeypatch.setattr(copies, "_on", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(copies, "side_stream", lambda dev: _Stream())
    monkeypatch.setattr(copies, "Fence", lambda stream: "landed")
    monkeypatch.setattr(copies, "_FENCE", _Fence)
    monkeypatch.setattr(copies, "_runtime", rt)
    monkeypatch.setattr(copies, "_native", native)


@pytest.mark.parametrize("native", [True, False])
def test_copies_to_the_pool_are_the_same_calls_either_way(monkeypatch, native):
    """The compiled loop calls the runtime's function by its address with the arguments the
    ctypes loop gave it, in the same order, after the same fence waits."""
    if native and NATIVE is None:
        pytest.skip(f"the compiled module: {WHY}")
    rt = _Runtime()
    _stand_ins(monkeypatch, rt, NATIVE if native else False)
    srcs = [torch.zeros(n, dtype=torch.uint8) for n in (100, 200, 300)]
    first, second = _Fence(0xA1), _Fence(0xA2)
    assert copies.queue_to_host([0x10000, 0x20000, 0x30000], srcs, [first, first, second]) == "landed"
    assert rt.calls == [("wait", 0x5000, 0xA1, 0), ("wait", 0x5000, 0xA2, 0)] + [
        ("copy", a, s.data_ptr(), s.nbytes, 4, 0x5000) for a, s in zip((0x10000, 0x20000, 0x30000), srcs)]


@needs_build
def test_the_compiled_loop_stops_at_the_first_error_and_falls_back(monkeypatch, caplog):
    """The second copy fails: no third is made, the error is cleared and said, None is answered
    (the caller queues the batch through torch) and the runtime is not used again."""
    rt = _Runtime(fail_at=1)
    _stand_ins(monkeypatch, rt, NATIVE)
    srcs = [torch.zeros(n, dtype=torch.uint8) for n in (100, 200, 300)]
    with caplog.at_level("WARNING", logger="ssdtrain.device.copies"):
        assert copies.queue_to_host([0x10000, 0x20000, 0x30000], srcs, [None] * 3) is None
    assert [c[0] for c in rt.calls] == ["copy", "copy", "clear"]
    assert "illegal memory access" in caplog.text and "(700)" in caplog.text
    assert copies._cudart() is None


@needs_build
def test_call_copies_answers_how_many_it_made():
    rt = _Runtime(fail_at=2, fail=1)
    jobs = [(0x10 * i, 0x20 * i, i) for i in range(1, 6)]
    assert NATIVE.call_copies(rt.memcpy_async_address, 0x77, 4, jobs) == (0, 2, 1)
    assert [c[1:] for c in rt.calls] == [(0x10, 0x20, 1, 4, 0x77), (0x20, 0x40, 2, 4, 0x77), (0x30, 0x60, 3, 4, 0x77)]
    rt = _Runtime()
    assert NATIVE.call_copies(rt.memcpy_async_address, 0, 4, jobs) == (0, 5, 0)
    rt = _Runtime()  # waits first, in order, then the copies
    assert NATIVE.call_copies(rt.memcpy_async_address, 0x77, 4, jobs[:2], rt.wait_event_address, [0xE1, 0xE2]) == (2, 2, 0)
    assert rt.calls == [("wait", 0x77, 0xE1, 0), ("wait", 0x77, 0xE2, 0), ("copy", 0x10, 0x20, 1, 4, 0x77),
                        ("copy", 0x20, 0x40, 2, 4, 0x77)]
    rt = _Runtime(fail_at=1)  # the second wait fails: no copy is made
    assert NATIVE.call_copies(rt.memcpy_async_address, 0x77, 4, jobs, rt.wait_event_address, [0xE1, 0xE2, 0xE3]) == (1, 0, 700)
    assert [c[0] for c in rt.calls] == ["wait", "wait"]


@needs_build
def test_waits_without_a_function_to_wait_with_are_refused():
    with pytest.raises(ValueError, match="no function to wait with"):
        NATIVE.call_copies(1, 0, 4, [], 0, [0xE1])
    with pytest.raises(TypeError, match="events"):
        NATIVE.call_copies(1, 0, 4, [], 1, 5)
    with pytest.raises(TypeError):
        NATIVE.call_copies(1, 0, 4, [], 1)


@needs_build
def test_a_failed_wait_stops_the_batch_and_falls_back(monkeypatch, caplog):
    """Note [a batch's waits release the GIL with its copies]: the second fence's wait fails in the
    compiled call: no copy is made, the error is cleared and said as the wait's, None is answered
    (torch queues the batch, its waits included) and the runtime is not used again."""
    rt = _Runtime(fail_at=1)
    _stand_ins(monkeypatch, rt, NATIVE)
    srcs = [torch.zeros(n, dtype=torch.uint8) for n in (100, 200)]
    with caplog.at_level("WARNING", logger="ssdtrain.device.copies"):
        assert copies.queue_to_host([0x10000, 0x20000], srcs, [_Fence(0xA1), _Fence(0xA2)]) is None
    assert [c[0] for c in rt.calls] == ["wait", "wait", "clear"]
    assert "cudaStreamWaitEvent failed" in caplog.text and "(700)" in caplog.text
    assert copies._cudart() is None


def test_the_runtime_function_is_called_by_its_address_only_where_it_has_one():
    rt = _Runtime()
    assert copies._address(rt._fn) == rt.memcpy_async_address and rt.memcpy_async_address
    assert copies._address(rt._wait) == rt.wait_event_address and rt.wait_event_address
    assert copies._address(lambda *a: 0) is None  # a stand-in: the ctypes loop calls it
