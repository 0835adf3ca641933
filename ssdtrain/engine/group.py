"""Saves of the host tier handed over together, held as one entry: :class:`Group` and its :class:`Part` s.

Note [saves handed over together share an entry]
The host tier's copies go to the copy thread a batch at a time (Note [tier copies are handed over a
batch at a time] in ``host/tier.py``), but each save was still an entry of its own: an Entry made,
indexed, ordered in its scope, queued, handed over, settled at its completion, released at a safe
point, read back and unloaded, one by one. On the CPU that was 112-127 us of all threads a save
above the copies' own cost and 44-55 us of pack (issue 64, 2026-11-29), spread over some forty
functions a save; a prototype that gave a batch one entry (``benchmarks/investigations/
batch_entry.py``) spent a few. So the tier's saves of one scope now join its open :class:`Group`,
one entry for up to ``GROUP_SAVES`` storages (or ``GROUP_BYTES``): the group is queued, copied
(one request, each part into its own host extent), released, read back (one request, each part
into its own buffer) and freed as one entry, with one state, one place in the read-ahead order, one
count of live saves. What every save still pays is what it must: the
decision of the copy budget, its host extent (so that a save the pool has no room for spills to the
drives as before, on an entry of its own), its storage's record (:class:`Part`: the dedup index
finds it, its version is checked, its view is rebuilt on its storage or its buffer) and its
:class:`~ssdtrain.engine.cache.Ref`.

What it changes: a group is released and read back as a whole. Its storages leave the device when
its last copy is due (they were handed over together already, and a group holds at most
``GROUP_BYTES``, the tier's fence); its reads land together (they were issued together already). A
group still open when backward begins stays in memory, as the queued saves did (adaptive keep: the
last saves of a forward, which backward needs first); the next save that does not fit closes it,
and ``wait()``, another forward, backpressure and the end of forward (a group of several saves) hand
it over, as they queue the held last save. Drives' writes (a spill, or no tier) keep one entry a
save. The price is paid in peak, for small saves: a small GPT's step peak on a modelled H100 falls
92-96% as far with groups of 8 as with an entry a save (83-93% before Note [a small save joins a
full group]), and less with groups of 16 or 32 (``benchmarks/cpu-results/2026-11-29-start/
modelled_peaks.py``); saves over half of ``GROUP_BYTES`` make groups of one part and pay nothing.

Note [a group's buffers go part by part]
A group's reads land in one buffer a part (:class:`Bufs`). Held until the last of the group's saves
was unpacked (as an entry's buffer is), the buffers of saves already used stayed with them, and a
backward's peak rose by up to a group (on the modelled H100's tiny GPT, above the peak without
offloading: tests/test_device_model_engine.py). So each part counts its saves (``Part.refs``) and
the ones unpacked in this pass; once all were, the group lets go of that part's buffer (autograd
holds what it uses). A part unpacked again after that (a new pass before the group's others were
used) finds its buffer gone, and the group is read again.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ssdtrain.device.cuda import is_cuda, producer_stream
from ssdtrain.engine.cache import Entry, Span
from ssdtrain.engine.small import StorageRef
from ssdtrain.host.host_pool import ALIGN, GroupExtent, HostExtent
from ssdtrain.host.tier import FENCE_BYTES

__all__ = ["Group", "Part", "GROUP_SAVES", "GROUP_BYTES", "Bufs", "join", "start", "requests"]

GROUP_SAVES = 8
"""Storages a group holds at most (the write queue's ``HAND_OVER_SAVES``): a group is a batch."""
GROUP_BYTES = FENCE_BYTES
"""Bytes at which a group is closed: the tier's fence (Note [a copy is due when its fence is] in
``host/tier.py``). A group leaves memory when its last copy is due; larger, its first saves would
wait for a later fence than their own, and the peak lose their fall (as it did when a whole batch
was due at once)."""


class Part:
    """One storage region of a :class:`Group`: what an :class:`~ssdtrain.engine.cache.Entry` holds for
    one storage (its key for the index, the version its saves saw, the storage while in memory, the
    alias that guards the version), and its host extent. It answers the index's questions and the
    version check as an entry does."""

    __slots__ = ("entry", "index", "key", "storage_ref", "version", "data", "lo", "nbytes", "guard", "guard_weak",
                 "extent", "tainted", "whole", "refs", "unpacked")

    def __init__(self, entry: Any, index: int, key: int, storage_ref: StorageRef, version: int,
                 storage: torch.UntypedStorage, lo: int, hi: int, guard: torch.Tensor, guard_weak: Any,
                 extent: Any) -> None:
        self.entry, self.index, self.key, self.storage_ref, self.version = entry, index, key, storage_ref, version
        self.data, self.lo, self.nbytes, self.guard, self.guard_weak = storage, lo, hi - lo, guard, guard_weak
        self.extent, self.tainted, self.whole, self.refs, self.unpacked = extent, None, None, 0, 0

    @property
    def state(self) -> Any:
        return self.entry.state

    @property
    def layer(self) -> int | None:
        return self.entry.layer

    @property
    def device(self) -> torch.device:
        return self.entry.device

    covers = Entry.covers
    current_version = Entry.current_version
    check_version = Entry.check_version


class Bufs(list):
    """A group's read buffers, one a part, in order (a list that a weak reference can hold:
    ``Entry.loaded_weak``)."""

    __slots__ = ("__weakref__",)


class Group(Entry):
    """One entry for the saves of a scope handed over together (Note [saves handed over together
    share an entry]): ``data`` is its parts while they are in memory; ``extent`` a
    :class:`~ssdtrain.host.host_pool.GroupExtent`; ``key`` None (the index holds its parts)."""

    __slots__ = ("parts",)
    grouped = True

    def __init__(self, id_: int, t: torch.Tensor, lo: int, hi: int, scope: Any, layer: int | None,
                 storage: torch.UntypedStorage, extent: Any, group_extent: Any) -> None:
        super().__init__(id_, t, lo, hi, scope, layer, storage)
        # the first part takes what Entry.__init__ made for this storage
        self.parts = [Part(self, 0, self.key, self.storage_ref, self.version, storage, lo, hi, self.guard,
                           self.guard_weak, extent)]
        self.data = self.parts
        self.key = self.storage_ref = self.version = self.guard = self.guard_weak = None
        self.lo = 0
        self.extent = group_extent
        group_extent.parts.append(extent)

    def add(self, t: torch.Tensor, lo: int, hi: int, storage: torch.UntypedStorage, extent: Any) -> Part:
        """A new storage region of ``t``'s joins (its bytes ``[lo, hi)``, its host extent)."""
        weak = StorageRef()
        weak.cdata = storage._weak_ref()
        p = Part(self, len(self.parts), storage._cdata, weak, t._version, storage, lo, hi, t.detach(), weakref.ref(t),
                 extent)
        self.parts.append(p)
        self.extent.parts.append(extent)
        self.nbytes += p.nbytes
        return p

    def takes(self, n: int, stream: Any, dev: torch.device, most: int) -> bool:
        """Whether a new storage region of ``n`` bytes, saved on ``stream`` of ``dev``, fits this
        group of ``most`` storages (else the group closes for it); a region under a quarter of the
        group's last one fits a full group too (Note [a small save joins a full group])."""
        return ((len(self.parts) < most or 4 * n < self.parts[-1].nbytes) and self.nbytes + n <= GROUP_BYTES
                and self.stream is stream and self.device == dev)

    def check_version(self) -> None:
        """Each part's (Note [in-place after save]): a part changed taints its saves alone."""
        for p in self.parts:
            p.check_version()

    def release_memory(self) -> None:
        for p in self.parts:
            p.guard = p.data = None
        self.data = None

    def span(self) -> list:
        """Its parts' bytes, one :class:`~ssdtrain.engine.views.Span` a part, for the copies in."""
        return [Span(p.data, p.lo, p.nbytes, self.device) for p in self.parts]


# Note [a group's parts are carved from one region]
# A save that joins an open group paid for the general path's every question and for a host extent
# of its own (the pool's lock, its best fit, a record): about ten of a join's calls (issue 64: at
# most 15 a save; the tier's average went from 41.6 to 36.2 with this, 2026-11-29). A group whose first save leaves room for more reserves the rest
# of its bytes (``GROUP_BYTES`` less its first part) in the pool as one region, asking for no
# growth if refused; a save that joins it takes the next aligned bytes of the region and is
# decided by :func:`join` in one function: the questions whose answers the group's first save
# settled for the whole group (the forward's device, the tier's fork watch) are not asked again,
# the others (the copy budget, the write queue's room, the policy's bounds, and whether the group
# takes it: ``Group.takes``, the general path's rule too) are asked here. Any answer other than
# "joins" leaves everything as it was and the general path decides, as before; a refusal by the copy
# budget, which counts the save as it asks, says so (False), and the general path does not count it
# again. The region's
# unused tail goes back to the pool when the group is handed over (``WriteQueue.hand_over_group``),
# the whole region when the group is freed. A group of saves over half of ``GROUP_BYTES`` (a GPU's
# at the bench's shape) reserves none: it has one part.
def join(off: Any, g: Group, t: torch.Tensor, storage: torch.UntypedStorage, lo: int, hi: int, op: Any,
         nbytes: int) -> Part | bool | None:
    """Under the engine's lock: ``t``'s new storage region ``[lo, hi)`` joins ``g``, its scope's
    open group, in ``g``'s region (Note [a group's parts are carved from one region]); its part.
    None: it does not, nothing changed; False: the copy budget refused it, its bytes counted."""
    gx = g.extent
    region = gx.region
    n = hi - lo
    at = gx.used
    end = at + -(-n // ALIGN) * ALIGN
    tier = off._tier
    clock = tier.clock
    writer = off._writer
    policy = off._policy
    keep = policy.when_full == "keep"
    # KeepPolicy.decide's questions and WriteQueue.has_room's, asked inline: their calls are counted
    # a save (tests/test_pack_calls.py); a change to them is a change here too
    if (region is None or end > region.reserved or (keep and clock.closed) or n < policy.min_bytes or tier._forked
            or (writer.inflight_bytes and writer.inflight_bytes + n > writer._max_inflight)):
        return None
    if policy.keep_from_layer is not None:
        layer = off._layer_stack[-1] if off._layer_stack else None
        if layer is not None and layer >= policy.keep_from_layer:
            return None
    if not g.takes(n, producer_stream(t), t.device, off._group_saves):
        return None
    clock.produced(n)
    if keep and not clock.allows(n):
        return False
    gx.used = end
    p = g.add(t, lo, hi, storage, HostExtent(region.slab, region.offset + at, 0, n))
    off._cache.index.add(p)  # Cache.add_part's work, its counts in one call
    off._counters.joined(g.scope.stats_id, nbytes, n)
    base = t._base
    if (t if base is None else base).grad_fn is None:  # Note [bytes an earlier op made may go at once]
        g.op = op
    return p


# Note [a small save joins a full group]
# A save under a quarter of the open group's last one does not close the group (Note [the last
# save waits] in ``writer.py``: the last large save of a forward is what backward needs first). So
# such a save after a full group's last part (a norm's statistics after its input: 512 bytes after
# 32 KiB, twelve a step of pack_cost's GPT) was made an entry of its own by the general path, at
# several times a join's cost, and then written, settled and read back as one. It joins the full
# group instead, as one part more (within ``GROUP_BYTES``): a group holds ``GROUP_SAVES`` storages
# and such small ones after them. A chain of them stops at the first that is not under a quarter
# of the part before it.


# Note [a group is started in one function]
# The save that opens a scope's group went the general path: its entry's questions asked by calls
# (``KeepPolicy.decide``, ``WriteQueue.has_room``), a host extent of its own from the pool, then
# the group, and the region for the saves after it (a second trip to the pool), then the general
# path's bookkeeping; with the hand-over of the group it closed, about 33 us of the training thread
# a group, 3.6 us a save of the tier's pack at groups of 8 on the CPU (issue 64, 2026-11-29). So a
# save that would open a group whose parts are carved (Note [a group's parts are carved from one
# region]) is decided by :func:`start` in one function, as :func:`join` decides one that joins: the
# same questions asked inline in the general path's order, the open group handed over, one region
# of ``GROUP_BYTES`` reserved (or the closing group's tail: Note [a group's region passes on]), and
# the save carved as its first part at the region's start. Any
# other answer leaves the save to the general path as before (None: nothing changed but the hand-
# over, which the general path would have made too; False: the copy budget refused it, counted).
# Questions the general path settles once for all (the pool's start, the forward's device, the fork
# watch) send the save there until they are settled.
# Note [a group's region passes on]
# A group closed gave its region's unused tail back to the pool (``TieredBackend.fit_region``), and
# the group it made way for reserved a new region: two trips to the pool's lock and best fit a group
# (about 10 us of the training thread, 2026-11-29). Where the closing group's tail still holds half
# of ``GROUP_BYTES`` (more than a group's first save may be), the tail becomes the new group's region
# instead (``HostPool.split``: the pool's use is unchanged), and the closing group keeps what its
# parts use; a shorter tail goes back and a new region is reserved, as before. A chain of groups of
# small saves so shares one reservation until it runs short.


def start(off: Any, scope: Any, t: torch.Tensor, storage: torch.UntypedStorage, lo: int, hi: int, op: Any,
          nbytes: int) -> Part | bool | None:
    """Under the engine's lock: ``t``'s new storage region ``[lo, hi)`` opens a group of ``scope``
    carved from a region of its own (Note [a group is started in one function]); its part. None:
    the general path decides it; False: the copy budget refused it, its bytes counted."""
    n = hi - lo
    tier = off._tier
    pool = tier.pool
    writer = off._writer
    policy = off._policy
    clock = tier.clock
    keep = policy.when_full == "keep"
    # KeepPolicy.decide's questions, WriteQueue.has_room's and the general path's, asked inline as
    # join asks them (its twin: a change to one is a change to the other and to those it stands for)
    if (2 * n > GROUP_BYTES or pool is None or tier._forked or not off._carve or off._group_saves < 2
            or (keep and clock.closed) or n < policy.min_bytes
            or (writer.inflight_bytes and writer.inflight_bytes + n > writer._max_inflight)
            or (off._fwd_dev is None and is_cuda(t))):
        return None
    layer = off._layer_stack[-1] if off._layer_stack else None
    if policy.keep_from_layer is not None and layer is not None and layer >= policy.keep_from_layer:
        return None
    stream, dev = producer_stream(t), t.device
    g = scope.group
    if g is not None:
        if g.takes(n, stream, dev, off._group_saves) or 4 * n < g.parts[-1].nbytes:
            return None  # it joins the group with an extent of its own, or is an entry of its own
        last = g.extent  # Note [a group's region passes on]: its tail, where it holds half of GROUP_BYTES
        passes = last.region is not None and last.used and last.region.reserved - last.used >= GROUP_BYTES // 2
        region = pool.split(last.region, last.used) if passes else None
        writer.hand_over_group(scope, op)
    else:
        region = None
    if region is None:
        region = pool.allocate(GROUP_BYTES, wanted=False)
        if region is None:
            return None
    clock.produced(n)
    if keep and not clock.allows(n):
        pool.free(region)
        return False
    gx = GroupExtent()
    gx.region, gx.used = region, -(-n // ALIGN) * ALIGN
    g = scope.group = Group(next(off._ids), t, lo, hi, scope, layer, storage,
                            HostExtent(region.slab, region.offset, 0, n), gx)
    p = g.parts[0]
    off._cache.entries[g.id] = g  # Cache.add_group's work, its counts in one call
    off._cache.index.add(p)
    off._counters.joined(scope.stats_id, nbytes, n)
    scope.live_entries += 1
    scope.add(g)
    g.stream = stream
    base = t._base
    if (t if base is None else base).grad_fn is None:  # Note [bytes an earlier op made may go at once]
        g.op = op
    return p


def requests(items: list[tuple]) -> tuple[list[tuple], list[int]]:
    """Requests ``(entry, source or buffer, checksum, fence)`` to the host tier as the tier takes
    them, ``(extent, source or buffer, checksum, fence)``: a group's one a part, with its part's
    extent and source or buffer; and where each entry's first request is."""
    out: list[tuple] = []
    firsts = []
    for e, src, checksum, fence in items:
        firsts.append(len(out))
        if e.grouped:
            out += [(p.extent, s, checksum, fence) for p, s in zip(e.parts, src)]
        else:
            out.append((e.extent, src, checksum, fence))
    return out, firsts
