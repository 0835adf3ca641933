"""Everything that touches ``torch.cuda``: fences between compute and I/O, side streams, pinned memory.

No other module of ssdtrain calls ``torch.cuda``. Nothing here runs at import, and nothing here
initialises CUDA unless a CUDA tensor is actually being offloaded.

GPU-ONLY CODE: the CUDA branches below have not run on a GPU in this project's CI (its machines
have none). Their ordering logic is what the CPU tests exercise through the ``ready`` callables;
keep them small and keep every rule written down as a named note.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

__all__ = ["is_cuda", "producer_fence", "consumer_fence", "copy_on_side_stream", "pinned_empty"]


def is_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


# Note [write waits for the producer]
# On a GPU, pack runs on the host as soon as the kernel that produced the tensor is *queued*,
# not finished. The writer must not read the tensor's memory before that kernel ran, so pack
# records an event on the producing (current) stream and the I/O thread waits on it before it
# copies or DMAs anything. On the CPU, ops are synchronous: the bytes are final when pack runs.
def producer_fence(t: torch.Tensor) -> Callable[[], None] | None:
    """Returns a callable that blocks until the stream that produced ``t`` has finished it."""
    if not is_cuda(t):
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    return event.synchronize


# Note [reload visible after its read]
# A reload buffer is allocated on the compute stream; the caching allocator may hand out a block
# that kernels already queued on that stream still use. The I/O thread therefore waits for the
# compute stream (as of the allocation) before writing into the buffer, and the read's future
# completes only after the bytes are in device memory (its side stream is synchronised), so
# the unpacked tensor is visible to compute when unpack returns it.
def consumer_fence(buf: torch.Tensor) -> Callable[[], None] | None:
    """Returns a callable that blocks until the compute stream is done with ``buf``'s old contents."""
    return producer_fence(buf)


_local = threading.local()


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = {}
    if device not in streams:
        streams[device] = torch.cuda.Stream(device=device)
    return streams[device]


def copy_on_side_stream(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copies between host and device on this I/O thread's own stream, and waits for it.

    Used by backends that move CUDA tensors through host memory (posix, memory). Blocking on the
    side stream keeps the compute stream free; callers run on I/O threads, never the main one.
    """
    gpu = dst.device if is_cuda(dst) else src.device
    stream = _side_stream(gpu)
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
    stream.synchronize()


def pinned_empty(nbytes: int) -> torch.Tensor:
    """Page-locked host bytes (for fast, asynchronous host/device copies)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def capturing() -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph (never initialises CUDA)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def for_consumer(t: torch.Tensor) -> torch.Tensor:
    """``t`` handed to backward: a CUDA reload buffer is tied to the stream that uses it, so the
    caching allocator does not reuse its memory while kernels queued there still read it."""
    if is_cuda(t):
        t.record_stream(torch.cuda.current_stream(t.device))
    return t
