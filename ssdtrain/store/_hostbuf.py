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

__all__ = ["lead_of", "windows", "HostBufferPool", "HostMapping", "raw_view"]


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
#
# Note [huge pages make large requests]
# The block layer builds a request from the physical pages of the buffer, and a device takes
# at most so many segments per request (virtio-blk here: 254). Into scattered 4 KiB pages, a
# direct read of 64 MiB reached the drive as 126 requests of 0.5 MiB, each with its own
# completion interrupt on a core that is computing; into 2 MiB transparent huge pages, as 16
# requests of 4 MiB (the queue's limit). So a buffer of at least one huge page starts at a
# huge-page boundary (its mapping has one spare huge page of address space to find it) and asks
# for huge pages (``MADV_HUGEPAGE``, honoured when THP is "madvise" or "always") over the whole
# huge pages its payload covers; the partial one at the end keeps small pages, so a buffer never
# holds more memory than its bytes. The mapping is private: Python's default anonymous mapping
# is shared memory, which THP leaves alone. On the bench model, reads per step went from 827 to
# about 200 (0.6 to 2.6 MiB each; many tensors are under a huge page) and the I/O threads' CPU
# time fell by about a third. Writes come from the tensors' own memory, which torch allocates:
# ``THP_MEM_ALLOC_ENABLE=1`` puts that on huge pages too (writes per step 766 to ~160).
HUGE = 2 << 20


def _address(mm: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


class HostMapping:
    """An anonymous mapping and where, in it, buffers of its size start (a huge-page boundary
    when it is large enough)."""

    __slots__ = ("mm", "start")

    def __init__(self, size: int) -> None:
        # Private: ``mmap.mmap(-1, n)`` alone maps shared memory (shmem), which THP leaves alone.
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if size < HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
            self.mm, self.start = mmap.mmap(-1, size, flags=flags), 0
            return
        self.mm = mmap.mmap(-1, size + HUGE, flags=flags)
        self.start = -_address(self.mm) % HUGE
        try:
            self.mm.madvise(mmap.MADV_HUGEPAGE, self.start, size // HUGE * HUGE)
        except OSError:  # THP disabled or not built in: small pages still work
            pass


class HostBufferPool:
    """Page-aligned host buffers that come back for reuse when their tensors die. Thread-safe."""

    GRAIN = 1 << 16

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._idle: dict[int, list[HostMapping]] = {}
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
        first and last pages its own (room for whole-page direct I/O). Buffers of a huge page
        or more start on a huge page (Note [huge pages make large requests])."""
        size = -(-align_up(lead + max(nbytes, 1)) // self.GRAIN) * self.GRAIN
        with self._lock:
            free = self._idle.get(size)
            m = free.pop() if free else None
            if m is not None:
                self._idle_bytes -= size
                self.reused += 1
            else:
                self.created += 1
        if m is None:
            m = HostMapping(size)
        arr = (ctypes.c_char * size).from_buffer(m.mm, m.start)
        weakref.finalize(arr, self._give_back, m, size).atexit = False
        return torch.frombuffer(arr, dtype=torch.uint8)[lead:lead + nbytes]

    def _give_back(self, m: HostMapping, size: int) -> None:
        # Runs while the buffer object dies, before it has released the mapping: never close it
        # here. A mapping not kept is unmapped when its last reference goes.
        with self._lock:
            if not self._closed and self._idle_bytes + size <= self.limit:
                self._idle.setdefault(size, []).append(m)
                self._idle_bytes += size

    def close(self) -> None:
        """Drops the idle buffers; buffers still in use are unmapped when their tensors die."""
        with self._lock:
            self._closed = True
            idle, self._idle, self._idle_bytes = self._idle, {}, 0
        for ms in idle.values():
            for m in ms:
                try:
                    m.mm.close()
                except BufferError:  # still exported by a dying buffer: unmapped with it
                    pass
