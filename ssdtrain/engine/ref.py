"""What autograd holds for one save of an entry: :class:`Ref`, and where its count stands."""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any

import torch

__all__ = ["Ref", "Graveyard", "GRAVEYARD_BATCH", "OWED", "FILED", "COUNTED"]

GRAVEYARD_BATCH = 32
"""Deaths that hold no memory settled together at an unpack (Note [deaths that hold no memory wait]);
1 settles each at the next unpack."""


# Note [deaths that hold no memory wait]
# In backward, autograd drops each node's saved references once the node ran, so nearly every
# unpack found a death in the graveyard and drained: the engine's lock, the settling calls and the
# count given back, once a save (101 drains in a step of 202 unpacks on pack_cost's GPT,
# 2026-11-29; 10-30 us each). Settling a death frees memory only where it is its entry's last save
# and the entry still holds the bytes (in memory, or read back and held strongly); a dying Ref says
# so as it files itself (``Graveyard.urgent``; ``Entry.dying`` counts the entry's Refs filed and not
# settled, a hint: a race between two threads' deaths only settles early or a batch later), and
# unpack drains at once then. The others give back only counts and host or drive extents: unpack
# settles them ``GRAVEYARD_BATCH`` at a time; any other safe point (pack, ``wait()``, the next
# forward, a kept save's unpack that moves the reads on) settles them as before.
class Graveyard(deque):
    """Dying Refs' records ``(entry, gen, weak)``, settled at safe points; ``urgent``: one of them
    held memory when it died (Note [deaths that hold no memory wait])."""

    __slots__ = ("urgent",)

    def __init__(self) -> None:
        super().__init__()
        self.urgent = False


# Note [a lost __del__ is found again]: where a Ref's count stands, on its weak reference.
OWED = 0     # counted in its entry's ``refs``; not given back yet
FILED = 1    # dying: in the graveyard, given back at the next safe point
COUNTED = 2  # nothing to give back (not counted yet, or given back)


class _RefWeak(weakref.ref):
    __slots__ = ("filed",)


class Ref:
    """What autograd holds for one save: the entry, and how to rebuild this save's view."""

    __slots__ = ("entry", "part", "dtype", "size", "stride", "offset", "conj", "neg", "whole", "gen", "graveyard",
                 "weak", "__weakref__")

    def __init__(self, entry: Any, t: torch.Tensor, graveyard, byte_offset: int | None = None,
                 whole: bool = False, part: Any = None) -> None:
        """``byte_offset``: ``t``'s first byte in its storage, where the caller has it; ``whole``:
        ``t`` is contiguous over all of its storage (Note [a whole save is read into its own shape]
        in ``reader.py``), where the caller knows it; ``part``: the part of a group entry that holds
        ``t``'s storage (Note [saves handed over together share an entry] in ``group.py``), else the
        entry itself holds it. ``offset`` counts from the holder's first byte."""
        self.graveyard = None  # not counted yet: a Ref that dies before the count files nothing
        self.entry = entry
        self.part = part = entry if part is None else part
        self.size = t.shape  # a torch.Size: a tuple already
        self.stride = t.stride()
        if byte_offset is None:
            byte_offset = t.storage_offset() * t.itemsize
        self.offset = byte_offset - part.lo
        # Note [lazy bits travel with the save]: a conjugate or negative view (``z.conj()``,
        # ``x.mH``, ``torch._neg_view``) shares its storage's bytes unchanged and carries the
        # operation as a bit; a tensor rebuilt on the bytes alone would lose it.
        self.dtype = dtype = t.dtype
        self.conj = dtype.is_complex and t.is_conj()  # only a complex tensor has the bit: no call for others
        self.neg = t.is_neg()
        self.whole = whole and not (self.conj or self.neg) and part.lo == 0 and part.nbytes == t.nbytes
        if part is not entry:  # a group's part counts its saves (Note [a group's buffers go part by part])
            part.refs += 1
        self.gen = -1
        # Note [an interrupt never unbalances a count]: the count and the flag that makes __del__
        # give it back are set by two stores with no call between them, so no KeyboardInterrupt
        # (Python runs signal handlers only at calls and jumps) can separate them.
        # Note [a lost __del__ is found again]: the weak reference tells wait() whether this Ref
        # died without filing itself (OWED), is in the graveyard (FILED), or was given back.
        self.weak = _RefWeak(self)
        self.weak.filed = COUNTED
        entry.ref_weaks.append(self.weak)
        entry.refs += 1
        self.graveyard = graveyard
        self.weak.filed = OWED

    def __del__(self) -> None:
        # Note [release at a safe point]: autograd drops saved references wherever it likes (even
        # from inside our own pack, through the garbage collector), so a dying Ref only files
        # itself; the engine settles the count under its lock at its next safe point.
        if getattr(self, "graveyard", None) is None:  # unset: __init__ was cut short at its start
            return
        try:
            self.weak.filed = FILED  # no call between this and the append: no interrupt either
            self.graveyard.append((self.entry, self.gen, self.weak))
            e = self.entry
            e.dying += 1  # Note [deaths that hold no memory wait]: its last save, and it holds memory
            if e.dying >= e.refs and (e.data is not None or e.loaded is not None):
                self.graveyard.urgent = True
        except Exception:  # pragma: no cover - interpreter shutdown
            pass
