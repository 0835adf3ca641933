"""What autograd holds for a save of a tensor subclass saved by its parts (Note [a DTensor is saved
by its parts], ``keep.py``)."""

from __future__ import annotations

from typing import Any

import torch

from ssdtrain.engine.views import modified

__all__ = ["Parts"]


class Parts:
    """What autograd holds for a save of a tensor subclass saved by its parts (Note [a DTensor
    is saved by its parts], ``keep.py``): what pack returned for each tensor part, the other
    parts, and what ``__tensor_unflatten__`` needs to put them together again.

    Note [in-place after save], for a subclass: an in-place op on a DTensor bumps its own version,
    not its local shard's (the op on the shard runs below autograd), so the parts' entries cannot
    see it. ``guard`` (``keep.version_guard``) shares the saved tensor's version counter and
    holds none of its bytes; a change is found when backward unpacks it.
    """

    __slots__ = ("cls", "ctx", "packed", "others", "size", "stride", "guard", "version")

    def __init__(self, t: torch.Tensor, ctx: Any, packed: dict[str, Any], others: dict[str, Any],
                 guard: torch.Tensor) -> None:
        self.cls, self.ctx, self.packed, self.others = type(t), ctx, packed, others
        self.size, self.stride, self.version = t.size(), t.stride(), t._version
        self.guard = guard

    def rebuild(self, unpack: Any) -> torch.Tensor:
        """The subclass tensor again, its tensor parts brought back by ``unpack``; detached, as
        a save kept in memory is handed back (``keep.alias``).

        Raises:
            RuntimeError: the saved tensor was changed in place since it was saved.
        """
        now = self.guard._version
        if now != self.version:
            raise RuntimeError(modified(f"{self.cls.__name__} of shape {tuple(self.size)}", now, self.version))
        parts = dict(self.others)
        parts.update((name, unpack(ref)) for name, ref in self.packed.items())
        out = self.cls.__tensor_unflatten__(parts, self.ctx, self.size, self.stride)
        return out.detach() if out.requires_grad else out
