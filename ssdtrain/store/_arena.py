"""What the file backends (posix, kvikio) share: arenas, striping, extents, deferred trim, counters.

An arena is one unlinked file on one path with its allocator. A backend built on this class keeps
``self._arenas`` (objects with ``index``, ``path``, ``lock``, ``alloc``, ``leads``, ``queued``,
``written``, ``read``, ``trimming``, ``direct``, ``pool`` and ``fileno()``) and does the I/O.
"""

from __future__ import annotations

import logging
import threading

import torch

from ssdtrain.store import _fs
from ssdtrain.store._hostbuf import HostBufferPool
from ssdtrain.store.base import ALIGN, Backend, Extent

log = logging.getLogger(__name__)

TRIM_AFTER_SECONDS = 60.0
"""Arena space that stays free this long is punched, so that the drive can trim it."""
TRIM_BATCH_BYTES = 256 << 20
"""At most this much is punched per trim task (punching stalls direct I/O on the file)."""


class ArenaBackend(Backend):
    """Placement and bookkeeping over ``self._arenas``; subclasses open them and move the bytes."""

    def __init__(self, pool_bytes: int) -> None:
        self._arenas: list = []
        self._pool = HostBufferPool(pool_bytes)
        self._place_lock = threading.Lock()
        self._closed = False

    def _warn_ram_backed(self) -> None:
        for a in self._arenas:
            if _fs.is_ram_backed(a.path):
                log.warning("ssdtrain: %s is RAM-backed (%s): offloading there saves no memory",
                            a.path, _fs.fs_type(a.path))

    def allocate(self, nbytes: int) -> Extent:
        with self._place_lock:
            # Stripe by load: the path with the fewest bytes waiting gets the next extent.
            arena = min(self._arenas, key=lambda a: (a.queued, a.alloc.used_bytes))
            with arena.lock:
                # One spare page: a host tensor's payload starts at its lead within the first page.
                offset, length = arena.alloc.allocate(max(nbytes, 1) + (ALIGN if arena.direct else 0))
        return Extent(arena.index, offset, nbytes, length)

    def free(self, extent: Extent) -> None:
        arena = self._arenas[extent.path_index]
        with arena.lock:
            arena.leads.pop(extent.offset, None)
            arena.alloc.free(extent.offset, extent.length)
            # Note [trim what stays free]: no punch here (on the main thread, stalling every direct
            # I/O in flight on the file, for space the next step overwrites anyway).
            if self._closed or arena.trimming or not arena.alloc.trim_due(TRIM_AFTER_SECONDS):
                return
            ranges = arena.alloc.begin_trim(TRIM_AFTER_SECONDS, max_bytes=TRIM_BATCH_BYTES)
            arena.trimming = True
        try:
            arena.pool.submit(self._punch, arena, ranges)
        except RuntimeError:  # the pool is shutting down
            self._punched(arena, ranges)

    def _punch(self, arena, ranges: list[tuple[int, int]]) -> None:
        try:
            for off, length in ranges:
                if not _fs.punch_hole(arena.fileno(), off, length):
                    break
        except OSError as e:
            log.warning("ssdtrain: could not punch a hole in the arena on %s: %s", arena.path, e)
        finally:
            self._punched(arena, ranges)

    def _punched(self, arena, ranges: list[tuple[int, int]]) -> None:
        with arena.lock:
            arena.alloc.end_trim(ranges)
            arena.trimming = False

    def alloc_buffer(self, nbytes: int, device: torch.device, extent: Extent | None = None) -> torch.Tensor:
        """A reload buffer; given the extent it will receive, one that the read fills in place
        (reused memory, Note [reuse reload memory]); a plain one for a GPU."""
        if device.type != "cpu":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._pool.take(nbytes, 0 if extent is None else self._lead(extent))

    def _lead(self, extent: Extent) -> int:
        """Where the extent's payload starts within its first page (as in the written tensor)."""
        arena = self._arenas[extent.path_index]
        with arena.lock:
            return arena.leads.get(extent.offset, 0)

    def _count_read(self, arena, fut, nbytes: int) -> None:
        def count(f) -> None:
            if f.exception() is None:
                with arena.lock:
                    arena.read += nbytes
        fut.add_done_callback(count)

    def _settle(self, arena, nbytes: int, *, written: bool) -> None:
        with arena.lock:
            arena.queued -= nbytes
            if written:
                arena.written += nbytes

    def written_bytes_by_path(self) -> dict[str, int]:
        return {a.path: a.written for a in self._arenas}

    def read_bytes_by_path(self) -> dict[str, int]:
        return {a.path: a.read for a in self._arenas}
