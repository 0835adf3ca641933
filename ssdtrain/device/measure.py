"""What the device reports to the host tier: the room above the allocator's peak, the bytes
allocated, forward's device time (:class:`GpuTimer`) and the copy engine's rate.

Like ``cuda.py``, nothing here runs at import or initialises CUDA unless a CUDA tensor is
offloaded. GPU-ONLY CODE: run by ``tests/gpu`` and ``ssdtrain selftest``; the CPU suite drives
the tier's logic with stand-ins.
"""

from __future__ import annotations

import time

import torch

from ssdtrain.device import cuda
from ssdtrain.device.cuda import _on, side_stream

__all__ = ["room_above_peak", "device_limit", "allocator_peak", "allocated", "GpuTimer", "timed_copies", "copy_rate"]


def room_above_peak(dev: torch.device, seen: int = 0, since: int | None = None) -> int:
    """Bytes this process could still allocate on ``dev`` above the last step's peak: ``seen`` (a
    peak read in that step's backward, before any reset), else the allocator's since its reset.
    With ``since`` (the bytes allocated as that step began), the peak is its growth above them on
    top of what is allocated now: memory that came between (the optimizer's state after the first
    step) counts (Note [the step's peak, seen in backward]). The limit is the device's free memory
    plus what the caching allocator holds unused, within the per-process fraction if one is set
    (``set_per_process_memory_fraction``)."""
    peak = seen or allocator_peak(dev)
    if since is not None:
        peak = allocated(dev) + max(0, peak - since)
    return device_limit(dev) - peak


def _index(dev: torch.device) -> int:
    return torch.cuda.current_device() if dev.index is None else dev.index  # "cuda" alone


def device_limit(dev: torch.device) -> int:
    """The most this process may hold on ``dev``: its free memory plus what the caching allocator
    holds, within the per-process fraction if one is set."""
    if cuda._model is not None:
        return cuda._model.rates.memory_bytes
    with _on(dev):
        index = _index(dev)
        free, total = torch.cuda.mem_get_info(index)
        limit = free + torch.cuda.memory_reserved(index)
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if fraction is not None:  # it refuses a device with no index (torch 2.11, H200 2026-11-27)
            limit = min(limit, int(total * fraction(index)))
        return limit


def allocator_peak(dev: torch.device) -> int:
    """The caching allocator's peak of allocated bytes on ``dev`` since its last reset."""
    if cuda._model is not None:
        return cuda._model.peak()
    with _on(dev):
        return torch.cuda.max_memory_allocated(_index(dev))


def allocated(dev: torch.device) -> int:
    """The bytes the caching allocator has allocated on ``dev`` now."""
    if cuda._model is not None:
        return cuda._model.allocated()
    with _on(dev):
        return torch.cuda.memory_allocated(_index(dev))


class GpuTimer:
    """Device time between two points of the training thread's current stream (a forward's
    start and end), read later without waiting: timing events, never synchronised; and the
    host's time between the same two points."""

    __slots__ = ("start", "end", "host_start", "host_end")

    def __init__(self, dev: torch.device) -> None:
        model = cuda._model
        if model is not None:  # the model's timing events, and the host's clock is the model's
            self.start = model.event(enable_timing=True)
            self.start.record(model.current_stream())
            self.end, self.host_start, self.host_end = None, model.host_now, None
            return
        with _on(dev):
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record(torch.cuda.current_stream(dev))
        self.end: torch.cuda.Event | None = None
        self.host_start = time.perf_counter()
        self.host_end: float | None = None

    def stop(self, dev: torch.device) -> None:
        model = cuda._model
        if self.end is None and model is not None:
            self.end = model.event(enable_timing=True)
            self.end.record(model.current_stream())
            self.host_end = model.host_now
        if self.end is None:
            with _on(dev):
                self.end = torch.cuda.Event(enable_timing=True)
                self.end.record(torch.cuda.current_stream(dev))
            self.host_end = time.perf_counter()

    def host_seconds(self) -> float | None:
        """The host's time between the two points (``None`` before the second)."""
        return None if self.host_end is None else self.host_end - self.host_start

    def seconds(self) -> float | None:
        """The time between the two points, once the device passed both (else ``None``)."""
        if self.end is None or not self.end.query():
            return None
        return self.start.elapsed_time(self.end) / 1e3


def timed_copies(copies: list[tuple[torch.cuda.Stream, torch.Tensor, torch.Tensor]], repeats: int = 3) -> float:
    """Seconds of the slowest of ``copies`` (``(stream, dst, src)``, queued side by side, each on
    its stream), the best of ``repeats`` rounds, timed with events."""
    best = float("inf")
    for _ in range(repeats):
        marks = []
        for stream, dst, src in copies:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                a.record(stream)
                dst.copy_(src, non_blocking=True)
                b.record(stream)
            marks.append((a, b))
        for _, b in marks:
            b.synchronize()
        best = min(best, max(a.elapsed_time(b) for a, b in marks) / 1e3)
    return max(best, 1e-9)


def copy_rate(dev: torch.device, pinned: torch.Tensor) -> float:
    """Bytes per second of a device-to-host copy into ``pinned`` (at least 64 MiB) on this
    thread's side stream: the best of three, timed with events. Allocates device memory for it."""
    n = min(pinned.numel(), 64 << 20)
    model = cuda._model
    if model is not None:  # a modelled copy, timed with the model's events
        src = model.empty(n, dtype=torch.uint8)
        stream = side_stream(dev)
        start = stream.record_event(model.event(enable_timing=True))
        model.copy(pinned[:n], src, stream)
        end = stream.record_event(model.event(enable_timing=True))
        end.synchronize()
        del src
        return n / max(start.elapsed_time(end) / 1e3, 1e-9)
    with _on(dev):
        src = torch.empty(n, dtype=torch.uint8, device=dev)
        seconds = timed_copies([(side_stream(dev), pinned[:n], src)])
        del src
    return n / seconds
