"""The optional compiled pack: which pack hook body runs, the compiled one or pure Python.

Note [a compiled pack for the common save]
Pack runs on the thread that launches the model's kernels, once a save (Note [pack's common case
in one function] in ``hooks.py``). In Python, the save that joins its scope's open group (most of a
host tier's saves: Note [a group's parts are carved from one region] in ``group.py``) still made
about 44 calls of its own (the screening's properties, the span, the group's part, its index
record, the copy clock's and the peak's counts, its :class:`~ssdtrain.engine.ref.Ref`), and a save
of a storage saved before (a hit in the index) about 30; the issue that asked for at most 15 calls
a save said: where Python cannot get there, a compiled fast path, never required.
``cuda_ext/_cpack.c`` is that path: ``SaveHooks._pack`` and the join and hit cases of
``_pack_plain`` written against Python's C API (no torch headers: it builds for any torch), built at
install as ``ssdtrain._cpack`` where a C compiler is (``setup.py``; a failed build leaves pure
Python). It asks the same questions in the same order and makes the same objects; any other save (a
group's first, a small one, a kept one, an index bucket with a dead storage in it, anything the
general path screens) goes to the Python function that decides it, with nothing changed. Pure
Python stays complete and is the reference: ``tests/test_pack_native.py`` runs both on the same
saves and compares the two states object by object, and the call count that holds pack's Python
(tests/test_pack_calls.py) is taken with the compiled path off. ``SSDTRAIN_NATIVE=0`` turns it off
for a process. What it bought on the CPU (2026-11-29, pack_cost's GPT, the tier): 29.4 calls a
save to 9.1; pack x0.95 (the work is the same objects made and the same attributes set, and those
cost what they cost: C spares the interpreter, not the memory they touch).

Note [a save's leaves are not the collector's]
A joined save made some ten objects that the cyclic collector tracks and that live from pack to
unpack: each young collection found them alive and moved them on, and they counted towards the
process's full collections (tens of milliseconds each with torch imported; Note [a freed entry is
in no cycle] in ``cache.py``). Most of them cannot be in a cycle whatever happens: the save's
:class:`~ssdtrain.engine.ref.Ref` (what reaches it back is weak), its ``_RefWeak``, its shape and
stride (plain ints), its part's host extent, storage handle, weak reference to the tensor, and
``(size, dtype)``. The compiled pack takes those out of the collector's lists as it makes them
(``untrack`` in ``_cpack.c``); their counts free them as before. The part and its group (a cycle
until ``Cache.release`` breaks it) stay the collector's, and so does everything pure Python makes
(it has no way to untrack). tests/test_pack_native.py checks both halves: untracked, and freed
with the collector off. On pack_cost's GPT (CPU, 2026-11-30, separate processes of 300 steps):
the collector's time 1.20 -> 0.81 ms a step (1.3 us a save).
"""

from __future__ import annotations

from typing import Any

import torch

from ssdtrain import _ext

__all__ = ["NATIVE_ABI", "load_pack", "native_pack_status"]

NATIVE_ABI = _ext.NATIVE_ABI
"""The build's number that this source expects (``cuda_ext/_cpack.c``'s ``NATIVE_ABI``): a build
from another source is not used."""

_status = "not loaded"


def load_pack(hooks_globals: dict) -> Any:
    """The compiled pack (``pack(offloader, tensor)``), configured for ``hooks.py``'s module
    (``hooks_globals``: its seams, ``_now`` and ``_op_now``, are read from it at each save), or None
    where it is off, not built, or built from another source (Note [a compiled pack for the common
    save])."""
    global _status
    _cpack, why = _ext.compiled(NATIVE_ABI)
    if _cpack is None:
        _status = why
        return None
    from ssdtrain.device import cuda as device
    from ssdtrain.engine import group, ref, small, views
    from ssdtrain.engine.cache import State
    from ssdtrain.host import copy_clock, host_pool

    _cpack.configure({
        "Tensor": torch.Tensor, "Parameter": torch.nn.Parameter, "strided": torch.strided,
        "Part": group.Part, "Ref": ref.Ref, "RefWeak": ref._RefWeak, "StorageRef": small.StorageRef,
        "HostExtent": host_pool.HostExtent, "profiler": torch.autograd.profiler, "device": device,
        "hooks": hooks_globals, "join": group.join, "OWED": ref.OWED, "COUNTED": ref.COUNTED,
        "SPAN_ALIGN": views.SPAN_ALIGN, "ALIGN": host_pool.ALIGN, "GROUP_BYTES": group.GROUP_BYTES,
        "DUE_MARGIN": float(copy_clock.DUE_MARGIN), "expired": small.StorageRef._expired,
        "KEPT": State.KEPT, "QUEUED": State.QUEUED,
    })
    _status = "compiled"
    return _cpack.pack


def native_pack_status() -> str:
    """``"compiled"``, or why pack is pure Python (``ssdtrain selftest`` and pack_cost print it)."""
    return _status
