"""ssdtrain/device/cuda.py on a GPU: I/O streams of our own, fences that sleep, threads on the right
device, and an I/O path that does not serialise with compute."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from _gpu import BACKENDS

from ssdtrain.device import cuda as device
from ssdtrain.device import driver_streams as device_streams
from ssdtrain.tools.selftest import OVERLAP_LIMIT, overlap_ratio

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda", 0)


def _waits_for_the_default_stream(stream: torch.cuda.Stream, sleep) -> bool:
    """Whether work queued on ``stream`` waits for the legacy default stream (a blocking stream
    does; a non-blocking one does not), told by behaviour: the default stream spins for 300 ms
    while ``stream`` runs a tiny kernel; when that kernel is done, is the spin still going?"""
    def tiny_kernel():
        torch.ones(1, device=CUDA).add_(1)

    with torch.cuda.stream(stream):  # load the kernels and take the memory first: a lazy module
        tiny_kernel()                # load or a cudaMalloc may wait for the whole device
    torch.cuda.synchronize()
    default = torch.cuda.default_stream(CUDA)
    assert default.cuda_stream == 0  # torch computes on the legacy default stream
    with torch.cuda.stream(default):
        sleep(300)
    with torch.cuda.stream(stream):
        tiny_kernel()
        done = torch.cuda.Event()
        done.record(stream)
    done.synchronize()
    waited = default.query()  # the spin is over: the tiny kernel was queued behind it
    torch.cuda.synchronize()
    return waited


def test_side_streams_are_our_own_and_non_blocking(sleep):
    # Note [a side stream of our own]
    got = {}

    def io_thread(i):
        got[i] = device.side_stream(CUDA).cuda_stream

    threads = [threading.Thread(target=io_thread, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert device.stream_source() == "dedicated", device.stream_source()
    mine = device.side_stream(CUDA).cuda_stream
    assert mine == device.side_stream(CUDA).cuda_stream  # one per thread, kept
    pool = {torch.cuda.Stream(device=CUDA, priority=p).cuda_stream for p in (0, -1) for _ in range(40)}
    pool.add(torch.cuda.default_stream(CUDA).cuda_stream)
    assert mine not in pool
    # The three threads ended: their streams were given back and are handed out again.
    assert len(set(got.values())) >= 1 and all(h not in pool for h in got.values())
    assert not _waits_for_the_default_stream(device.side_stream(CUDA), sleep)
    # The check tells a blocking stream: one made the same way without the non-blocking flag.
    blocking = device_streams._DriverStreams()
    blocking.CU_STREAM_NON_BLOCKING = 0
    assert _waits_for_the_default_stream(torch.cuda.ExternalStream(blocking.take(0), device=CUDA), sleep)


def test_streams_of_ended_threads_are_reused():
    handles = []

    def once():
        handles.append(device.side_stream(CUDA).cuda_stream)

    for _ in range(5):
        t = threading.Thread(target=once)
        t.start()
        t.join()
    assert len(set(handles)) == 1, handles  # one thread at a time: one stream, reused


def test_fences_order_a_side_stream_without_blocking_the_host(sleep):
    # Note [reload waits for the allocation point]: order() makes the side stream wait on the
    # device; the host returns at once.
    import time

    buf = torch.zeros(1 << 20, dtype=torch.uint8, device=CUDA)
    sleep(300)
    buf.fill_(3)  # the last use of buf on the compute stream, 300 ms from now
    fence = device.consumer_fence(buf)
    src = torch.full((1 << 20,), 7, dtype=torch.uint8, pin_memory=True)
    done = {}

    def io_thread():
        start = time.perf_counter()
        stream = device.side_stream(CUDA)
        device.order(fence, stream)
        done["queued"] = time.perf_counter() - start
        device.copy_on_side_stream(buf, src)
        done["copied"] = time.perf_counter() - start

    t = threading.Thread(target=io_thread)
    t.start()
    t.join()
    torch.cuda.synchronize()
    assert done["queued"] < 0.1 and done["copied"] > 0.1, done
    assert bool((buf == 7).all())


def test_a_reused_producer_fence_orders_a_copy_after_its_producer(sleep):
    # Note [a producer fence reuses its event]: the event of a fence that died is recorded again
    # for the next one, on the stream current then, and still fences that producer's kernels.
    first = device.producer_fence(torch.empty(1, device=CUDA))
    event = first.event
    del first
    other = torch.cuda.Stream(CUDA)
    with torch.cuda.stream(other):
        t = torch.zeros(1 << 20, dtype=torch.uint8, device=CUDA)
        sleep(300)
        t.fill_(5)  # the producer, 300 ms from now, on ``other``
        fence = device.producer_fence(t)
    assert fence.event is event and fence.stream == other
    dst = torch.zeros(1 << 20, dtype=torch.uint8, pin_memory=True)
    side = device.side_stream(CUDA)
    fence.order(side)
    with torch.cuda.stream(side):
        dst.copy_(t, non_blocking=True)
    side.synchronize()
    assert bool((dst == 5).all())


def test_blocking_fence_waits_asleep(sleep):
    # Note [waiting threads sleep]: a thread waiting on a fence uses little CPU.
    import resource

    t = torch.empty(1, device=CUDA)
    sleep(500)
    fence = device.producer_fence(t)
    before = resource.getrusage(resource.RUSAGE_THREAD)
    fence()
    after = resource.getrusage(resource.RUSAGE_THREAD)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert fence.done() and cpu < 0.2, f"{cpu:.2f} s of CPU for a 0.5 s wait: the thread spun"


def test_io_threads_create_no_context_on_another_gpu(tmp_path):
    # Note [I/O threads set their device]: offloading tensors of cuda:1 leaves cuda:0 without a
    # context in this process (cuDevicePrimaryCtxGetState tells).
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    code = textwrap.dedent(f"""
        import ctypes, sys, torch, ssdtrain
        lib = ctypes.CDLL("libcuda.so.1")
        def active(index):
            dev, flags, on = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
            lib.cuInit(0); lib.cuDeviceGet(ctypes.byref(dev), index)
            lib.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(on))
            return bool(on.value)
        torch.cuda.set_device(1)
        dev = torch.device("cuda", 1)
        m = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).to(dev)
        x = torch.randn(2048, 1024, device=dev)
        m(x).square().mean().backward()
        if active(0):
            print("torch itself made a context on cuda:0"); sys.exit(3)
        for backend in sys.argv[1:]:
            off = ssdtrain.Offloader(m, path={str(tmp_path)!r}, backend=backend, min_bytes=0)
            with off:
                loss = m(x).square().mean()
                off.wait()  # inside: what is still queued when the block ends is kept
            loss.backward(); off.close()
            assert off.stats().written_bytes > 0
        print("context on cuda:0" if active(0) else "clean")
    """)
    backends = ["posix", "memory"] + (["kvikio"] if _kvikio_ok() else [])
    out = subprocess.run([sys.executable, "-c", code, *backends], capture_output=True, text=True, timeout=300)
    if out.returncode == 3:
        pytest.skip(out.stdout.strip())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "clean", out.stdout


def _kvikio_ok() -> bool:
    from _gpu import kvikio_missing

    return kvikio_missing() is None


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.id != "memory"], indirect=True)
def test_offloading_io_does_not_serialise_compute(backend, tmp_path):
    # Note [kvikio compat mode serialises with compute]: the GEMM loop beside the I/O stays
    # within OVERLAP_LIMIT of the loop alone.
    name, setup = backend
    ratio, alone, with_io = overlap_ratio(name, str(tmp_path), seconds=1.0, setup=setup)
    assert ratio < OVERLAP_LIMIT, f"GEMMs took {with_io:.2f} s beside the I/O, {alone:.2f} s alone (x{ratio:.2f})"
