"""Which saved tensors share a storage, and what state each stored copy is in.

One :class:`Entry` per live storage region saved for backward (saving it again, or a view of
it, adds a :class:`Ref`, not an entry); the entry moves through the states below while the
engine (``ssdtrain/offloader.py``) writes, frees, forwards and reloads it. Nothing here does I/O.

States::

    KEPT ◄──────────── (policy: small, last layers, backpressure, failed write)
    QUEUED ──► WRITING ──► WRITTEN ──(safe point)──► ON_DISK ──► FREED
       │          │           │                        ▲ (reads fill/drop ``loaded``)
       └──────────┴───────────┴─ cancel / forward ─► KEPT
"""

from __future__ import annotations

import enum
import weakref
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["State", "Entry", "Ref", "StorageIndex", "byte_span", "rebuild", "byte_view"]

# The widest element (complex128): entry spans start on a multiple of it, so every view of the
# storage, whatever its dtype, lands on a whole element of the rebuilt buffer.
SPAN_ALIGN = 16


class State(enum.Enum):
    KEPT = "kept"          # in memory only, never written (or no longer: forwarded, cancelled)
    QUEUED = "queued"      # in memory, write waiting in the queue (cancellable)
    WRITING = "writing"    # in memory, write in flight
    WRITTEN = "written"    # on storage, memory not yet dropped (that happens at a safe point)
    ON_DISK = "on_disk"    # on storage only; ``loaded`` may hold a read-back copy
    FREED = "freed"        # no reference left; extent returned


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` of ``t``'s storage that ``t`` can reach."""
    size = t.element_size()
    lo = t.storage_offset() * size
    reach = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return lo, lo + (reach + 1) * size


def byte_view(storage: torch.UntypedStorage, lo: int, n: int, device: torch.device) -> torch.Tensor:
    """A 1-D uint8 tensor over ``n`` bytes of ``storage`` starting at byte ``lo`` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, lo, (n,), (1,))


def rebuild(buf: torch.Tensor, ref: Ref) -> torch.Tensor:
    """The tensor ``ref`` describes, as a view on ``buf`` (whose byte 0 is the entry's ``lo``).

    Note [views come back as views]: every save of one entry is rebuilt on the same buffer with
    its own dtype, size, stride and offset, so overlapping views still overlap after a reload.
    """
    byte_offset = buf.storage_offset() + ref.offset
    size = ref.dtype.itemsize
    assert byte_offset % size == 0, "a view was rebuilt off its element boundary"
    out = torch.empty(0, dtype=ref.dtype, device=buf.device)
    return out.set_(buf.untyped_storage(), byte_offset // size, ref.size, ref.stride)


class Entry:
    """One stored region of one storage, shared by every save of it."""

    __slots__ = (
        "id", "key", "version", "storage_ref", "lo", "nbytes", "device", "scope", "layer", "state",
        "data", "guard", "guard_weak", "extent", "checksum", "write_future", "read_future", "read_buf",
        "loaded", "loaded_weak", "gen", "unpacked_refs", "consumed_pass", "refs", "error",
        "tainted", "fence", "forwarded", "offloaded", "counted_ahead",
        "__weakref__",
    )

    def __init__(self, id_: int, t: torch.Tensor, lo: int, hi: int, scope: Any, layer: int | None) -> None:
        storage = t.untyped_storage()
        self.id = id_
        self.key = storage._cdata
        self.version = t._version
        # Note [a storage is not its address]: the weak reference tells a live storage from a new
        # one that the allocator placed at the same address after the old one was freed.
        self.storage_ref = StorageWeakRef(storage)
        self.lo = lo
        self.nbytes = hi - lo
        self.device = t.device
        self.scope = scope
        self.layer = layer
        self.state = State.KEPT
        self.data: torch.Tensor | None = byte_view(storage, lo, hi - lo, t.device)
        # The version counter is shared by ``t`` and its detached alias. Holding ``t`` itself would
        # tie an op's output to its own grad_fn through C++ (a cycle no collector can break), so
        # the entry holds the alias strongly while the bytes matter, and ``t`` only weakly.
        self.guard: torch.Tensor | None = t.detach()
        self.guard_weak: weakref.ref | None = weakref.ref(t)
        self.extent = None
        self.checksum = None
        self.write_future = None
        self.read_future = None
        self.read_buf: torch.Tensor | None = None
        self.loaded: torch.Tensor | None = None
        self.loaded_weak: weakref.ref | None = None
        self.gen = 0
        self.unpacked_refs = 0
        self.consumed_pass = -1
        self.refs = 0
        self.error: BaseException | None = None
        self.tainted: str | None = None
        self.fence = None
        self.forwarded = False
        self.offloaded = False
        self.counted_ahead = False

    def covers(self, lo: int, hi: int) -> bool:
        return self.lo <= lo and hi <= self.lo + self.nbytes

    def current_version(self) -> int | None:
        """The saved tensor's version now, if it (or its base) can still be seen."""
        guard = self.guard if self.guard is not None else (self.guard_weak() if self.guard_weak else None)
        return None if guard is None else guard._version

    def check_version(self) -> None:
        """Note [in-place after save]: remember (in ``tainted``) a modification since the save."""
        now = self.current_version()
        if now is not None and now != self.version and self.tainted is None:
            self.tainted = (
                f"one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: [{self.device.type} tensor of {self.nbytes} bytes, saved in layer "
                f"{self.layer}] is at version {now}; expected version {self.version} instead. "
                "(detected by ssdtrain; the same code fails this way without offloading)"
            )

    def release_memory(self) -> None:
        """Drops the in-memory copy (after it is safely on storage)."""
        self.guard = None
        self.data = None


class Ref:
    """What autograd holds for one save: the entry, and how to rebuild this save's view."""

    __slots__ = ("entry", "dtype", "size", "stride", "offset", "gen", "graveyard", "__weakref__")

    def __init__(self, entry: Entry, t: torch.Tensor, graveyard) -> None:
        self.entry = entry
        self.dtype = t.dtype
        self.size = tuple(t.shape)
        self.stride = t.stride()
        self.offset = t.storage_offset() * t.element_size() - entry.lo
        self.gen = -1
        self.graveyard = graveyard

    def __del__(self) -> None:
        # Note [release at a safe point]: autograd drops saved references wherever it likes (even
        # from inside our own pack, through the garbage collector), so a dying Ref only files
        # itself; the engine settles the count under its lock at its next safe point.
        try:
            self.graveyard.append((self.entry, self.gen))
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


class StorageIndex:
    """Finds the live entry for a storage region saved again; never matches a stale storage."""

    def __init__(self) -> None:
        self._by_key: dict[int, list[Entry]] = {}

    def find(self, t: torch.Tensor, lo: int, hi: int) -> Entry | None:
        key = t.untyped_storage()._cdata
        bucket = self._by_key.get(key)
        if not bucket:
            return None
        version = t._version
        for entry in list(bucket):
            if entry.storage_ref.expired():
                bucket.remove(entry)
                continue
            # Same storage and same version: the bytes are those the entry holds (or wrote).
            if entry.version == version and entry.covers(lo, hi) and entry.state is not State.FREED:
                return entry
        if not bucket:
            del self._by_key[key]
        return None

    def add(self, entry: Entry) -> None:
        self._by_key.setdefault(entry.key, []).append(entry)

    def remove(self, entry: Entry) -> None:
        bucket = self._by_key.get(entry.key)
        if bucket and entry in bucket:
            bucket.remove(entry)
            if not bucket:
                del self._by_key[entry.key]

    def __len__(self) -> int:
        return sum(len(b) for b in self._by_key.values())
