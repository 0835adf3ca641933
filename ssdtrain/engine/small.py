"""Saves too small to ever be written, held without the cache's machinery (Note [a small save skips
the cache]); also the saves a forward's budget or the peak rule keeps (Note [a save the budget keeps
skips the cache] in ``offloader.py``)."""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from ssdtrain.engine.views import modified

__all__ = ["Small", "SmallSaves", "StorageRef"]


# Note [a small save skips the cache]
# A save whose whole storage is under ``min_bytes`` is never written: any entry of it would be
# KEPT as "small". Through the entries (index, Entry, Ref, release at a safe point) it still cost
# the training thread as much as a save that is offloaded, about 100 µs for pack and unpack on an
# H100's host (2026-11-24), and 22-41% of a GPT's activation saves are that small (norm
# statistics, attention's log-sum-exp, RNG seeds: 54 of 251 at the bench's GPU shape, 70 of 171
# at its quick one). So such a save is held as a :class:`Small`: the detached alias that keeps it
# in memory (what ``keep.alias`` returns) and the version it was saved at, so that an in-place
# change after save raises at unpack as it does for an entry (Note [in-place after save]). Its
# storage still counts once in the unique, kept and resident bytes: :class:`SmallSaves` counts
# the live saves of each small storage, and a dying Small only files its storage's key (a deque
# append, as a Ref files itself), settled under the lock at the next safe point.
class Small:
    """What autograd holds for a save whose storage is under ``min_bytes``: made by
    :meth:`SmallSaves.add`, which sets its fields (no ``__init__``: a call fewer a save, Note
    [pack's common case in one function] in ``hooks.py``)."""

    __slots__ = ("alias", "version", "key", "dead")

    def unpack(self) -> torch.Tensor:
        now = self.alias._version
        if now != self.version:
            raise RuntimeError(modified(f"{self.alias.device.type} tensor of shape {tuple(self.alias.shape)}",
                                        now, self.version))
        return self.alias

    def __del__(self) -> None:
        dead = getattr(self, "dead", None)  # unset: made but not counted
        if dead is not None:
            try:
                dead.append(self.key)
            except Exception:  # pragma: no cover - interpreter shutdown
                pass


class StorageRef:
    """A weak reference to a storage (``StorageWeakRef``'s, made with one call: its ``cdata`` is
    set by the maker, ``storage._weak_ref()``)."""

    __slots__ = ("cdata",)
    _free = staticmethod(torch.UntypedStorage._free_weak_ref)
    _expired = staticmethod(torch.UntypedStorage._expired)

    def expired(self) -> bool:
        return self._expired(self.cdata)

    def __del__(self) -> None:
        cdata = getattr(self, "cdata", None)
        if cdata is not None:
            self._free(cdata)


class SmallSaves:
    """The small storages saved and alive: key -> [weak reference, bytes, live saves]. Mutated
    under the offloader's lock; ``dead`` is filled by dying :class:`Small` s from any thread."""

    def __init__(self, counters: Any) -> None:
        self.rows: dict[int, list] = {}
        self.dead: deque = deque()
        self.live_bytes = 0
        self.counters = counters

    def add(self, t: torch.Tensor, storage: torch.UntypedStorage, stats_id: Any, why: str | None = None,
            storage_bytes: int | None = None) -> Small:
        """A save of ``t``, whose storage is small (or kept for ``why``, a counter its new storage
        adds to: Note [a save the budget keeps skips the cache]); its deaths filed so far are
        settled first (a storage freed since may have left its address, its key, to ``t``'s).
        ``storage_bytes``: the storage's size, where the caller has it. A step's save (``stats_id``
        None) is counted inline: this is most saves of a GPU forward (Note [pack's common case in
        one function] in ``hooks.py``)."""
        if self.dead:
            self.settle()
        key = storage._cdata
        rows = self.rows
        row = rows[key] if key in rows else None
        if row is not None and row[0].expired():  # an interrupt cut a death short; the storage is gone
            self._drop(key, row)
            row = None
        counters = self.counters
        if stats_id is None:
            counters.total.saved_bytes += t.nbytes
        else:
            counters.add(stats_id, "saved_bytes", t.nbytes)
        if row is None:
            nbytes = storage.nbytes() if storage_bytes is None else storage_bytes
            weak = StorageRef()
            weak.cdata = storage._weak_ref()
            row = rows[key] = [weak, nbytes, 0]
            self.live_bytes += nbytes
            counters.kept_new(stats_id, nbytes, why)
        small = Small()
        alias = small.alias = t if t.is_leaf else t.detach()  # keep.alias
        small.version = alias._version
        small.key = key
        # Note [an interrupt never unbalances a count]: counted and armed with no call between.
        row[2] += 1
        small.dead = self.dead
        return small

    def settle(self) -> None:
        """Counts the deaths filed: a storage whose last save died no longer counts."""
        while self.dead:
            key = self.dead.popleft()  # an interrupt after this loses one death: recount heals it
            row = self.rows.get(key)
            if row is not None:
                row[2] -= 1
                if row[2] <= 0:
                    self._drop(key, row)

    def heal(self) -> None:
        """Drops the rows of storages gone (whose deaths an interrupt lost)."""
        for key, row in [(k, r) for k, r in self.rows.items() if r[0].expired()]:
            self._drop(key, row)

    def _drop(self, key: int, row: list) -> None:
        del self.rows[key]
        self.live_bytes -= row[1]
        self.counters.resident(-row[1])
