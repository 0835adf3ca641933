"""The geometry of a saved view: which bytes of its storage it reaches, and how it is rebuilt on
a buffer of those bytes (``Ref`` holds its dtype, size, stride, offset and lazy bits); and the
error an in-place change after a save raises. Used by the cache's entries and the small saves."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["SPAN_ALIGN", "Span", "byte_span", "entry_span", "byte_view", "rebuild", "rebuild_on", "modified"]


# The widest element (complex128): entry spans start on a multiple of it, so every view of the
# storage, whatever its dtype, lands on a whole element of the rebuilt buffer.
SPAN_ALIGN = 16


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` of ``t``'s storage that ``t`` can reach (``t`` has an element)."""
    size = t.element_size()
    lo = t.storage_offset() * size
    if t.is_contiguous():  # the common case, in one call: its reach is its elements
        return lo, lo + t.nbytes
    reach = 0
    for n, step in zip(t.shape, t.stride()):  # a loop, not sum() of a generator: fewer calls (pack)
        reach += (n - 1) * step
    return lo, lo + (reach + 1) * size


def entry_span(view_lo: int, view_hi: int, storage_bytes: int) -> tuple[int, int]:
    """The bytes a new entry for a view reaching ``[view_lo, view_hi)`` covers: all of the
    storage when the view reaches most of it, so that its other views (q, k, v of a fused QKV;
    transposes) are found in the same entry; else the view's, from a ``SPAN_ALIGN`` boundary."""
    if 2 * (view_hi - view_lo) >= storage_bytes:
        return 0, storage_bytes
    return view_lo - view_lo % SPAN_ALIGN, view_hi


def byte_view(storage: torch.UntypedStorage, lo: int, n: int, device: torch.device) -> torch.Tensor:
    """A 1-D uint8 tensor over ``n`` bytes of ``storage`` starting at byte ``lo`` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, lo, (n,), (1,))


# Note [an entry's bytes are its storage's]
# An entry in memory holds its storage (``Entry.data``), not a tensor over its bytes: a byte view
# is a tensor made (3-5 us of the training thread a save on the CPU, 2026-11-29), and most of an
# entry's life needs none. Unpack rebuilds a save on the storage itself (:func:`rebuild_on`); the
# write queue hands a host-tier copy its bytes as a :class:`Span`, which the tier's copy thread
# reads by address; a drive's write gets a byte view, made as it is handed over.
class Span:
    """``nbytes`` bytes of ``storage`` from byte ``lo``: a write's source without a tensor, for the
    host tier's copies (Note [an entry's bytes are its storage's]); it keeps the storage alive
    while the copy reads it. It answers what the tier asks of a tensor source (``data_ptr``,
    ``nbytes``, ``device``, ``is_cuda``, ``untyped_storage``); :meth:`tensor` makes the byte view
    where a tensor is needed after all."""

    __slots__ = ("storage", "lo", "nbytes", "device")

    def __init__(self, storage: torch.UntypedStorage, lo: int, nbytes: int, device: torch.device) -> None:
        self.storage, self.lo, self.nbytes, self.device = storage, lo, nbytes, device

    @property
    def is_cuda(self) -> bool:
        return self.storage.is_cuda

    def data_ptr(self) -> int:
        return self.storage.data_ptr() + self.lo

    def untyped_storage(self) -> torch.UntypedStorage:
        return self.storage

    def tensor(self) -> torch.Tensor:
        return byte_view(self.storage, self.lo, self.nbytes, self.device)


def rebuild(buf: torch.Tensor, ref: Any) -> torch.Tensor:
    """The tensor ``ref`` describes, as a view on ``buf`` (whose byte 0 is the entry's ``lo``).

    Note [views come back as views]: every save of one entry is rebuilt on the same buffer with
    its own dtype, size, stride and offset, so overlapping views still overlap after a reload.
    """
    return rebuild_on(buf.untyped_storage(), buf.storage_offset() * buf.itemsize + ref.offset, ref, buf.device)


def rebuild_on(storage: torch.UntypedStorage, byte_offset: int, ref: Any, device: torch.device) -> torch.Tensor:
    """The tensor ``ref`` describes, on ``storage`` (of ``device``) from byte ``byte_offset``."""
    size = ref.dtype.itemsize
    assert byte_offset % size == 0, "a view was rebuilt off its element boundary"
    out = torch.empty(0, dtype=ref.dtype, device=device)
    out = out.set_(storage, byte_offset // size, ref.size, ref.stride)
    if ref.conj:  # Note [lazy bits travel with the save]
        out = out.conj()
    if ref.neg:
        out = torch._neg_view(out)
    return out


def modified(what: str, now: int, saved: int) -> str:
    """The error backward raises for a save changed in place since (Note [in-place after save])."""
    return (f"one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{what}] is at version {now}; expected version {saved} instead. (detected by ssdtrain; the same "
            "code fails this way without offloading)")
