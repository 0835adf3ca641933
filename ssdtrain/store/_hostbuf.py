"""Host memory for direct I/O without copies: page-window requests and reusable reload buffers.

Shared by the backends that move host tensors with O_DIRECT (posix, and kvikio's POSIX path).
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import weakref
from collections.abc import Iterator

import torch

from ssdtrain.store.base import ALIGN, align_up

__all__ = ["lead_of", "windows", "HostBufferPool", "raw_view"]


# Note [zero-copy direct I/O]
# O_DIRECT needs the file offset, the length and the memory address aligned (to the logical
# block size; 4096 covers every drive). torch's CPU tensors start 64 bytes into a page, and
# copying them through an aligned staging buffer costs about as much memory bandwidth as the
# drive has. Instead an extent keeps its payload at the same offset within a page as the
# tensor's memory: its "lead" (``data_ptr() % 4096``). Every request then covers whole pages of
# memory -- the tensor's own pages, including a few bytes before and after it, which are only
# read -- and whole pages of the file. An extent therefore needs one spare page (``length >=
# align_up(lead + nbytes)``), and a reload buffer with the same lead (``HostBufferPool.take``)
# receives the read in place; a buffer with another lead has to go through staging.
def lead_of(t: torch.Tensor) -> int:
    """Where ``t``'s first byte sits within its memory page (0 for device tensors)."""
    return 0 if t.device.type != "cpu" else t.data_ptr() % ALIGN


def windows(nbytes: int, lead: int, chunk: int, *, direct: bool) -> Iterator[tuple[int, int, int, int]]:
    """The requests that move an extent: ``(window offset, window length, payload start, payload
    end)``. Window offsets are relative to the extent's offset; payload byte ``i`` sits at window
    position ``lead + i``. With ``direct`` the windows cover whole pages; otherwise exactly the
    payload (``lead`` must then be 0)."""
    total = align_up(lead + nbytes) if direct else lead + nbytes
    for w0 in range(0, total, chunk):
        w1 = min(w0 + chunk, total)
        yield w0, w1 - w0, max(w0 - lead, 0), min(w1 - lead, nbytes)


def raw_view(t: torch.Tensor, start: int, n: int) -> memoryview:
    """A writable memoryview of ``n`` bytes at ``t.data_ptr() + start`` (``start`` may be
    negative: the bytes before ``t`` in its page). The caller keeps ``t`` alive."""
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr() + start)).cast("B")


# Note [reuse reload memory]
# A read into freshly allocated host memory first faults every page in, and the kernel zeroes
# each one: on some machines that costs as much as the read itself (measured here: 1 GiB of
# fresh pages ~0.6 s, the drive reads 1 GiB in ~0.9 s). Reload buffers therefore come from
# page-aligned mappings that go back to the pool when the last tensor using them dies (a
# finalizer on the buffer object that ``torch.frombuffer`` keeps alive), so one training step
# reads into the memory the previous step already faulted in. At most ``limit`` idle bytes stay
# pooled.
class HostBufferPool:
    """Page-aligned host buffers that come back for reuse when their tensors die. Thread-safe."""

    GRAIN = 1 << 16

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._idle: dict[int, list[mmap.mmap]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self._closed = False
        self.reused = 0
        self.created = 0

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def take(self, nbytes: int, lead: int = 0) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` starting ``lead`` bytes into a page, with the rest of its
        first and last pages its own (room for whole-page direct I/O)."""
        size = -(-align_up(lead + max(nbytes, 1)) // self.GRAIN) * self.GRAIN
        with self._lock:
            free = self._idle.get(size)
            mm = free.pop() if free else None
            if mm is not None:
                self._idle_bytes -= size
                self.reused += 1
            else:
                self.created += 1
        if mm is None:
            mm = mmap.mmap(-1, size)
        arr = (ctypes.c_char * size).from_buffer(mm)
        weakref.finalize(arr, self._give_back, mm, size).atexit = False
        return torch.frombuffer(arr, dtype=torch.uint8)[lead:lead + nbytes]

    def _give_back(self, mm: mmap.mmap, size: int) -> None:
        # Runs while the buffer object dies, before it has released ``mm``: never close it here.
        # A mapping not kept is unmapped when its last reference goes.
        with self._lock:
            if not self._closed and self._idle_bytes + size <= self.limit:
                self._idle.setdefault(size, []).append(mm)
                self._idle_bytes += size

    def close(self) -> None:
        """Drops the idle buffers; buffers still in use are unmapped when their tensors die."""
        with self._lock:
            self._closed = True
            idle, self._idle, self._idle_bytes = self._idle, {}, 0
        for mms in idle.values():
            for mm in mms:
                try:
                    mm.close()
                except BufferError:  # still exported by a dying buffer: unmapped with it
                    pass
