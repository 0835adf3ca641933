"""ssdtrain/device.py on a machine without a GPU: host tensors pass through untouched, nothing
initialises CUDA, and the driver-stream code reports a driver it cannot use. The CUDA branches
themselves are tested in tests/gpu/test_gpu_device.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from _fake_cuda import build_stand_in

from ssdtrain import device


def test_host_tensors_need_no_fences():
    t = torch.ones(8)
    assert device.producer_fence(t) is None and device.consumer_fence(t) is None
    assert device.for_consumer(t) is t
    assert not device.is_cuda(t)


def test_order_calls_a_plain_callable_and_skips_none():
    calls = []
    device.order(lambda: calls.append(1), stream=None)
    device.order(None, stream=None)
    assert calls == [1]


def test_capturing_never_initialises_cuda():
    code = textwrap.dedent("""
        import torch
        from ssdtrain import device
        calls = []
        torch.cuda._lazy_init = lambda: calls.append("init")
        assert device.capturing() is False
        assert calls == [] and not torch.cuda.is_initialized()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_driver_streams_report_a_driver_that_cannot_make_one(tmp_path):
    # Note [a side stream of our own]: where the driver answers but cannot create a stream, the
    # error names the call and the driver's error, and side_stream() falls back to torch's pool.
    lib = build_stand_in(tmp_path)
    streams = device._DriverStreams(str(lib))
    with pytest.raises(RuntimeError, match=r"cuDeviceGet failed: CUDA_ERROR_NOT_INITIALIZED \(3\)"):
        streams.take(0)
    streams.give_back(0, 1234)
    assert streams.take(0) == 1234  # a stream given back is handed out again, never destroyed


def test_driver_streams_without_a_driver_library():
    with pytest.raises(OSError):
        device._DriverStreams("libcuda-that-does-not-exist.so.1")


def test_a_thread_gives_its_stream_back_when_it_ends(tmp_path):
    import threading

    streams = device._DriverStreams(str(build_stand_in(tmp_path)))
    holder = threading.local()

    def run():
        holder.lease = device._Lease(streams, 0, 42)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert streams.take(0) == 42
