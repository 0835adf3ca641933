"""The host tier's device work: copies to and from pinned host memory, queued a batch at a time
and released in stream order. The timings the tier learns from are in ``measure.py``.

Built on ``cuda.py`` (fences, side streams); like it, nothing here runs at import or
initialises CUDA unless a CUDA tensor is offloaded. GPU-ONLY CODE: run by ``tests/gpu`` and
``ssdtrain selftest``; the CPU suite drives the tier's logic with CPU tensors and stand-ins.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

from ssdtrain.device import cuda
from ssdtrain.device.cuda import Fence, _ModelFence, _on, is_cuda, order, side_stream

__all__ = ["queue_copies", "queue_to_host", "queue_to_device", "copy_host", "runtime_copies", "OrderOnce"]

log = logging.getLogger(__name__)


# Note [a tier copy is released in stream order]
# The host tier's copy from device to pinned host memory is queued on an I/O thread's side stream
# and marked by a blocking event (``landed``). The host runs ahead of the device: at the end of
# forward on the host, the device may still be computing half of forward, so a copy that the host
# *sees* done frees memory only after the peak that the allocator counts. Instead the engine
# releases a save's device memory once its copy is *due* (predicted done by the time the compute
# stream gets to where the host is now), after making the compute stream wait for ``landed``
# (:class:`OrderOnce`): the allocator may hand that memory to later work of the compute stream,
# which the wait orders after the copy. The prediction only decides whether the compute stream
# would wait; correctness never depends on it.
# Note [copies are queued a batch at a time]
# On an H100's host (2026-11-25) ``torch.cuda.current_stream()`` costs 7 us, recording an event 6.5
# us and queueing a copy on a side stream 38 us, while the model's own forward leaves the host
# about 15 us per save of slack: a GPU step is host-bound long before the device is. So the host
# tier's copy thread takes the queued copies a batch at a time: one device and stream context,
# each copy ordered after its producer's fence (recorded at pack, on the producer's stream), one
# event after the batch. Letting the copy thread mark the producer's stream itself (the stream named
# at pack, ``wait_stream`` at batch time) was tried and measured worse: the host runs ahead of the device,
# so a point marked at batch time lies far beyond the producer, the copy starts late, and the
# compute stream, released in stream order, waits for it (x1.76 against x1.53 on the bench's GPU
# shape).
def queue_copies(dsts: list[torch.Tensor], srcs: list[torch.Tensor], readys: list) -> Fence:
    """Queues ``dst.copy_(src)`` for each pair on this I/O thread's side stream, after each of
    ``readys`` (a :class:`Fence` or callable: :func:`order`), without waiting for them;
    returns one :class:`Fence` after all of them. Device destinations are tied to the side stream
    (``record_stream``): dropped before their copy ran, their blocks wait for it."""
    model = cuda._model
    if model is not None:  # Note [the seam answers for the modelled GPU]: the model's copy, on any thread
        stream = side_stream(srcs[0].device)
        for ready in readys:
            order(ready, stream)
        for dst, src in zip(dsts, srcs):
            model.copy(dst, src, stream)
        for dst in dsts:
            if model.is_device(dst):
                model.record_stream(dst, stream)
        return _ModelFence(stream)
    gpu = srcs[0].device if is_cuda(srcs[0]) else dsts[0].device
    with _on(gpu):
        stream = side_stream(gpu)
        for ready in readys:
            order(ready, stream)
        with torch.cuda.stream(stream):
            for dst, src in zip(dsts, srcs):
                dst.copy_(src, non_blocking=True)
        for dst in dsts:
            if is_cuda(dst):
                dst.record_stream(stream)
        return Fence(stream)


# Note [the copy thread issues copies without the GIL]
# The copy thread holds the GIL while torch queues a copy (``Tensor.copy_`` does not release it):
# on an H200's host (2026-11-27, benchmarks/investigations/copy_issue_cost.py) each copy it issued that way cost
# the training thread 10.3 us, waiting for the GIL, where the training thread has about 15 us a
# save to spare. Called through ctypes, the CUDA runtime's functions run with the GIL released, and
# the same copies cost the training thread nothing measurable. So the tier's copies to the pool go
# that way (``cudaStreamWaitEvent`` for each producer fence, ``cudaMemcpyAsync`` for each copy, on
# the side stream torch made), through the ``libcudart`` torch itself loaded; where there is none
# (a build with the runtime linked in), where ``SSDTRAIN_NO_EXT`` asks for no native calls, or
# once a call failed (its error cleared, a warning), they go through torch as before. Later runs of
# the same benchmark were noisy (on another H200 host the same day, 22:11 UTC: ctypes +31 us a copy
# issued, torch +19): the gain per copy is not settled.
_FENCE = Fence  # what a ready must be to be waited for on the device (a name the tests' stand-ins replace)
_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)
_runtime: Any = None  # the ctypes library once looked for; False: none, or no longer used
_native: Any = None  # ssdtrain._cpack once looked for; False: none (pure Python)


# Note [a batch of copies releases the GIL once]
# A ctypes call releases the GIL and takes it back, and the copy threads made one a copy (a
# ``memmove`` on the CPU, a ``cudaMemcpyAsync`` on a GPU): each time the training thread took the
# GIL meanwhile, the copy thread slept until it was given back, and each of those hand-overs is two
# context switches. On pack_cost's GPT (CPU, 2026-11-30, ``perf record -e sched:sched_switch``) the
# copy threads slept 11 times a step that way, the training thread 19 times for the GIL, and the
# kernel's share of the tier's extra CPU time was 5 us a save. So where the compiled module is
# built (``ssdtrain._cpack``, Note [a compiled pack for the common save] in ``engine/native.py``) a
# batch's copies are read into C with the GIL held and made with it released once:
# ``memcpy_many`` for host memory, ``call_copies`` calling the runtime's ``cudaMemcpyAsync`` by its
# address for each copy, stopping at the first error (which goes the way a ctypes call's did).
# Elsewhere, or with ``SSDTRAIN_NATIVE=0``, they go one ctypes call a copy, as before.
# Note [a batch's waits release the GIL with its copies]
# Before its copies, a batch makes the side stream wait for each producer's fence (the copies in)
# or for the buffers' allocation point and the copies in (the reads back): one
# ``cudaStreamWaitEvent`` a fence, about one a save, and through ctypes each released the GIL and
# took it back, a hand-over to the training thread each time it wanted the GIL meanwhile (Note [a
# batch of copies releases the GIL once]). Where the compiled module is built they go in the same
# C call as the copies (``call_copies``' ``wait`` and ``events``): the runtime's
# ``cudaStreamWaitEvent`` by its address, in order, then the copies; the first error stops the
# call, and is said and handled as a copy's (the batch then goes through torch, waits included).
# The events are read in Python first (``Event.cuda_event``), with the GIL held, as before.
def _compiled() -> Any:
    """``ssdtrain._cpack`` where built and current, else None (looked for once)."""
    global _native
    if _native is None:
        from ssdtrain import _ext
        _native = _ext.compiled()[0] or False
    return _native or None


def copy_host(copies: list[tuple[int, int, int]]) -> None:
    """Copies ``nbytes`` from ``src`` to ``dst`` for each ``(dst, src, nbytes)`` of host memory, in
    order, on this thread (Note [a batch of copies releases the GIL once])."""
    native = _compiled()
    if native is not None:
        native.memcpy_many(copies)
        return
    for dst, src, nbytes in copies:
        ctypes.memmove(dst, src, nbytes)


def _cudart() -> Any:
    """The CUDA runtime torch loaded, as a ctypes library with the calls below typed; ``None``
    where it cannot be used (looked for once)."""
    global _runtime
    if _runtime is None:
        _runtime = _load_cudart() or False
    return _runtime or None


def runtime_copies() -> bool:
    """Whether the tier's copies on a GPU go through the CUDA runtime's own calls, with the GIL
    released (Note [the copy thread issues copies without the GIL]), rather than through torch."""
    return _cudart() is not None


def _load_cudart() -> Any:
    from ssdtrain import _ext
    try:
        if _ext.native_code_disabled():
            return None
        # torch's own: the major version it was built with (another package may load another runtime)
        name = f"/libcudart.so.{(torch.version.cuda or '0').split('.')[0]}"
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if name in line})
        if not paths:
            return None
        lib = ctypes.CDLL(paths[0])
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                        ctypes.c_void_p]
        lib.cudaStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.memcpy_async_address = _address(lib.cudaMemcpyAsync)
        lib.wait_event_address = _address(lib.cudaStreamWaitEvent)
        return lib
    except (OSError, AttributeError, ValueError) as e:
        log.info("ssdtrain: the CUDA runtime cannot be called directly (%s); copies go through torch", e)
        return None


def queue_to_host(addresses: list[int], srcs: list[torch.Tensor], readys: list) -> Fence | None:
    """Queues the copy of each device tensor in ``srcs`` to the pinned host memory at the matching
    address, on this I/O thread's side stream, each after its producer fence, with the GIL
    released (Note [the copy thread issues copies without the GIL]); returns a :class:`Fence`
    after all of them, or ``None`` (nothing queued) where the runtime cannot be called directly
    or a ready is not a fence: then the caller queues them through torch (:func:`queue_copies`)."""
    return _queue_raw(srcs[0].device, [(a, src.data_ptr(), src.nbytes) for a, src in zip(addresses, srcs)], readys)


# Note [reads back are issued without the GIL too]
# Backward's copies from the pool to the device go through the runtime as the copies in do
# (``cudaStreamWaitEvent`` for the buffers' allocation point and for the copy in,
# ``cudaMemcpyAsync`` for the bytes), so that the read thread holds the GIL no longer than the
# copy thread does while autograd's thread runs the unpack hooks and the recomputed blocks; each
# buffer is still tied to the side stream (``record_stream``) through torch. What it is worth
# alone is not measured: on an H200 (2026-11-27, benchmarks/investigations/tier_host_cost.py, recompute+offload
# with every block input copied) both directions through the runtime against both through torch
# were within the run's noise (89.0 against 88.6 ms a step, and 98.5 against 96.8 on a slower
# host); the GPU tests pass both ways (tests/gpu/test_gpu_tier.py).
def queue_to_device(dsts: list[torch.Tensor], addresses: list[int], readys: list) -> Fence | None:
    """Queues the copy of the pinned host bytes at each address into the matching device tensor
    (``dst.nbytes`` of them), on this I/O thread's side stream, after each of ``readys`` (each a
    :class:`Fence` or ``None``), with the GIL released (Note [reads back are issued without the
    GIL too]); returns a :class:`Fence` after all of them, or ``None`` (nothing queued) where the
    runtime cannot be called directly or a ready is not a fence: then the caller queues them
    through torch (:func:`queue_copies`)."""
    fence = _queue_raw(dsts[0].device, [(dst.data_ptr(), a, dst.nbytes) for dst, a in zip(dsts, addresses)], readys)
    if fence is not None:
        for dst in dsts:
            dst.record_stream(fence.stream)
    return fence


def _address(fn: Any) -> int | None:
    """A ctypes function's address, for the compiled loop (Note [a batch of copies releases the
    GIL once]); None for anything else (the ctypes loop calls it)."""
    try:
        return ctypes.cast(fn, ctypes.c_void_p).value
    except ctypes.ArgumentError:
        return None


def _queue_raw(gpu: torch.device, copies: list[tuple[int, int, int]], readys: list) -> Fence | None:
    """Queues ``cudaMemcpyAsync(dst, src, nbytes)`` for each ``(dst, src, nbytes)`` on this I/O
    thread's side stream of ``gpu``, after each fence of ``readys``; a :class:`Fence` after all
    of them, or ``None`` (nothing queued) where the runtime cannot be called directly or a ready
    is not a fence (a host wait: torch's way calls it)."""
    global _runtime
    if cuda._model is not None:
        return None  # no raw addresses on the modelled GPU: its copies go through queue_copies
    if not all(ready is None or isinstance(ready, _FENCE) for ready in readys):
        return None
    rt = _cudart()
    if rt is None:
        return None
    with _on(gpu):
        stream = side_stream(gpu)
        raw = stream.cuda_stream
        events, last = [], None
        for ready in readys:
            if ready is not None and ready.event is not last:  # neighbours may share one fence
                last = ready.event
                events.append(ready.event.cuda_event)
        try:
            native = _compiled()
            address, wait = getattr(rt, "memcpy_async_address", None), getattr(rt, "wait_event_address", None)
            if native is not None and address and wait:  # Note [a batch's waits release the GIL with its copies]
                waited, _, err = native.call_copies(address, raw or 0, _DEFAULT, copies, wait, events)
                _check(rt, err, "cudaStreamWaitEvent" if waited < len(events) else "cudaMemcpyAsync")
            else:
                for event in events:
                    _check(rt, rt.cudaStreamWaitEvent(raw, event, 0), "cudaStreamWaitEvent")
                for dst, src, nbytes in copies:
                    _check(rt, rt.cudaMemcpyAsync(dst, src, nbytes, _DEFAULT, raw), "cudaMemcpyAsync")
        except RuntimeError as e:
            _runtime = False
            log.warning("ssdtrain: %s; the host tier's copies go through torch from now on", e)
            return None  # those already queued are queued again by torch: the same bytes
        return Fence(stream)


def _check(rt: Any, err: int, what: str) -> None:
    if err:
        rt.cudaGetLastError()  # not left for the next CUDA call on this thread to report
        raise RuntimeError(f"{what} failed: {rt.cudaGetErrorString(err).decode(errors='replace')} ({err})")


class OrderOnce:
    """Makes ``stream`` wait for ``fence`` (Note [a tier copy is released in stream order]), on the
    training thread, skipping a repeat of the last (fence, stream): one fence marks a whole batch of
    the tier's copies, whose saves are released or unpacked one after another."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last: tuple = ()

    def __call__(self, fence: Fence, stream: torch.cuda.Stream) -> None:
        if self.last != (fence, stream):
            self.last = (fence, stream)
            fence.order(stream)
