"""The modelled GPU's streams and events, and what memory not yet written reads as.

A :class:`Stream` and an :class:`Event` are shaped like ``torch.cuda``'s, so that the device seam
can hand them out in place of the real ones; the clocks behind them are
:class:`~ssdtrain.device.model.ModelledGPU`'s. Each carries a vector clock (stream index -> how
many of that stream's ops are ordered before it): the order CUDA's rules give, kept apart from
the virtual time.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes


__all__ = ["Stream", "Event", "ModelledRace", "poison"]


class ModelledRace(RuntimeError):
    """An ordering error found by the modelled GPU (raised with ``strict=True``)."""


def poison(t: torch.Tensor) -> None:
    """Fills ``t`` with what memory not yet written by its copy reads as: NaN for floating and
    complex dtypes, bytes of 0x5A for integer dtypes (``True`` for bool)."""
    if t.is_meta:
        return  # no bytes to poison (Note [a modelled GPU without data])
    with _disable_current_modes(), torch.no_grad():
        if t.dtype.is_floating_point or t.dtype.is_complex:
            t.fill_(math.nan)
        else:
            t.fill_(torch.full((t.element_size(),), 0x5A, dtype=torch.uint8).view(t.dtype).item())


def _covers(vc: dict, key: tuple[int, int]) -> bool:
    return vc.get(key[0], 0) >= key[1]


def _merge(into: dict, other: dict) -> None:
    for k, v in other.items():
        if v > into.get(k, 0):
            into[k] = v


class Stream:
    """A modelled CUDA stream: its work runs in queue order, each op after the previous ended.

    ``end`` is the virtual time its queued work ends; ``vc`` what is ordered before its next op.
    """

    def __init__(self, gpu: Any, name: str, index: int) -> None:  # gpu: a ModelledGPU (model.py imports this file)
        self.gpu, self.name, self.index = gpu, name, index
        self.end = 0.0
        self.seq = 0
        self.vc: dict[int, int] = {}

    @property
    def device(self) -> torch.device:
        return self.gpu.device

    def wait_event(self, event: Event) -> None:
        """Work queued here from now on starts after ``event`` (an unrecorded event: no wait)."""
        self.gpu._wait(self, event)

    def wait_stream(self, stream: Stream) -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event: Event | None = None) -> Event:
        event = event if event is not None else Event(self.gpu)
        event.record(self)
        return event

    def query(self) -> bool:
        return self.record_event().query()

    def synchronize(self) -> None:
        self.record_event().synchronize()

    def __repr__(self) -> str:
        return f"<modelled stream {self.name}>"


class Event:
    """A modelled CUDA event: a point on a stream, its virtual time and what is ordered before it."""

    def __init__(self, gpu: Any, enable_timing: bool = False, blocking: bool = False) -> None:
        self.gpu = gpu
        self.time: float | None = None
        self.vc: dict[int, int] = {}
        self.stream: Stream | None = None

    def record(self, stream: Stream | None = None) -> None:
        self.gpu._record(self, stream if stream is not None else self.gpu.current_stream())

    def wait(self, stream: Stream | None = None) -> None:
        (stream if stream is not None else self.gpu.current_stream()).wait_event(self)

    def query(self) -> bool:
        """Whether the host clock reached the event (then the host has seen it: Note [a modelled
        copy lands when it is seen]); costs the host ``Rates.poll_s``."""
        return self.gpu._query(self)

    def synchronize(self) -> None:
        """The host waits for the event: its clock moves to the event's time."""
        self.gpu._observe(self)

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds from this event to ``end``, as ``torch.cuda.Event.elapsed_time``."""
        if self.time is None or end.time is None:
            raise RuntimeError("elapsed_time needs both events recorded")
        return (end.time - self.time) * 1e3


class _Engine:
    """What runs the work (the SMs, a copy engine): one thing at a time, in queue order."""

    __slots__ = ("name", "free")

    def __init__(self, name: str) -> None:
        self.name, self.free = name, 0.0


class _Storage:
    """What the model knows of one live storage."""

    __slots__ = ("kind", "nbytes", "stream", "writes", "incoming", "outgoing", "recorded", "tainted")

    def __init__(self, kind: str, nbytes: int, stream: Stream | None) -> None:
        self.kind, self.nbytes, self.stream = kind, nbytes, stream
        self.writes: list[tuple[Stream, tuple[int, int], tuple[int, int]]] = []  # (stream, op key, bytes)
        self.incoming: list[_Copy] = []  # copies writing it, not yet landed
        self.outgoing: list[_Copy] = []  # copies reading it, not yet seen ended
        self.recorded: set[int] = set()  # streams named by record_stream
        self.tainted: list[tuple[tuple[int, int], str]] = []  # Note [a copy of released memory matters when read]


class _Copy:
    __slots__ = ("stream", "key", "end", "label", "data", "dst", "view", "landed", "src_span", "dst_span", "tainted")

    def __init__(self, stream, key, end, label, data, dst, view, src_span, dst_span) -> None:
        self.stream, self.key, self.end, self.label = stream, key, end, label
        self.data, self.dst, self.view, self.landed = data, dst, view, False
        self.src_span, self.dst_span = src_span, dst_span
        self.tainted: str | None = None  # read from a released device buffer: why


# Note [races are found byte range by byte range]
# Order is checked for the bytes an access touches, not for its whole storage: the host tier's
# pool is one pinned slab whose extents are views, and a copy into one extent while another
# extent's copy back runs is no race. Judged per storage, it was reported as one (the soak's seed
# 1513, in 2% of replays on a busy machine: a late save's copy in beside the first copy back). A
# write is remembered with its byte span; a copy with the spans it reads and writes.
def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage that ``t`` covers, ``[lo, hi)``."""
    size = t.element_size()
    lo = t.storage_offset() * size
    if t.numel() == 0:
        return lo, lo
    return lo, lo + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * size


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]
