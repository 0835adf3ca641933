"""The bench's device: which one ``--device`` means, its clock, and its memory counters.

The one module of the bench that calls ``torch.cuda`` (the engine's are in ``ssdtrain/device/``).
On the CPU every function here is a no-op or plain ``perf_counter``; nothing initialises CUDA
unless a CUDA device was asked for (``auto`` asks ``torch.cuda.is_available``, which creates no
context).

Note [timing a GPU step]
Kernels run asynchronously: a ``perf_counter`` read after ``loss.backward()`` returns says when
the host had queued backward, not when the GPU had run it. A timed step therefore starts and
ends with ``torch.cuda.synchronize`` (nothing of the previous step is still running; everything
of this one has run), and its split into forward and backward comes from CUDA events recorded on
the compute stream at those points, read after the closing synchronize. No synchronize is added
inside the step: it would stall the host at forward's end, which a training loop never does.

Note [peak device memory per step]
``torch.cuda.max_memory_allocated`` is the allocator's high-water mark of bytes handed to
tensors since the last ``torch.cuda.reset_peak_memory_stats``. The allocator counts on the host,
when a tensor is allocated or freed, so the mark is read after a synchronize (frees queued
behind running kernels have happened) and reset right before the step, with the previous step's
gradients already freed: what it reports is this step's peak, weights and optimizer state
included. The pinned host allocator keeps the same kind of count
(``torch.cuda.host_memory_stats``, power-of-two rounded, "best effort" by its own account):
``save_on_cpu(pin_memory=True)`` keeps every saved tensor there.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

__all__ = ["DEVICES", "Marks", "device_info", "memory_peaks", "reset_memory_peaks", "resolve_device", "synchronize"]

DEVICES = ("auto", "cpu", "cuda")
"""What ``--device`` takes (``cuda:N`` too): ``auto`` is CUDA where available, else the CPU."""


def resolve_device(name: str) -> torch.device:
    """The device ``name`` means here: ``auto``, ``cpu``, ``cuda`` (the current CUDA device) or
    ``cuda:N``.

    Raises:
        ValueError: for another name, and for a CUDA device this machine or this torch build
            does not have, saying why and what to do instead.
    """
    if name == "auto":
        return resolve_device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(name) if isinstance(name, str) else None
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} is not one the bench runs on; use auto, cpu, cuda or cuda:N")
    if dev.type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            raise ValueError(f"device {name!r}: this torch ({torch.__version__}) is built without CUDA; install a "
                             "CUDA build of torch on a machine with an NVIDIA GPU, or use --device cpu")
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = f"CUDA_VISIBLE_DEVICES={hidden!r} hides them, or " if hidden is not None else ""
        raise ValueError(f"device {name!r}: torch sees no CUDA device (torch.cuda.is_available() is False: "
                         f"{why}no NVIDIA GPU or driver here); run where a GPU is visible, or use --device cpu")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < count:
        raise ValueError(f"device {name!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", index)


def device_info(dev: torch.device) -> dict[str, Any]:
    """What the result records about the device (its name and CUDA version on a GPU)."""
    if dev.type != "cuda":
        return {"device": "cpu"}
    props = torch.cuda.get_device_properties(dev)
    return {"device": str(dev), "gpu": props.name, "gpu_memory_bytes": props.total_memory,
            "cuda": torch.version.cuda, "capability": f"{props.major}.{props.minor}"}


def synchronize(dev: torch.device) -> None:
    """Waits until ``dev`` has run everything queued on it (a no-op on the CPU)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Marks:
    """Named points of one step: ``perf_counter`` times, and on a GPU CUDA events recorded on
    the compute stream (Note [timing a GPU step]).

    ``mark(name)`` records a point; after the step's closing :func:`synchronize`,
    ``seconds(a, b)`` is the time from point ``a`` to point ``b``: the events' on a GPU, the
    host clock's on the CPU.
    """

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev
        self.times: dict[str, float] = {}
        self._events: dict[str, Any] = {}

    def mark(self, name: str) -> None:
        self.times[name] = time.perf_counter()
        if self.dev.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.dev))
            self._events[name] = event

    def __getitem__(self, name: str) -> float:
        return self.times[name]

    def seconds(self, start: str, end: str) -> float:
        if self.dev.type == "cuda":
            return self._events[start].elapsed_time(self._events[end]) / 1000.0  # milliseconds
        return self.times[end] - self.times[start]


def reset_memory_peaks(dev: torch.device) -> int | None:
    """Starts a peak-memory count (Note [peak device memory per step]); returns the bytes
    allocated now (``None`` on the CPU)."""
    if dev.type != "cuda":
        return None
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    reset_host = getattr(torch.cuda, "reset_peak_host_memory_stats", None)  # torch >= 2.7
    if reset_host is not None:
        reset_host()
    return torch.cuda.memory_allocated(dev)


def memory_peaks(dev: torch.device) -> dict[str, int | None]:
    """Since :func:`reset_memory_peaks`: ``max_memory_allocated`` on ``dev`` and the pinned host
    allocator's peak of bytes in use (``None`` where not known: the CPU, an older torch)."""
    if dev.type != "cuda":
        return {"max_memory_allocated_bytes": None, "pinned_host_peak_bytes": None}
    torch.cuda.synchronize(dev)
    host_stats = getattr(torch.cuda, "host_memory_stats", None)
    pinned = host_stats().get("active_bytes.peak") if host_stats is not None else None
    return {"max_memory_allocated_bytes": torch.cuda.max_memory_allocated(dev), "pinned_host_peak_bytes": pinned}
