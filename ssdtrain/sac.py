"""Selective activation checkpointing whose kept tensors go to the drive: :func:`sac_context`.

torch's selective activation checkpointing (SAC, ``create_selective_checkpoint_contexts``) keeps
the outputs its policy saves in a dict that two TorchDispatchModes share (one fills it in forward,
one reads it in the recomputation), not through autograd's saved-tensor hooks: an offloader never
sees them. torch 2.13 has no switch for that; torch 2.14 has one, ``checkpoint(...,
respect_saved_tensors_hooks=True)`` (PyTorch PR 190581; unset, it warns when saved-tensor hooks
are active, and a later release makes unset an error). :func:`sac_context` builds torch's own pair
of modes around a dict of ours. On a torch with the switch, its caching mode defaults the switch to
on (Note [sac_context turns torch's switch on]): each tensor SAC keeps goes through the
offloader's pack hook by torch's own path. On an older torch each tensor SAC stores in the dict is
packed by the offloader (Note [SAC saves go through the offloader]). Either way it is a save as
any (found once, kept or written, counted, read back ahead of need), unpacked when the
recomputation asks. :func:`~ssdtrain.engine.sac_probe.warn_unswitched` tells a user whose own SAC
runs inside ``with off:`` without the switch.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._pytree import tree_map

from ssdtrain.engine import keep
from ssdtrain.engine.sac_probe import has_switch

__all__ = ["SAVE_IN_MEMORY", "sac_context"]


class _InMemory(enum.Enum):
    SAVE_IN_MEMORY = "save in memory"


SAVE_IN_MEMORY = _InMemory.SAVE_IN_MEMORY
"""What an SAC policy returns for an op whose output is kept in memory (not written, not recomputed)."""

_SAVE = "save"  # to the drive (within the offloader's blocks)
_KEEP = "keep"


def sac_context(policy: Callable[..., Any] | list, offloader: Any, *,
                allow_cache_entry_mutation: bool = False) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint`` that applies an SAC policy and
    sends what it saves to ``offloader``'s drive.

    Use it where ``functools.partial(create_selective_checkpoint_contexts, policy)`` would go::

        ctx = ssdtrain.sac_context(policy, off)
        with off:
            for block in model.blocks:
                x = checkpoint(block, x, use_reentrant=False, context_fn=ctx)

    Per op, the policy chooses among three places (Note [SAC saves go through the offloader]):

    - ``CheckpointPolicy.MUST_SAVE`` / ``PREFER_SAVE`` (or ``True``), and ``MUST_CPU_OFFLOAD`` /
      ``PREFER_CPU_OFFLOAD``: saved, and offloaded like any save: written to the drive inside
      ``with off:`` (the offloader's settings apply: ``min_bytes``, ``keep_modules``, the write
      budget), kept in memory outside it;
    - :data:`SAVE_IN_MEMORY`: saved and kept in memory, as plain SAC does;
    - ``MUST_RECOMPUTE`` / ``PREFER_RECOMPUTE`` (or ``False``): recomputed in backward.

    Args:
        policy: ``policy(ctx, op, *args, **kwargs)`` returning one of the above, or a list of ops
            (``torch.ops.aten.mm.default``, ...) to save to the drive, the rest recomputed.
        offloader: the :class:`~ssdtrain.Offloader` to send saves to (a disabled one from
            ``ssdtrain.offload(enabled=False)``: plain SAC).
        allow_cache_entry_mutation: as torch's; with ``True`` a save may be modified in place
            after it was made and backward must see that, so saves stay in memory.

    Returns:
        A function of no arguments returning torch's two SAC modes, as ``context_fn`` takes.

    Raises:
        TypeError: ``policy`` is neither callable nor a list of ops, or ``offloader`` is not one.
    """
    from ssdtrain.engine.offloader import Offloader
    from ssdtrain.switch import Disabled

    if not isinstance(offloader, (Offloader, Disabled)):
        raise TypeError(f"offloader must be an ssdtrain.Offloader (or ssdtrain.offload(...)), not "
                        f"{type(offloader).__name__}: sac_context(policy, off)")
    if isinstance(policy, list):
        ops = policy
        torch_checkpoint.create_selective_checkpoint_contexts(ops)  # torch checks the list
        policy = _save_listed(ops)
    elif not callable(policy):
        raise TypeError(f"policy must be a function (ctx, op, *args, **kwargs) -> CheckpointPolicy or a list of "
                        f"ops such as torch.ops.aten.mm.default, not {type(policy).__name__}")

    switch = has_switch()

    def context_fn() -> tuple[Any, Any]:
        packer = _Packer(offloader, not allow_cache_entry_mutation and isinstance(offloader, Offloader))
        caching, cached = torch_checkpoint.create_selective_checkpoint_contexts(
            packer.wrap(policy), allow_cache_entry_mutation)
        if switch:
            caching.__class__ = _switched(type(caching))
            caching.ssdtrain_default = packer.routed = packer.offload
        if not (isinstance(getattr(caching, "storage", None), dict) and getattr(cached, "storage", None) is
                caching.storage and hasattr(torch_checkpoint, "_VersionWrapper")):
            raise RuntimeError(f"ssdtrain.sac_context does not know where torch {torch.__version__}'s selective "
                               "checkpointing keeps its saves (tested with torch 2.13); use "
                               "create_selective_checkpoint_contexts directly (its saves then stay in memory)")
        caching.storage = cached.storage = _Storage(packer)
        return caching, cached

    return context_fn


def _save_listed(ops: list) -> Callable[..., Any]:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return (torch_checkpoint.CheckpointPolicy.MUST_SAVE if op in ops
                else torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE)
    return policy


def _where(choice: Any) -> str | None:
    """Where an SAC policy's answer puts the op's output: ``_SAVE``, ``_KEEP``, or ``None``
    (recomputed)."""
    policies = torch_checkpoint.CheckpointPolicy
    if choice is SAVE_IN_MEMORY:
        return _KEEP
    if choice is True or choice in (policies.MUST_SAVE, policies.PREFER_SAVE):
        return _SAVE
    if isinstance(choice, policies) and choice.name.endswith("_CPU_OFFLOAD"):
        return _SAVE
    if choice is False or choice in (policies.MUST_RECOMPUTE, policies.PREFER_RECOMPUTE):
        return None
    raise TypeError(f"an SAC policy returned {choice!r}: return a torch.utils.checkpoint.CheckpointPolicy, "
                    "a bool, or ssdtrain.SAVE_IN_MEMORY")


# Note [sac_context turns torch's switch on]
# torch >= 2.14 routes what SAC keeps through the saved-tensor hooks around it when ``checkpoint``
# is given ``respect_saved_tensors_hooks=True``; unset (``None``) it keeps the old way and warns
# (FutureWarning; an error in a later release). ``checkpoint`` sets the flag on the caching mode
# that ``context_fn`` made, after making it. So the caching mode of ``sac_context`` is of a
# subclass whose flag reads an unset value as ssdtrain's default: on (the offloader's pack then
# sees each kept tensor, torch's own path), or off where the saves must stay in memory
# (``allow_cache_entry_mutation``, a disabled offloader). A value the user passes is kept. With
# the switch on, the policy wrapper keeps ``SAVE_IN_MEMORY`` outputs in memory by holding the
# offloader's keep depth from the policy's answer to the store that follows it.
def _switched(cls: type) -> type:
    sub = _SWITCHED.get(cls)
    if sub is None:
        def get(self: Any) -> Any:
            value = self.__dict__.get("_ssdtrain_switch")
            return self.ssdtrain_default if value is None else value

        def put(self: Any, value: Any) -> None:
            self.__dict__["_ssdtrain_switch"] = value

        sub = _SWITCHED[cls] = type(f"Ssdtrain{cls.__name__}", (cls,),
                                    {"respect_saved_tensors_hooks": property(get, put), "ssdtrain_default": True})
    return sub


_SWITCHED: dict[type, type] = {}


# Note [SAC saves go through the offloader]: torch's caching mode calls the policy for each op
# and then stores the op's outputs (each a detached alias in a ``_VersionWrapper``) at
# ``storage[op][index]``; the cached mode in the recomputation reads ``get_val`` of what it finds
# there and then stores a "consumed" marker in its place. The policy wrapper notes where the op's
# output goes; the dict's ``__setitem__`` that follows packs each saved tensor with the
# offloader's own pack (when a block of it is open) and stores an object whose ``get_val``
# unpacks it. The bytes backward gets are those the op produced: gradients are those of SAC
# alone. Replacing the entry with the marker drops the last reference: the save is freed as any.
# Only ``_VersionWrapper`` leaves are packed: anything else torch stores is left as it is (were
# SAC's saves to go through the hooks themselves, as the proposed ``respect_saved_tensors_hooks``
# would have them, nothing here would pack them a second time).
class _Storage(dict):
    """SAC's ``{op: {index: outputs}}`` dict; ``packer`` packs its saves."""

    def __init__(self, packer: _Packer) -> None:
        super().__init__()
        self.packer = packer

    def __missing__(self, op: Any) -> _OpStorage:
        # No reference back to this dict (a cycle would keep the saves alive until the
        # garbage collector ran): those the recomputation never asks for die with it.
        ops = self[op] = _OpStorage(self.packer)
        return ops


class _Packer:
    """Packs the saves of one checkpointed call with the offloader (Note [SAC saves go through
    the offloader])."""

    def __init__(self, offloader: Any, offload: bool) -> None:
        self.offloader = offloader
        self.offload = offload
        self.next: str | None = None  # where the op being stored goes (set by the policy)
        self.routed = False  # torch sends SAC's saves through the hooks (Note [sac_context turns torch's switch on])
        self.kept = False  # the offloader's keep depth is held for this op's store

    def wrap(self, policy: Callable[..., Any]) -> Callable[..., Any]:
        def noted(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            choice = policy(ctx, op, *args, **kwargs)
            self.next = where = _where(choice)
            if where is None or (where == _SAVE and torch.compiler.is_compiling()):
                return choice  # compiled: torch's own handling of each policy
            if where == _KEEP and self.routed and not self.kept and not torch.compiler.is_compiling():
                self.offloader._keep_depth[0] += 1  # until the store (Note [sac_context turns torch's switch on])
                self.kept = True
            return torch_checkpoint.CheckpointPolicy.MUST_SAVE
        return noted

    def pack(self, value: Any) -> Any:
        where, self.next = self.next, None
        off = self.offloader
        if self.kept:
            self.kept = False
            off._keep_depth[0] -= 1
        if self.routed and not torch.compiler.is_compiling():
            return value  # packed by torch, through the hooks
        if where != _SAVE or not self.offload or torch.compiler.is_compiling() or not off._scopes.opened_by(off):
            return value
        if keep.in_no_offload():
            return value  # ssdtrain.no_offload() inside the checkpointed function

        def one(leaf: Any) -> Any:
            val = getattr(leaf, "val", None)
            if type(leaf) is not torch_checkpoint._VersionWrapper or not isinstance(val, torch.Tensor):
                return leaf
            packed = off._pack(val)
            return leaf if isinstance(packed, torch.Tensor) else _Offloaded(off, packed)

        return tree_map(one, value)


class _OpStorage(dict):
    """One op's ``{index: outputs}``: a store of outputs is a save (Note [SAC saves go through the offloader])."""

    def __init__(self, packer: _Packer) -> None:
        super().__init__()
        self._packer = packer
        self._next_in = 0

    def __setitem__(self, index: int, value: Any) -> None:
        if self._packer.next is not None or self._packer.kept:
            value = self._packer.pack(value)
        super().__setitem__(index, value)

    # torch 2.11 and older keep a list per op: ``append`` in forward, ``pop(0)`` in the
    # recomputation, ``len`` to tell a second backward. The same store, in arrival order.
    def append(self, value: Any) -> None:
        self[self._next_in] = value
        self._next_in += 1

    def pop(self, *args: Any) -> Any:
        if args == (0,):
            key = min(self)
            return super().pop(key)
        return super().pop(*args)


class _Offloaded:
    """A saved output held by the offloader; the recomputation asks for it with ``get_val``."""

    __slots__ = ("_off", "_packed")

    def __init__(self, off: Any, packed: Any) -> None:
        self._off = off
        self._packed = packed

    def get_val(self, allow_cache_entry_mutation: bool) -> torch.Tensor:
        # A save modified in place since is refused by the offloader's unpack (Note [in-place
        # after save]), as SAC refuses it without ``allow_cache_entry_mutation``.
        return self._off._unpack(self._packed)
