"""Everything that touches ``torch.cuda``: fences between compute and I/O, side streams, pinned memory.

No other module of ssdtrain calls ``torch.cuda`` but its neighbours in ``ssdtrain/device/``
(``copies.py`` and ``measure.py``: the host tier's copies and timings, built on this one).
Nothing here runs at import, and nothing here initialises CUDA unless a CUDA tensor is actually
being offloaded.

What the engine calls (``ssdtrain/engine/offloader.py``):

* pack: :func:`producer_stream` for a tensor that will be written, and :func:`fence_on` that
  stream once the op that saved it returned (Note [write waits for the producer], Note [a save is
  copied only after its op returned] in ``writer.py``); refuse under :func:`capturing` (Note [no
  offloading inside CUDA graph capture]);
* unpack: :func:`consumer_fence` for a fresh reload buffer (Note [reload waits for the
  allocation point]), and :func:`for_consumer` on every tensor handed back to autograd (Note
  [reload buffers belong to their consumer stream]).

What the backends call on their I/O threads: :func:`copy_on_side_stream`, :func:`side_stream`,
:func:`synchronize`, :func:`queue_copy`, :func:`order`, :func:`staging`, :func:`pinned_empty`,
:func:`on_device`.

GPU-ONLY CODE: the CUDA branches below run only where there is a GPU (``pytest -m gpu tests/gpu``
and ``ssdtrain selftest``); the CPU suite exercises their ordering logic through the ``ready``
callables. Keep them small and keep every rule written down as a named note.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ssdtrain.device.driver_streams import _driver_streams, _Lease, pool_instead, stream_source  # noqa: F401

__all__ = [
    "is_cuda", "Fence", "producer_fence", "consumer_fence", "order", "copy_on_side_stream", "side_stream",
    "synchronize", "queue_copy", "staging", "pinned_empty", "on_device", "capturing", "for_consumer", "stream_source",
    "stream_of", "current_stream", "producer_stream", "fence_on", "modelled_gpu", "gpu_device",
]

log = logging.getLogger(__name__)

PAGE = 4096

# Note [the seam answers for the modelled GPU]
# ``ssdtrain.device.model.modelled(gpu)`` puts a :class:`~ssdtrain.device.model.ModelledGPU` here
# for the time of a ``with`` block and puts back what was here before on exit (nothing at import).
# While one is here, every function of the seam (this file, ``copies.py``, ``measure.py``) answers
# for it: the model's device tensors (ordinary CPU tensors the model counts as device memory) are
# "CUDA", and fences, streams, events, copies, pinned memory, timers and the allocator's figures
# come from the model. Each function's model branch is one global check at its top; the CUDA code
# below it is unchanged. It is process-wide, not per thread, as the device is: the I/O threads'
# copies must see it (a dispatch mode, ``ModelledCompute``, is per thread, so they call the
# model's ``copy`` directly). Under the model the engine's device objects are the model's tensors'
# own (``cpu``): :func:`gpu_device` says which of them stand for the GPU.
_model: Any = None  # the ModelledGPU the seam answers for, or None (the real CUDA)


def modelled_gpu() -> Any:
    """The :class:`~ssdtrain.device.model.ModelledGPU` the seam answers for now, or ``None``."""
    return _model


def _use_model(gpu: Any) -> Any:
    """Makes the seam answer for ``gpu`` (``None``: the real CUDA); returns what it answered for."""
    global _model
    before, _model = _model, gpu
    return before


def is_cuda(t: torch.Tensor) -> bool:
    if _model is not None:
        return _model.is_device(t)
    return t.is_cuda  # a fifth of ``t.device.type == "cuda"`` (pack asks for every save)


# Note [the modelled host's clock decides the hand-over]
# The engine reads the wall clock where only time decides (the host tier's batches go once the
# oldest save waited ``HAND_OVER_SECONDS``): on the modelled GPU that made the batches, and so the
# fences and the timeline, differ between two runs of one program. There the host's time is the
# model's virtual host clock (``ModelledGPU.host_now``).
def host_clock() -> Callable[[], float]:
    """The host's clock for the engine's timing decisions: ``time.perf_counter``, or the modelled
    GPU's host clock (Note [the modelled host's clock decides the hand-over])."""
    gpu = _model
    if gpu is not None:
        return lambda: gpu.host_now
    return time.perf_counter


def gpu_device(dev: torch.device) -> bool:
    """Whether ``dev`` (the device of a save the engine offloads) is a GPU's: ``cuda``, or any device
    while the seam answers for a modelled GPU (Note [the seam answers for the modelled GPU])."""
    return _model is not None or dev.type == "cuda"


# Note [I/O threads set their device]
# The CUDA runtime binds a thread to a context on its first call that needs one, on the thread's
# current device -- device 0 unless the thread set another. An I/O thread that synchronises an
# event or creates a stream for a tensor on cuda:3 would otherwise create (and keep) a context
# on GPU 0: hundreds of MiB there for every rank of a multi-GPU job, and calls into the wrong
# context. Every function below that can run on an I/O thread enters the tensor's device first
# (``torch.cuda.device``: restores the previous one, a no-op when it is already current), as
# torch's own pin-memory thread does.
def _on(dev: torch.device):
    if _model is not None:
        return contextlib.nullcontext()  # one modelled device, no contexts
    return torch.cuda.device(dev)


class Fence:
    """A point on a CUDA stream that I/O must not overtake.

    Calling it blocks the calling thread until the stream got there; :meth:`order` makes another
    stream wait for it instead, without blocking any thread (Note [reload waits for the
    allocation point]).

    Note [waiting threads sleep]: the event is created with ``blocking=True``
    (``cudaEventBlockingSync``): a thread waiting on it sleeps in the driver. Without the flag a
    waiting thread may spin on a core, and with several I/O threads waiting at once that takes
    cores from the data loader and from the thread that launches the kernels.
    """

    __slots__ = ("event", "device", "stream")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.device = stream.device
        self.stream = stream  # where the point is (the producer's stream, for a producer fence)
        self.event = torch.cuda.Event(blocking=True)
        self.event.record(stream)

    def __call__(self) -> None:
        with _on(self.device):
            self.event.synchronize()

    def order(self, stream: torch.cuda.Stream) -> None:
        """Work queued on ``stream`` from now on runs only after the fenced point."""
        stream.wait_event(self.event)

    def done(self) -> bool:
        with _on(self.device):
            return self.event.query()

    def passed(self) -> bool:
        """:meth:`done`, without entering the device first: for the training thread, whose current
        context is already the device's (Note [a lagging copy is looked at without the lock])."""
        return self.event.query()


# Note [write waits for the producer]
# On a GPU, pack runs on the host as soon as the kernel that produced the tensor is *queued*,
# not finished. The writer must not read the tensor's memory before that kernel ran, so an event
# is recorded on the stream current at pack (every stream that produced the tensor is ordered
# before it: the op that saves the tensor is about to read it there), once the op that saved it
# has returned (an op may still write what it saved: Note [a save is copied only after its op
# returned]), and the I/O thread orders
# its copy or DMA after that event -- on the device when the copy runs on its own stream
# (:func:`order`), else by waiting. On the CPU, ops are synchronous: the bytes are final when
# pack runs.
def producer_fence(t: torch.Tensor) -> Fence | None:
    """A fence after the kernels that produced ``t`` (``None`` for host tensors)."""
    return _fence_here(t)


def producer_stream(t: torch.Tensor) -> torch.cuda.Stream | None:
    """The stream of ``t``'s device current now (``None`` for host tensors): where pack finds the
    op that saves ``t``, whose producer fence is recorded once that op returned (:func:`fence_on`;
    Note [a save is copied only after its op returned])."""
    if _model is not None:
        return _model.current_stream() if _model.is_device(t) else None
    if not t.is_cuda:
        return None
    return current_stream(t.device)


def fence_on(stream: torch.cuda.Stream) -> Fence:
    """A fence at this point of ``stream`` (Note [a producer fence reuses its event])."""
    if _model is not None:
        return _ModelFence(stream)
    dev = stream.device
    idle = _idle_events.get(dev.index)
    if idle is None:
        idle = _idle_events.setdefault(dev.index, [])
    return _PooledFence(stream, dev, idle)


def _fence_here(t: torch.Tensor) -> Fence | None:
    """A fence at this point of the current stream of ``t``'s device (``None`` for host tensors),
    on an event used before where one is idle (Note [a producer fence reuses its event])."""
    if _model is not None:
        return _ModelFence(_model.current_stream()) if _model.is_device(t) else None
    dev = t.device
    if dev.type != "cuda":
        return None
    idle = _idle_events.get(dev.index)
    if idle is None:
        idle = _idle_events.setdefault(dev.index, [])
    return _PooledFence(current_stream(dev), dev, idle)


# Note [a producer fence reuses its event]
# Pack records a producer fence for every CUDA save it queues, on the training thread (and a
# reload records a consumer fence for its buffers, the same way: ``_fence_here``). With a new
# ``torch.cuda.Event`` each time (created in the driver at its first record, destroyed when the
# fence died) and ``torch.cuda.current_stream()``, that cost about 14 us a save on an H100's host
# (2026-11-25: 7 us for the stream object, 6.5 for recording a new event). So the stream comes
# from a cache of stream objects (``stream_of``), and the event of a fence that died waits in its
# device's idle list to be recorded again. That is safe: a stream that waited on the event's
# earlier record is not affected by a later one (``cudaStreamWaitEvent`` waits for the record it
# finds when called), and only a live fence's holders query or wait on its event.
_idle_events: dict[int, list] = {}  # device index -> events of fences that died
_stream_objects: dict[tuple, torch.cuda.Stream] = {}  # by C tuple: Stream objects, made once (a cache)


def stream_of(data: tuple) -> torch.cuda.Stream:
    """The stream named by a C tuple (``torch._C._cuda_getCurrentStream``), one object per stream."""
    stream = _stream_objects.get(data)
    if stream is None:
        stream = _stream_objects[data] = torch.cuda.Stream(stream_id=data[0], device_index=data[1],
                                                           device_type=data[2])
    return stream


def current_stream(dev: torch.device) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(dev)``, at a third of its cost (a cached object)."""
    if _model is not None:
        return _model.current_stream()
    return stream_of(torch._C._cuda_getCurrentStream(dev.index))


class _ModelFence(Fence):
    """A :class:`Fence` on the modelled GPU: its event and stream are the model's (Note [the seam
    answers for the modelled GPU]); the host waits and queries on the model's clock."""

    __slots__ = ()

    def __init__(self, stream: Any) -> None:
        self.device, self.stream = stream.device, stream
        self.event = stream.gpu.event(blocking=True)
        self.event.record(stream)

    def __call__(self) -> None:
        self.event.synchronize()

    def done(self) -> bool:
        return self.event.query()


class _PooledFence(Fence):
    """A :class:`Fence` whose event goes back to ``idle`` when it dies."""

    __slots__ = ("_idle",)

    def __init__(self, stream: torch.cuda.Stream, dev: torch.device, idle: list) -> None:
        self.device, self.stream, self._idle = dev, stream, idle
        try:
            event = idle.pop()
        except IndexError:
            event = torch.cuda.Event(blocking=True)
        event.record(stream)
        self.event = event  # set last: a fence cut short gives back no event it did not record

    def __del__(self) -> None:
        try:
            self._idle.append(self.event)
        except AttributeError:  # __init__ did not get that far
            pass


# Note [reload waits for the allocation point]
# A reload buffer is allocated on the main thread, under the compute stream; the caching
# allocator may hand out a block that kernels already queued on that stream still use (they run
# before any later kernel of that stream, which is all the allocator promises). The bytes read
# back must therefore land only after the compute stream passed the allocation point. The fence
# is an event recorded there. A backend that copies into the buffer on its own side stream makes
# that stream wait for the event (:func:`order`, on the device): the read from the drive starts
# at once, and only the last host-to-device copy waits. A backend whose device access is not on
# a stream of ours (kvikio's pread) calls the fence and waits on the host. Either way the read's
# future completes only once the bytes are in device memory (the side stream is synchronised),
# so the tensor is visible to any stream when unpack returns it.
def consumer_fence(buf: torch.Tensor) -> Fence | None:
    """A fence after the kernels that may still use ``buf``'s memory (``None`` for host buffers)."""
    return _fence_here(buf)


def order(ready: Callable[[], None] | None, stream: torch.cuda.Stream) -> None:
    """Orders ``stream``'s next work after ``ready``: on the device for a :class:`Fence`, else by
    calling it (a plain callable waits on the host)."""
    if ready is None:
        return
    if isinstance(ready, Fence):
        ready.order(stream)
    else:
        ready()


# Note [reload buffers belong to their consumer stream]
# Backward may run an op on another stream than the one that was current when its saved tensor's
# reload buffer was allocated (ops run backward on the stream their forward used). The caching
# allocator only knows the allocation stream: once the tensor dies it would hand the block out
# again while kernels queued on the consumer stream still read it. ``record_stream`` tells it.
def for_consumer(t: torch.Tensor) -> torch.Tensor:
    """``t`` handed to backward: a CUDA tensor is tied to the current stream, which will use it."""
    if _model is None and not t.is_cuda:  # a host tensor: nothing to tie (unpack's common case on the CPU)
        return t
    if _model is not None:
        if _model.is_device(t):
            _model.record_stream(t, _model.current_stream())
        return t
    if is_cuda(t):
        t.record_stream(torch.cuda.current_stream(t.device))
    return t


# Note [no offloading inside CUDA graph capture]
# A captured graph replays device work only: the host-side pack, the I/O threads and the
# unpack's reads would not run at replay, and pack's event and stream calls are illegal while
# capturing. The engine refuses (a RuntimeError that says what to do) when a CUDA tensor is
# saved during capture. The check must not initialise CUDA for a CPU-only run.
def capturing() -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph (never initialises CUDA)."""
    return torch.cuda.is_initialized() and capturing_now()


def capturing_now() -> bool:
    """``capturing()`` for a thread that holds a CUDA tensor (CUDA is initialised): one call."""
    return torch._C._cuda_isCurrentStreamCapturing()


_local = threading.local()


def side_stream(dev: torch.device) -> torch.cuda.Stream:
    """This thread's own non-blocking stream on ``dev`` (Note [a side stream of our own])."""
    if _model is not None:  # one per thread and modelled GPU, made once
        streams = _local.__dict__.setdefault("modelled_streams", {})
        stream = streams.get(id(_model))
        if stream is None or stream.gpu is not _model:
            stream = streams[id(_model)] = _model.new_stream()  # named by its index: the same names in every run
        return stream
    streams = _local.__dict__.setdefault("streams", {})
    stream = streams.get(dev)
    if stream is None:
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        with _on(dev):
            driver = _driver_streams()
            if driver is not None:
                try:
                    handle = driver.take(index)
                except RuntimeError as e:
                    pool_instead(str(e))
                else:
                    _local.__dict__.setdefault("leases", []).append(_Lease(driver, index, handle))
                    stream = torch.cuda.ExternalStream(handle, device=dev)
            if stream is None:
                stream = torch.cuda.Stream(device=dev)
        streams[dev] = stream
    return stream


def synchronize(stream: torch.cuda.Stream) -> None:
    """Waits until ``stream`` ran everything queued on it, asleep (Note [waiting threads sleep]).

    ``Stream.synchronize`` may spin: a blocking event recorded at the end is waited on instead.
    """
    if _model is not None:
        stream.synchronize()
        return
    events = _local.__dict__.setdefault("events", {})
    dev = stream.device
    with _on(dev):
        event = events.get(dev)
        if event is None:
            event = events[dev] = torch.cuda.Event(blocking=True)
        event.record(stream)
        event.synchronize()


def copy_on_side_stream(dst: torch.Tensor, src: torch.Tensor, *, after: Callable[[], None] | None = None) -> None:
    """Copies between host and device on this I/O thread's own stream, and waits for it.

    ``after`` (a :class:`Fence`, or any callable that waits) orders the copy: a fence makes the
    side stream wait on the device, so the calling thread does not block for it (Note [reload
    waits for the allocation point]). Used by backends that move CUDA tensors through host memory
    (posix, memory, kvikio without GDS). Callers run on I/O threads, never the main one.
    """
    if _model is not None:
        stream = side_stream(dst.device)
        order(after, stream)
        _model.copy(dst, src, stream)
        stream.synchronize()
        return
    gpu = dst.device if is_cuda(dst) else src.device
    with _on(gpu):
        stream = side_stream(gpu)
        order(after, stream)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        synchronize(stream)


def queue_copy(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream,
               event: torch.cuda.Event | None = None) -> torch.cuda.Event:
    """Queues a host/device copy on ``stream`` without waiting; returns a blocking event recorded
    after it (``event``, when given, is recorded again). ``event.synchronize()`` waits for it."""
    if _model is not None:
        _model.copy(dst, src, stream)
        return stream.record_event(event)
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
    if event is None:
        event = torch.cuda.Event(blocking=True)
    event.record(stream)
    return event


def pinned_empty(nbytes: int) -> torch.Tensor:
    """Page-locked host bytes (for fast, asynchronous host/device copies).

    torch allocates them under a device that already has a context, so this creates none.
    """
    if _model is not None:
        return _model.pinned_empty(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def staging(nbytes: int) -> torch.Tensor:
    """This thread's page-aligned pinned buffer of at least ``nbytes`` (grown on demand, kept
    for the thread's life): the host side of a CUDA tensor's trip to and from the drive, usable
    for ``O_DIRECT``. torch's pinned allocator does not promise page alignment, so the block has
    a page of slack and the buffer starts at the first page boundary in it."""
    buf = getattr(_local, "staging", None)
    if buf is None or buf.numel() < nbytes:
        size = -(-max(nbytes, 1) // PAGE) * PAGE
        block = pinned_empty(size + PAGE)
        buf = block[-block.data_ptr() % PAGE:][:size]  # a view: it keeps ``block`` alive
        _local.staging = buf
    return buf


@contextlib.contextmanager
def on_device(dev: torch.device) -> Iterator[None]:
    """Enters ``dev`` for CUDA calls on an I/O thread (Note [I/O threads set their device])."""
    if dev.type != "cuda":
        yield
        return
    with _on(dev):
        yield
