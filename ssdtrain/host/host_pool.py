"""The host tier's memory: a bounded pool of pinned host memory, pinned in slabs as it fills.

:class:`HostPool` holds the tier's bytes (never a pinned allocation per tensor: each costs
milliseconds and synchronises the device), :class:`HostExtent` is a place in it, and
:func:`auto_host_bytes` sizes it by default. ``tier.py`` moves saves in and out of it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from ssdtrain.device import cuda as device
from ssdtrain.store._pool import IOPool
from ssdtrain.store.allocator import ExtentAllocator

__all__ = ["auto_host_bytes", "HostExtent", "HostPool"]

log = logging.getLogger(__name__)

SLAB = 512 << 20
"""Bytes pinned at once (about 0.35 s on an H100's host); a larger save gets a slab of its size."""
ALIGN = 4096
"""Every extent's offset and reserved length are multiples of this."""
AUTO_SHARE = 0.25
"""Of the RAM available, what the tier takes by default (then divided among the local ranks)."""
GROW_AT = 0.85
"""A new slab is pinned ahead of need once this share of the pinned bytes is in use. At a half, a
pool kept twice its use pinned (7168 MiB for 3.2 GiB of block inputs on an H200, 2026-11-27);
pinned memory is what the data loader's and the collectives' buffers need too. A refusal pins up
to the demand anyway (Note [the pool grows to its demand])."""


def auto_host_bytes(environ: dict | None = None) -> tuple[int, str]:
    """The default size of the tier and how it was chosen: ``AUTO_SHARE`` of the RAM available
    now (``MemAvailable``, or what a container's memory limit leaves, if less), divided among the
    local ranks (``LOCAL_WORLD_SIZE``, else 1). ``ulimit -l`` is not a cap: the CUDA driver pins
    without it. Where pinning is refused anyway, the pool stops growing with a warning."""
    env = os.environ if environ is None else environ
    avail, where = _mem_available()
    try:
        ranks = max(1, int(env.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    n = int(avail * AUTO_SHARE) // ranks
    return n, f"{AUTO_SHARE:.0%} of {avail >> 20} MiB available ({where}) / {ranks} local rank(s)"


def _mem_available() -> tuple[int, str]:
    avail, where = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free pages"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail, where = int(line.split()[1]) * 1024, "MemAvailable"
    except OSError:
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f, open(usage_file) as g:
                raw, used = f.read().strip(), int(g.read().strip())
        except (OSError, ValueError):
            continue
        if raw.isdigit() and int(raw) - used < avail:
            avail, where = max(0, int(raw) - used), "the container's memory limit"
        break
    return avail, where


def _host_empty(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


class HostExtent:
    """A place in the pool. ``length`` 0 and ``path_index`` -1: it holds no drive space.
    ``landed``: the :class:`~ssdtrain.device.cuda.Fence` after its copy in (set on the copy thread
    before the write's future completes); ``due``: the forward position at which that copy is
    predicted done (:class:`~ssdtrain.host.copy_clock.CopyClock`)."""

    __slots__ = ("slab", "offset", "reserved", "nbytes", "length", "path_index", "landed", "due", "back", "ordered")

    def __init__(self, slab: int, offset: int, reserved: int, nbytes: int) -> None:
        self.slab, self.offset, self.reserved, self.nbytes = slab, offset, reserved, nbytes
        self.length, self.path_index = 0, -1
        self.landed: Any = None
        self.due = float("inf")
        self.back: Any = None  # the Fence after its last copy back to the device
        self.ordered: Any = None  # the copy back a consumer's stream was made to wait for (Note [a pool extent outlives its copy back])


class GroupExtent:
    """The host extents of a group entry's parts, in order (Note [saves handed over together share
    an entry] in ``engine/group.py``), answering for them as one: no drive space; due and landed as
    its last copy is (copies of a batch land in order); freed part by part (``TieredBackend.free``).
    ``region``: where the parts after its first are carved (Note [a group's parts are carved from
    one region]), ``used`` of it; None: each part has an extent of its own."""

    __slots__ = ("parts", "region", "used")
    length, path_index = 0, -1

    def __init__(self) -> None:
        self.parts: list[HostExtent] = []
        self.region: HostExtent | None = None
        self.used = 0

    @property
    def last(self) -> HostExtent:
        return self.parts[-1]

    @property
    def landed(self) -> Any:
        return self.parts[-1].landed

    @property
    def due(self) -> float:
        return self.parts[-1].due

    @due.setter
    def due(self, when: float) -> None:
        for ext in self.parts:
            ext.due = when


class HostPool:
    """Pinned host memory in slabs, up to ``capacity`` bytes; thread-safe.

    :meth:`allocate` never pins: when no slab has room it returns ``None`` (the save goes to the
    drives or stays) and the pin thread pins slabs, one after another, until the pool holds what
    was asked of it at once (Note [the pool grows to its demand]), while the capacity allows; so
    the training thread waits for no pinning but the first slab's (:meth:`pin_first`). A slab is
    also pinned ahead of need once ``GROW_AT`` of the pinned bytes are in use. ``pin`` makes a
    slab (a seam for tests).
    """

    def __init__(self, capacity: int, *, pin: Callable[[int], torch.Tensor] = device.pinned_empty,
                 slab: int = SLAB, background: bool = True) -> None:
        self.capacity = capacity
        self._pin = pin
        self._slab = slab
        self._slabs: list[tuple[torch.Tensor, ExtentAllocator]] = []
        self.bases: list[int] = []  # each slab's first byte's address: an extent's is bases[slab] + offset
        self._lock = threading.Lock()
        self._pinning = 0  # bytes being pinned now
        self._thread = IOPool(1, "ssdtrain-pin") if background else None
        self.pinned = 0
        self.used = 0
        self.peak = 0
        self.error: str | None = None  # why pinning stopped, if it did
        self.wanted = 0  # the most bytes asked of the pool at once (Note [the pool grows to its demand])
        self._refused = 0  # bytes refused since the pool was last empty
        self._big = 0  # the largest save refused for want of a slab its size

    def allocate(self, nbytes: int, *, wanted: bool = True) -> HostExtent | None:
        """An extent for ``nbytes``, or None; ``wanted`` False: neither a refusal nor the use is a
        demand (the pool does not grow for it: a group's region, whose unused tail soon goes back,
        Note [a group's parts are carved from one region])."""
        ext = None
        with self._lock:
            for i, (mem, alloc) in enumerate(self._slabs):
                off, length = alloc.allocate(nbytes)
                if off + length <= mem.numel():
                    used = self.used = self.used + length
                    if used > self.peak:
                        self.peak = used
                    ext = HostExtent(i, off, length, nbytes)
                    break
                alloc.free(off, length, trimmed=True)
            if ext is None and nbytes and wanted:
                self._refused += nbytes
                # at least a slab more than now, as a refusal always asked (a hole too small)
                self.wanted = max(self.wanted, self.used + self._refused, self.pinned + nbytes)
                if nbytes > self._slab:
                    self._big = max(self._big, nbytes)
            grow = self._grow_size() if wanted else 0
        if grow:
            if self._thread is None:
                self._add_slab(grow)
            else:
                self._thread.submit(self._add_slab, grow)
        return ext

    def _grow_size(self) -> int:
        """Under the lock: the size of a slab to pin now (0: none is needed, or allowed)."""
        if self._pinning or self.error is not None:
            return 0
        if self.pinned >= self.wanted and self.used < GROW_AT * self.pinned and self._slabs:
            return 0
        size = min(max(self._slab, -(-self._big // 4096) * 4096), self.capacity - self.pinned)
        if size <= 0 or size < self._big:
            return 0
        self._pinning = size
        return size

    def _add_slab(self, size: int) -> None:
        while size:
            try:
                mem = self._pin(size)
            except (RuntimeError, MemoryError) as e:  # pinning refused (a cap, no memory): stop growing
                with self._lock:
                    self._pinning = 0
                    self.error = f"pinning {size >> 20} MiB failed ({e}); the tier stays at {self.pinned >> 20} MiB"
                log.warning("ssdtrain: %s", self.error)
                return
            with self._lock:
                self._slabs.append((mem, ExtentAllocator(ALIGN)))
                self.bases.append(mem.data_ptr())
                self.pinned += size
                self._pinning = 0
                if size >= self._big:
                    self._big = 0
                # Note [the pool grows to its demand]: on until the pool holds what was asked of it
                size = self._grow_size() if self.pinned < self.wanted else 0

    # Note [the pool grows to its demand]: a save the pool has no room for goes to the drives (or
    # stays), and the pin thread pins slabs one after another until ``pinned`` reaches ``wanted``,
    # the most bytes asked of the pool at once (in use plus refused since it was last empty), not
    # one slab per refusal. Pinning runs at about 1.5 GB/s (512 MiB in 0.35 s on an H100's host):
    # grown a slab at a time, only while a forward was refused, the pool of a long sequence
    # (recompute+offload at 65536 tokens, 24 block inputs of 128 MiB) stayed short of its 3 GiB
    # through a probe's warm-up steps, and the rest went to the drive or stayed on the GPU.

    def pin_first(self) -> None:
        """Pins the first slab on the calling thread, if none is pinned or being pinned (Note [the
        first step's saves find the pool pinned])."""
        with self._lock:
            size = 0 if self._slabs else self._grow_size()
        if size:
            self._add_slab(size)

    def free(self, ext: HostExtent) -> None:
        with self._lock:
            self._slabs[ext.slab][1].free(ext.offset, ext.reserved, trimmed=True)
            self.used -= ext.reserved
            if not self.used:
                self._refused = 0

    def shrink(self, ext: HostExtent, nbytes: int) -> None:
        """Gives back what ``ext`` reserved beyond its first ``nbytes`` (at least 1)."""
        with self._lock:
            alloc = self._slabs[ext.slab][1]
            try:
                alloc.shrink(ext.offset, nbytes, trimmed=True)
            finally:  # Note [an extent says what its allocator holds]
                held = alloc._allocated.get(ext.offset, ext.reserved)
                self.used -= ext.reserved - held
                ext.reserved = held
            ext.nbytes = nbytes

    # Note [an extent says what its allocator holds]
    # ``ExtentAllocator.shrink`` shortens the extent, then frees the tail in a call of its own: a
    # KeyboardInterrupt as that call began (the random-moment stress with the tier on,
    # tests/test_interrupt.py, 4 of 120 seeds, 2026-11-30) left the extent shortened and ``reserved``
    # as it was, and its free later asked the allocator for the old length (a ValueError). So the
    # extent takes its length from the allocator whatever happened, with no call between (the tail,
    # cut off and not freed, is leaked: Note [leaked, never doubly held] in ``store/allocator.py``).

    def split(self, ext: HostExtent, nbytes: int) -> HostExtent | None:
        """Cuts what ``ext`` reserved beyond its first ``nbytes`` (at least 1) into an extent of
        its own, reserved as it was (Note [a group's region passes on] in ``engine/group.py``);
        None if nothing is left. The pool's use is unchanged."""
        with self._lock:
            alloc, tail = self._slabs[ext.slab][1], None
            try:
                tail = alloc.split(ext.offset, nbytes)
            finally:  # Note [an extent says what its allocator holds]
                ext.reserved = alloc._allocated.get(ext.offset, ext.reserved)
            if tail is None:
                return None
            ext.nbytes = nbytes
        return HostExtent(ext.slab, tail[0], tail[1], tail[1])

    def view(self, ext: HostExtent) -> torch.Tensor:
        """The extent's bytes (1-D uint8, ``ext.nbytes`` long)."""
        return self._slabs[ext.slab][0][ext.offset:ext.offset + ext.nbytes]

    def address(self, ext: HostExtent) -> int:
        """The address of the extent's first byte."""
        return self.bases[ext.slab] + ext.offset

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        with self._lock:
            self._slabs.clear()
            self.bases.clear()
