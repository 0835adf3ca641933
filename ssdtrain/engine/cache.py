"""Which saved tensors share a storage, and what state each stored copy is in.

One :class:`Entry` per live storage region saved for backward (saving it again, or a view of
it, adds a :class:`Ref`, not an entry); the entry moves through the states below while the
engine (``ssdtrain/engine/offloader.py``) writes, frees, forwards and reloads it. Nothing here does I/O.

States::

    KEPT ◄──────────── (policy: small, last layers, backpressure, failed write)
    QUEUED ──► WRITING ──► WRITTEN ──(safe point)──► ON_DISK ──► FREED
       │          │           │                        ▲ (reads fill/drop ``loaded``)
       └──────────┴───────────┴─ cancel / forward ─► KEPT
"""

from __future__ import annotations

import enum
import weakref
from collections import deque
from typing import Any

import torch

from ssdtrain.engine.ref import COUNTED, FILED, OWED, Ref  # noqa: F401  (Ref: re-exported)
from ssdtrain.engine.small import Small, SmallSaves, StorageRef
from ssdtrain.engine.views import (SPAN_ALIGN, Span, byte_span, byte_view, entry_span, modified,  # noqa: F401
                                   rebuild, rebuild_on)

__all__ = ["State", "Entry", "Ref", "Small", "SmallSaves", "StorageIndex", "Cache", "byte_span", "entry_span",
           "rebuild", "rebuild_on", "byte_view", "Span"]


class State(enum.Enum):
    KEPT = "kept"          # in memory only, never written (or no longer: forwarded, cancelled)
    QUEUED = "queued"      # in memory, write waiting in the queue (cancellable)
    WRITING = "writing"    # in memory, write in flight
    WRITTEN = "written"    # on storage, memory not yet dropped (that happens at a safe point)
    ON_DISK = "on_disk"    # on storage only; ``loaded`` may hold a read-back copy
    FREED = "freed"        # no reference left; extent returned


class Entry:
    """One stored region of one storage, shared by every save of it (``grouped``: a
    :class:`~ssdtrain.engine.group.Group`, of several storages)."""

    grouped = False

    __slots__ = (
        "id", "key", "version", "storage_ref", "lo", "nbytes", "device", "scope", "layer", "state",
        "data", "guard", "guard_weak", "extent", "checksum", "write_future", "read_future", "read_buf",
        "loaded", "loaded_weak", "gen", "unpacked_refs", "consumed_pass", "refs", "error",
        "tainted", "fence", "forwarded", "offloaded", "counted_ahead", "ref_weaks",
        "scope_dropped", "packed_at", "op", "stream", "pos", "dying", "__weakref__",
    )

    def __init__(self, id_: int, t: torch.Tensor, lo: int, hi: int, scope: Any, layer: int | None,
                 storage: torch.UntypedStorage | None = None) -> None:
        if storage is None:
            storage = t.untyped_storage()
        self.id = id_
        self.key = storage._cdata
        self.version = t._version
        # Note [a storage is not its address]: the weak reference tells a live storage from a new
        # one that the allocator placed at the same address after the old one was freed.
        self.storage_ref = weak = StorageRef()
        weak.cdata = storage._weak_ref()
        self.lo = lo
        self.nbytes = hi - lo
        self.device = t.device
        self.scope = scope
        self.layer = layer
        self.state = State.KEPT
        self.data: torch.UntypedStorage | None = storage  # Note [an entry's bytes are its storage's]
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
        self.ref_weaks: list[weakref.ref] = []
        self.scope_dropped = False  # its scope was told it died (once)
        self.packed_at = 0.0  # when it was queued for writing (perf_counter; WriteQueue.hold)
        self.op = None  # the op that saved it (Note [a save is copied only after its op returned]); None: none to wait for
        self.stream = None  # the stream current at its pack (a CUDA save's), fenced once its op returned
        self.pos = -1  # its place in its scope's pack order (Scope.add)
        self.dying = 0  # its Refs in the graveyard, a hint (Note [deaths that hold no memory wait])

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
            self.tainted = modified(f"{self.device.type} tensor of {self.nbytes} bytes, saved in layer {self.layer}",
                                    now, self.version)

    def release_memory(self) -> None:
        """Drops the in-memory copy (after it is safely on storage)."""
        self.guard = None
        self.data = None

    def span(self) -> Span:
        """Its bytes, for the host tier's copy (Note [an entry's bytes are its storage's])."""
        return Span(self.data, self.lo, self.nbytes, self.device)


# Note [a freed entry is in no cycle]
# An entry and its scope held each other (``Entry.scope``, ``Scope.order``), and a group and its
# parts did (``Part.entry``, ``Group.parts``): so nothing of a save (its entry or group, parts,
# extents, storage handles, weak references, shapes: about 1,200 objects a step of pack_cost's GPT)
# was freed when its last reference died, only by the cyclic collector. Those objects counted
# towards every young collection, and the ones that lived through one towards the full collections
# of the whole process (76 ms each with torch imported, on the training thread, 2026-11-29). So a
# freed group's parts let go of it (``Cache.release``) and a scope forgotten lets go of its pack
# order (``Scopes.forget_if_empty``): a step leaves no cyclic garbage of ours
# (tests/test_pack_calls.py counts it); the tier's pack fell x0.873 (in-process A/B, 7 rounds).


_SHAREABLE = (State.KEPT, State.QUEUED)


class StorageIndex:
    """Finds the live entry for a storage region saved again; never matches a stale storage."""

    def __init__(self) -> None:
        self._by_key: dict[int, list[Entry]] = {}
        self.keys = self._by_key  # ``key in keys``: whether ``find`` can find anything (no call)

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
            # Note [a new save sees the bytes as they are now]: same storage and same version, and
            # the bytes have not started to leave memory. A write PyTorch cannot see (through
            # ``.data``, ``set_`` on an alias, numpy) bumps no version; once an entry's bytes are
            # on their way to the drive, a new save of the storage gets an entry of its own, so
            # it reads back the bytes it saw, not those written before such a change.
            if entry.version == version and entry.state in _SHAREABLE and entry.covers(lo, hi):
                return entry
        if not bucket:
            del self._by_key[key]
        return None

    def add(self, entry: Entry) -> None:
        bucket = self._by_key.get(entry.key)
        if bucket is None:  # the common case, in one call
            self._by_key[entry.key] = [entry]
        else:
            bucket.append(entry)

    def remove(self, entry: Any) -> None:
        """Forgets ``entry`` (a group entry: each of its parts)."""
        if entry.key is None:  # a group entry (Note [saves handed over together share an entry])
            for part in entry.parts:
                self.remove(part)
            return
        bucket = self._by_key.get(entry.key)
        if bucket and entry in bucket:
            bucket.remove(entry)
            if not bucket:
                del self._by_key[entry.key]

    def __len__(self) -> int:
        return sum(len(b) for b in self._by_key.values())


class Cache:
    """The live entries, their index, and the byte counts that follow their states.

    Every state change of an entry is a method here, so that ``resident`` (saved bytes the
    offloader holds in memory: the storages not yet released, and the buffers read back) and
    ``disk_bytes`` (extents reserved) always agree with the entries. The engine calls these under
    its lock; ``counters`` is its :class:`~ssdtrain.engine.stats.Counters`.
    """

    def __init__(self, counters: Any, free_extent: Any) -> None:
        self.index = StorageIndex()
        self.entries: dict[int, Entry] = {}
        self.counters = counters
        self.disk_bytes = 0
        self._free = free_extent  # backend.free
        self.late: list[tuple[Any, Any]] = []  # (extent, read future) of freed entries still being read
        self.small = SmallSaves(counters)  # Note [a small save skips the cache]
        self.lagging: deque[Entry] = deque()  # written, held back by settle_written's ``due``

    def new(self, id_: int, t: torch.Tensor, lo: int, hi: int, scope: Any, layer: int | None,
            storage: torch.UntypedStorage | None = None) -> Entry:
        """A new entry for ``t``'s bytes ``[lo, hi)`` (of ``storage``, its storage, where the caller
        has it), KEPT (in memory) until it is queued."""
        e = Entry(id_, t, lo, hi, scope, layer, storage)
        self.index.add(e)
        self.entries[e.id] = e
        self.counters.add(scope.stats_id, "unique_bytes", e.nbytes)
        self.counters.resident(e.nbytes)
        return e

    def add_group(self, g: Entry) -> None:
        """A new group entry (Note [saves handed over together share an entry] in ``group.py``),
        KEPT until it is handed over, with its first part."""
        self.entries[g.id] = g
        self.add_part(g.parts[0], g.scope.stats_id)

    def add_part(self, p: Any, stats_id: Any) -> None:
        """A storage joined a group entry."""
        self.index.add(p)
        self.counters.add(stats_id, "unique_bytes", p.nbytes)
        self.counters.resident(p.nbytes)

    def queue(self, e: Entry, extent: Any) -> None:
        """KEPT -> QUEUED: ``extent`` reserved for its write."""
        e.extent = extent
        self.disk_bytes += extent.length
        e.state = State.QUEUED
        e.offloaded = True

    def cancel(self, e: Entry) -> None:
        """QUEUED -> KEPT: the write will not happen."""
        e.state = State.KEPT
        self.free_extent(e)
        self.counters.add(e.scope.stats_id, "cancelled_writes", 1)

    def written(self, e: Entry, checksum: Any) -> bool:
        """A write finished: WRITING -> WRITTEN (True), or the entry died meanwhile (False)."""
        self.counters.add(e.scope.stats_id, "written_bytes", e.nbytes)
        self.counters.add(e.scope.stats_id, "writes", 1)
        e.checksum = checksum
        if e.state is State.WRITING:
            e.state = State.WRITTEN
            return True
        if e.state is State.FREED and e.extent is not None:
            self.free_extent(e)
        return False

    def write_failed(self, e: Entry) -> bool:
        """A write failed: Note [a failing drive does not corrupt training]: the bytes never left
        memory (they are dropped only after a successful write), so the entry simply stays, KEPT
        (True); or it died meanwhile and only its extent goes (False)."""
        self.counters.add(e.scope.stats_id, "failed_writes", 1)
        if e.state is not State.FREED:
            self.keep_after_error(e)
            return True
        if e.extent is not None:
            self.free_extent(e)
        return False

    def keep_after_error(self, e: Entry) -> None:
        """A write failed (or could not be placed): the bytes never left memory; KEPT."""
        if e.extent is not None:
            self.free_extent(e)
        e.state = State.KEPT
        self.counters.add(e.scope.stats_id, "kept_bytes", e.nbytes)

    def drop_memory(self, e: Entry) -> None:
        """WRITTEN -> ON_DISK: the in-memory copy goes (after it is safely on storage)."""
        e.release_memory()
        e.state = State.ON_DISK
        self.counters.resident(-e.nbytes)

    def settle_written(self, completed: Any, due: Any = None) -> None:
        """Drops the memory of entries whose write completed (a deque, emptied): Note [release at
        a safe point], after one more version check; those inside the read-ahead window stay
        (backward needs them soon). ``due(e)``, if given, says whether ``e`` may go now; those it
        holds back wait in ``lagging``, in order, for a later call (the host tier's copies)."""
        while self.lagging and due is not None:
            e = self.lagging[0]
            if e.state is State.WRITTEN and not due(e):
                break
            self.lagging.popleft()
            self._settle(e)
        while completed:
            e = completed.popleft()
            if e.state is State.WRITTEN and due is not None and (self.lagging or not due(e)):
                self.lagging.append(e)
                continue
            self._settle(e)

    def _settle(self, e: Entry) -> None:
        if e.state is State.WRITTEN:
            e.check_version()
            if not e.counted_ahead:
                self.drop_memory(e)

    def orphan_on_disk(self) -> None:
        """The store is closing: saves only on storage can no longer be unpacked (a clear error)."""
        for e in self.entries.values():
            if e.state is State.ON_DISK and e.loaded is None:
                e.error = RuntimeError("ssdtrain: this saved tensor was on storage when its Offloader was "
                                       "closed; run backward before close()")

    def reading(self, e: Entry, buf: torch.Tensor, future: Any) -> None:
        """A read into ``buf`` is in flight."""
        e.read_buf, e.read_future = buf, future
        self.counters.add(e.scope.stats_id, "reads", 1)
        self.counters.resident(e.nbytes)

    def read_failed(self, e: Entry, future: Any) -> None:
        if e.read_future is future:
            e.read_future = e.read_buf = None
            self.counters.resident(-e.nbytes)

    def unread(self, e: Entry) -> None:
        """A read ahead, finished and not used, is given back (Note [backward that jumps down the
        pack order]): ``e`` is on storage only, as before it was read."""
        if e.read_future is not None and e.read_future.done():
            e.read_future = e.read_buf = None
            self.counters.resident(-e.nbytes)

    def unread_loaded(self, e: Entry) -> None:
        """A group's buffers, one of them let go, are given back: it is read again (Note [a group's
        buffers go part by part] in ``group.py``)."""
        e.loaded = None
        self.counters.resident(-e.nbytes)

    def read_done(self, e: Entry, future: Any, buf: torch.Tensor) -> None:
        if e.read_future is future:
            e.loaded, e.read_buf, e.read_future = buf, None, None

    def forwarded(self, e: Entry) -> None:
        """Backward takes an offloaded entry from memory, with no read (counted once)."""
        if not e.forwarded and e.offloaded:
            e.forwarded = True
            self.counters.add(e.scope.stats_id, "forwarded_bytes", e.nbytes)

    def unload(self, e: Entry) -> None:
        """Once every live save of a reloaded entry has been unpacked, its buffer is held weakly
        (a later pass, with ``retain_graph``, finds it while autograd still holds it)."""
        if e.loaded is not None and e.unpacked_refs >= e.refs:
            if e.grouped:
                for p in e.parts:
                    p.unpacked = 0
            e.loaded_weak = weakref.ref(e.loaded)
            e.loaded = None
            e.consumed_pass = e.scope.passes
            e.gen += 1
            e.unpacked_refs = 0
            self.counters.resident(-e.nbytes)

    def give_back(self, e: Entry, gen: int, weak: Any) -> bool:
        """A Ref of ``e`` died: its count goes back, once per Ref (``weak``; None: ``e`` has no
        count and no Ref left); returns whether ``e`` must be released now (the last count)."""
        if weak is not None:
            if weak.filed == COUNTED:
                return False
            e.refs -= 1
            weak.filed = COUNTED  # no call between the two stores: given back exactly once
            if gen == e.gen:
                e.unpacked_refs -= 1
        if e.refs > 0:
            self.unload(e)
            return False
        return e.state is not State.FREED

    def release(self, e: Entry) -> State:
        """The last reference died: the entry goes (FREED); returns the state it was in. Its
        extent is freed here unless a write or a read still uses it (the caller sees to it)."""
        self.index.remove(e)
        self.entries.pop(e.id, None)
        state, e.state = e.state, State.FREED
        if e.data is not None:
            self.counters.resident(-e.nbytes)
        if e.loaded is not None or e.read_future is not None:
            self.counters.resident(-e.nbytes)
        if e.extent is not None and e.read_future is not None and not e.read_future.done():
            # The read still fills its buffer: the extent goes back only when it is done.
            ext, e.extent = e.extent, None
            self.late.append((ext, e.read_future))
        elif e.extent is not None and state is not State.WRITING:
            self.free_extent(e)
        e.release_memory()  # a group's parts' storages too
        e.loaded = e.read_buf = e.read_future = None
        if e.grouped:  # Note [a freed entry is in no cycle]
            for p in e.parts:
                p.entry = None
        return state

    def lost_refs(self) -> list[tuple[Entry, Any]]:
        """Note [a lost __del__ is found again]: a KeyboardInterrupt can strike as a dying Ref's
        ``__del__`` begins (Python checks for signals on entering a function), and the Ref then
        never files itself; or between a new entry and its first Ref, or as a release began.
        Each entry holds weak references to its Refs, which die with no code run: a Ref dead and
        still OWED owes its count (``(entry, weak)``); an entry with no count and no Ref left
        (none alive, none in the graveyard) is dead (``(entry, None)``)."""
        owed = []
        for e in list(self.entries.values()):
            owed += [(e, w) for w in e.ref_weaks if w() is None and w.filed == OWED]
            e.ref_weaks = [w for w in e.ref_weaks if w() is not None or w.filed == FILED]
            if e.refs <= 0 and not e.ref_weaks:
                owed.append((e, None))
        return owed

    def free_late(self) -> None:
        """Gives back the extents whose reads into dropped buffers are done."""
        if not self.late:
            return
        done = [item for item in self.late if item[1].done()]
        self.late = [item for item in self.late if not item[1].done()]
        for extent, _ in done:
            self.disk_bytes -= extent.length
            self._free(extent)

    def recount(self) -> None:
        """Derives the resident and disk byte counts from the entries again (after an interrupt
        cut a state change short: Note [an interrupt never unbalances a count])."""
        self.small.settle()
        self.small.heal()
        resident, disk = self.small.live_bytes, 0
        for e in self.entries.values():
            resident += e.nbytes * ((e.data is not None) + (e.loaded is not None or e.read_future is not None))
            disk += e.extent.length if e.extent is not None else 0
        self.disk_bytes = disk + sum(extent.length for extent, _ in self.late)
        t = self.counters.total
        if t.resident_bytes != resident:
            self.counters.resident(resident - t.resident_bytes)

    def lose_extent(self, e: Entry) -> None:
        """A write may be in flight that no one will hear finish: the entry stays in memory
        (KEPT) and its extent is never given back (counted in ``lost_bytes``)."""
        e.state = State.KEPT
        ext, e.extent = e.extent, None
        self.counters.add(e.scope.stats_id, "lost_bytes", ext.length)
        self.disk_bytes -= ext.length

    def free_extent(self, e: Entry) -> None:
        ext, e.extent = e.extent, None  # first: an interrupted free leaks space, never frees twice
        self.disk_bytes -= ext.length
        self._free(ext)

    def __len__(self) -> int:
        return len(self.entries)
