"""ssdtrain/device/cuda.py on a machine without a GPU: host tensors pass through untouched, nothing
initialises CUDA, and the driver-stream code reports a driver it cannot use. The CUDA branches
themselves are tested in tests/gpu/test_gpu_device.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from _fake_cuda import build_stand_in

from ssdtrain.device import cuda as device
from ssdtrain.device import driver_streams as device_streams


def test_host_tensors_need_no_fences():
    t = torch.ones(8)
    assert device.producer_fence(t) is None and device.consumer_fence(t) is None
    assert device.for_consumer(t) is t
    assert not device.is_cuda(t)


def test_a_producer_fence_reuses_the_event_of_one_that_died(monkeypatch):
    """Note [a producer fence reuses its event], with torch.cuda's event and stream stood in for:
    a live fence's event is never recorded for another; one that died is recorded again, on the
    stream current when the new fence is made; stream objects are made once per stream."""
    made, records, streams = [], [], []

    class Event:
        def __init__(self, blocking=False):
            assert blocking  # Note [waiting threads sleep]
            made.append(self)

        def record(self, stream):
            records.append((self, stream))

    class Stream:
        def __init__(self, stream_id, device_index, device_type):
            streams.append(self)
            self.id = stream_id

    current = [(7, 0, 1)]
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", lambda index: current[0], raising=False)
    monkeypatch.setattr(device, "_idle_events", {})
    monkeypatch.setattr(device, "_stream_objects", {})

    class Saved:  # what pack sees of a CUDA tensor here
        device = torch.device("cuda", 0)

    a, b = device.producer_fence(Saved()), device.producer_fence(Saved())
    assert a.event is not b.event and len(made) == 2
    assert a.stream is b.stream and len(streams) == 1 and a.device == torch.device("cuda", 0)
    event_a = a.event
    del a
    current[0] = (9, 0, 1)  # another stream is current now
    c = device.producer_fence(Saved())
    assert c.event is event_a and len(made) == 2  # recorded again, not made
    assert records[-1] == (event_a, c.stream) and c.stream.id == 9 and len(streams) == 2
    d = device.producer_fence(Saved())
    assert d.event not in (b.event, c.event) and len(made) == 3  # none idle: a new one
    assert device.producer_fence(Saved()).stream is c.stream  # the stream's object, made once
    event_d, count = d.event, len(made)
    del d
    assert device.consumer_fence(Saved()).event is event_d and len(made) == count  # a reload's fence too


def test_order_calls_a_plain_callable_and_skips_none():
    calls = []
    device.order(lambda: calls.append(1), stream=None)
    device.order(None, stream=None)
    assert calls == [1]


def test_capturing_never_initialises_cuda():
    code = textwrap.dedent("""
        import torch
        from ssdtrain.device import cuda as device
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
    streams = device_streams._DriverStreams(str(lib))
    with pytest.raises(RuntimeError, match=r"cuDeviceGet failed: CUDA_ERROR_NOT_INITIALIZED \(3\)"):
        streams.take(0)
    streams.give_back(0, 1234)
    assert streams.take(0) == 1234  # a stream given back is handed out again, never destroyed


def test_a_driver_that_cannot_make_a_stream_sends_the_process_to_the_pool(monkeypatch):
    # side_stream()'s fallback (a GPU's driver pool refusing a stream): the process takes its
    # streams from torch's pool from then on, and says so (it once named variables it lacked).
    monkeypatch.setattr(device_streams, "_driver", [object(), "dedicated"])
    device_streams.pool_instead("cuStreamCreate failed: CUDA_ERROR_OUT_OF_MEMORY (2)")
    assert device_streams._driver_streams() is None
    assert device.stream_source() == "pool (cuStreamCreate failed: CUDA_ERROR_OUT_OF_MEMORY (2))"
    assert device.pool_instead is device_streams.pool_instead  # the name side_stream() calls


def test_driver_streams_without_a_driver_library():
    with pytest.raises(OSError):
        device_streams._DriverStreams("libcuda-that-does-not-exist.so.1")


def test_a_thread_gives_its_stream_back_when_it_ends(tmp_path):
    import threading

    streams = device_streams._DriverStreams(str(build_stand_in(tmp_path)))
    holder = threading.local()

    def run():
        holder.lease = device_streams._Lease(streams, 0, 42)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert streams.take(0) == 42


def test_order_once_skips_only_a_repeat_of_the_last_fence_and_stream():
    from ssdtrain.device.copies import OrderOnce
    calls = []

    class Fence:
        def order(self, stream):
            calls.append((self, stream))

    a, b = Fence(), Fence()
    once = OrderOnce()
    for fence, stream in ((a, "s1"), (a, "s1"), (a, "s2"), (b, "s2"), (b, "s2"), (a, "s2")):
        once(fence, stream)
    assert calls == [(a, "s1"), (a, "s2"), (b, "s2"), (a, "s2")]
