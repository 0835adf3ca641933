"""What the saved-tensor hooks do with each save: pack, unpack, and the safe points between them.

:class:`SaveHooks` is the half of :class:`~ssdtrain.engine.offloader.Offloader` that runs inside a
step, on the training thread: pack asks ``keep.py`` what stays as it is, the cache which entry a
save belongs to, and hands new entries to the write queue (or keeps them, and says why); unpack
hands back what is still in memory, or waits for the read that the read-ahead window issued.
The state it works on (the cache, the write queue, the reader, the scopes, the counters, the
clocks, one lock) is made and owned by the Offloader, which also holds the public surface.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ssdtrain.device import cuda as device
from ssdtrain.device import measure
from ssdtrain.engine import keep, native
from ssdtrain.engine.cache import Entry, State
from ssdtrain.engine.group import GROUP_BYTES, Group, Part, join, start
from ssdtrain.engine.parts import Parts
from ssdtrain.engine.ref import Ref
from ssdtrain.host.host_pool import GroupExtent
from ssdtrain.engine.views import SPAN_ALIGN, byte_span
from ssdtrain.engine.peak import EARLY, IN_TIME, LATE, possible_bytes
from ssdtrain.engine.schedule import Scope
from ssdtrain.engine.unpack import UnpackHooks
from ssdtrain.store import StorageError
from ssdtrain.store._mem import profiled

__all__ = ["SaveHooks"]

_now = time.perf_counter  # a seam for tests (the Offloader reads the time through it too)

# Note [a save is copied only after its op returned] (``writer.py``): the thread's autograd
# sequence number names the op that saves. A torch without it (none since 2.4 is known to lack
# it) gets one token for every save: a save is then written only between ops (``wait()``, the end
# of forward), never while an op may still fill it. A custom ``autograd.Function`` (a compiled
# graph is one) saves as it returns: its saves go at the next op's, like any op's (``Function.apply``
# is C code from torch 2.14 on, with no frame to tell it by).
_op_now = getattr(torch.autograd, "_get_sequence_nr", None) or (lambda: 0)

_native_pack = native.load_pack(globals())  # None: pure Python
_Tensor, _Parameter, _strided, _profiler = torch.Tensor, torch.nn.Parameter, torch.strided, torch.autograd.profiler


class SaveHooks(UnpackHooks):
    """Pack, unpack (``unpack.py``) and safe points of an :class:`~ssdtrain.engine.offloader.Offloader`
    (its base)."""

    # -- pack ---------------------------------------------------------------------------------
    # Note [pack's common case in one function]
    # Every call below is paid once per save, on the thread that launches the model's kernels (37 us
    # a save doubled an H200's host forward, 2026-11-27): so pack makes as few calls as it can
    # (``benchmarks/pack_cost.py`` counts them, tests/test_pack_calls.py holds the count; its
    # compiled twin: Note [a compiled pack for the common save]). A plain strided CPU or CUDA tensor
    # outside a kept module, on an open offloader, is screened here by properties (no call): a
    # parameter or a view of one, a weight cast, a storage of the model's, a small storage (Note [a
    # small save skips the cache]) and a save its forward's budget keeps (Note [a save the budget
    # keeps skips the cache]) are settled in this function; everything else (subclasses, meta,
    # quantized, empty, zero tensors, CUDA graph capture, a kept module, a closed offloader, a
    # profiler) takes the general path, ``_pack_general``, which asks ``keep.as_is`` every question.
    # Both reach the same state for the same save (tests/test_pack_fast.py compares them). An
    # inference tensor never reaches a pack hook: autograd refuses to save one first (same test).
    def _pack(self, t: torch.Tensor) -> Any:
        if type(t) is _Parameter:
            return t  # keep.as_is: a parameter (a leaf: keep.alias hands it back as it is)
        if _native_pack is not None:  # Note [a compiled pack for the common save] (``native.py``)
            return _native_pack(self, t)
        if (type(t) is not _Tensor or t.layout is not _strided or not (t.is_cuda or t.is_cpu) or t.is_quantized
                or not t.nbytes or self._keep_depth[0] or self._closed or _profiler._is_profiler_enabled):
            return self._pack_general(t)
        base = t._base
        src = t if base is None else base
        if type(src) is not _Tensor:
            if type(src) is _Parameter:
                return t.detach()  # a view of a parameter (keep.as_is; keep.alias of a view)
            return self._pack_general(t)
        if t._is_zerotensor():
            return self._pack_general(t)
        if src.requires_grad and src.is_leaf:
            return t if t.is_leaf else t.detach()  # a parameter, or a view of one (keep.alias)
        fn = src.grad_fn
        if fn is not None and type(fn).__name__ == "ToCopyBackward0":
            return self._pack_general(t)  # maybe a weight cast (keep._is_weight_cast)
        if t.is_cuda and device.capturing_now():
            return self._pack_general(t)  # refused there
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._pinned:
            return t if t.is_leaf else t.detach()
        return self._pack_plain(t, storage, key)

    def _pack_general(self, t: torch.Tensor) -> Any:
        """Pack of any save: every question of ``keep.as_is`` asked (Note [pack's common case in
        one function])."""
        if keep.as_is(t, self._pinned, self._keep_depth[0] > 0):
            return keep.alias(t)
        if type(t) is not torch.Tensor:
            return self._pack_parts(t)
        self._check_open()
        storage = t.untyped_storage()
        if torch.autograd.profiler._is_profiler_enabled:
            with profiled("ssdtrain.pack"):
                return self._pack_plain(t, storage, storage._cdata)
        return self._pack_plain(t, storage, storage._cdata)

    def _pack_plain(self, t: torch.Tensor, storage: Any, key: int) -> Any:
        """Pack of a plain tensor that is not kept as it is: small, kept at once, or an entry."""
        nbytes = t.nbytes
        storage_bytes = storage.nbytes()
        active = self._scopes.active
        scope = active[-1][1] if active else None
        if scope is None or (scope.backward_started and scope.stats_id is None):
            scope = self._step_scope()  # a new step's forward, or a save made by backward
        tier = self._tier is not None and (t.is_cuda or self._tier_cpu)
        small = self._cache.small
        if storage_bytes < self._small_bytes:  # Note [a small save skips the cache]
            with self._lock:
                if self._peak.active:
                    self._peak.produced(nbytes, _now())
                if tier:  # Note [the copy clock counts every save] (``host/copy_clock.py``)
                    self._tier.clock.produced(0 if key in small.rows else nbytes)
                return small.add(t, storage, scope.stats_id, None, storage_bytes)
        cache = self._cache
        if (self._graveyard or self._writer.completed or cache.late or small.dead or cache.lagging
                or self._failures.pending):
            self._safe_point(raise_errors=True)  # its conditions, asked here without its call
        op = _op_now()  # Note [a save is copied only after its op returned]
        whole = False
        if not t.is_contiguous():
            view_lo, view_hi = byte_span(t)
        elif nbytes == storage_bytes:  # contiguous over all of its storage: at offset 0
            view_lo, view_hi = 0, nbytes
            whole = True
        else:  # views.byte_span's contiguous case, without its call
            view_lo = t.storage_offset() * t.itemsize
            view_hi = view_lo + nbytes
        if 2 * (view_hi - view_lo) >= storage_bytes:  # views.entry_span, inline
            lo, hi = 0, storage_bytes
        else:
            lo, hi = view_lo - view_lo % SPAN_ALIGN, view_hi
        writer = self._writer
        out = None
        with self._lock:
            if self._peak.active:
                self._peak.produced(nbytes, _now())
            entry = self._cache.index.find(t, view_lo, view_hi) if key in self._cache.index.keys else None
            part = joined = None
            if type(entry) is Part:  # a group's (Note [saves handed over together share an entry])
                part, entry = entry, entry.entry
                part.whole = None  # saved again: its read is bytes
            elif entry is None and tier:  # Note [a group's parts are carved from one region]
                if scope.group is not None:
                    joined = join(self, scope.group, t, storage, lo, hi, op, nbytes)
                if joined is None:  # Note [a group is started in one function]
                    joined = start(self, scope, t, storage, lo, hi, op, nbytes)
            if joined:
                out = Ref(joined.entry, t, self._graveyard, view_lo, whole, joined)
                if out.whole:
                    joined.whole = (out.size, out.dtype)  # Note [a whole save is read into its own shape]
            elif entry is None:  # Note [a save the budget keeps skips the cache]
                why = None if joined is False else self._kept_at_once(t, hi - lo)
                if why is not None:
                    if tier and key not in small.rows:
                        self._tier.clock.produced(hi - lo)  # Note [the copy clock counts every save]
                    if scope.group is not None:  # no save joins it after this one: it goes
                        writer.hand_over_group(scope, op)
                    out = small.add(t, storage, scope.stats_id, why, storage_bytes)
                    if op != scope.op or scope.held is not None:  # else WriteQueue.passed does nothing
                        writer.passed(scope, hi - lo, op)
            elif tier:
                self._tier.clock.produced(0)  # a save of a storage saved before: counted, no bytes
            if out is None:
                self._counters.add(scope.stats_id, "saved_bytes", nbytes)
                fresh = entry is None
                try:
                    if fresh:
                        self._check_open()  # the fork check: an entry's bytes go to the backend
                        layer = self._layer_stack[-1] if self._layer_stack else None
                        entry = self._new_entry(t, lo, hi, scope, layer, op, storage, joined is False)
                        if type(entry) is Part:
                            part, entry = entry, entry.entry
                    out = Ref(entry, t, self._graveyard, view_lo, whole, part)
                    if fresh and part is not None and out.whole:
                        part.whole = (out.size, out.dtype)  # Note [a whole save is read into its own shape]
                except BaseException:
                    if fresh and entry is not None and entry.refs == 0:  # interrupted: nothing holds it
                        self._drop_ref(entry, -1, None)
                    raise
        if writer._queue and writer.pack_pumps:
            writer.pump()
        return out

    def _pack_parts(self, t: torch.Tensor) -> Any:
        """Note [a DTensor is saved by its parts]: each tensor part packed as a save of its own."""
        parts, ctx = keep.parts(t)
        packed = {name: self._pack(p) for name, p in parts.items() if isinstance(p, torch.Tensor)}
        if all(isinstance(ref, torch.Tensor) for ref in packed.values()):
            return keep.alias(t)  # every part stays in memory: so does the whole
        others = {n: p for n, p in parts.items() if n not in packed}
        return Parts(t, ctx, packed, others, keep.version_guard(t, packed))

    def _new_entry(self, t: torch.Tensor, lo: int, hi: int, scope: Scope, layer: int | None, op: Any,
                   storage: Any = None, counted: bool = False) -> Entry | Part:
        """Under the lock: a new entry, kept or queued for writing (Note [write only what comes
        back in time] for the budget, Note [write what leaves before the peak] for the time); or,
        for a host tier copy, a new part of the scope's open group (Note [saves handed over together
        share an entry])."""
        n = hi - lo
        cuda = device.is_cuda(t)  # the modelled GPU's tensors too (Note [an offloader made under the modelled GPU])
        tier = self._tier is not None and (cuda or self._tier_cpu)
        if tier and not counted:  # counted: by group.join, which the copy budget refused
            self._tier.clock.produced(n)
            if self._fwd_dev is None and cuda:
                self._fwd_dev = t.device  # forwards are timed on it from the next one on
                # near this forward's start: Note [the step's peak, seen in backward]
                self._start_alloc = measure.allocated(t.device) - n
        verdict = IN_TIME if tier else self._peak.admits(n, self._writer.queued_bytes, _now())
        late = verdict == LATE
        choice = self._policy.decide(n, layer, self._writer.has_room(n), budget=self._tier.clock if tier else None,
                                     late=late)
        asked = tier and choice == "write"
        extent = self._tier.allocate_host(n, t.device) if asked else None
        if extent is not None and self._group_saves > 1:
            part = self._join_group(t, lo, hi, scope, layer, op, storage, extent)
            if part is not None:
                return part
        elif scope.group is not None:  # a save that does not join it: it goes
            self._writer.hand_over_group(scope, op)
        e = self._cache.new(next(self._ids), t, lo, hi, scope, layer, storage)
        scope.live_entries += 1
        if choice == "wait":
            waited = self._writer.wait_for_room(n, self._scopes.by_id.values(), op)
            for field, amount in (("backpressure_waits", 1), ("backpressure_stall_seconds", waited),
                                  ("stall_seconds", waited)):
                self._counters.add(scope.stats_id, field, amount)
        elif choice != "write":
            self._counters.add(scope.stats_id, "kept_bytes", n)
            if choice == "full":
                self._counters.add(scope.stats_id, "backpressure_keeps", 1)
            elif choice == "budget":
                self._counters.add(scope.stats_id, "budget_kept_bytes", n)
            elif choice == "late":
                self._counters.add(scope.stats_id, "peak_kept_bytes", n)
            self._writer.passed(scope, n, op)  # pumped by pack's caller if so: the entry is not queued
            return e
        if tier and not asked:
            extent = self._tier.allocate_host(n, e.device)
        if extent is None and tier:  # the pool had no room: no copy of it is handed over
            self._tier.clock.dropped(n)  # Note [a copy is due from its hand-over]
            if self.config.when_full == "keep" and not self._budget.allows(n):
                self._counters.add(scope.stats_id, "kept_bytes", n)
                self._counters.add(scope.stats_id, "budget_kept_bytes", n)
                return e
        try:
            if extent is None:
                extent = self._backend.allocate(n)
        except StorageError as err:
            self._cache.keep_after_error(e)
            self._failures.failed(err)
            return e
        self._cache.queue(e, extent)
        base = t._base
        # Note [bytes an earlier op made may go at once] (``writer.py``): no op to wait for
        e.op = op if (t if base is None else base).grad_fn is None else None
        e.stream = device.producer_stream(t)  # fenced once its op returned (WriteQueue._queue_now)
        scope.add(e)
        # Note [a save well before the peak goes at once] (``peak.py``): not held for the next save
        self._writer.hold(scope, e, op, verdict == EARLY and scope is self._peak.scope)
        return e

    def _join_group(self, t: torch.Tensor, lo: int, hi: int, scope: Scope, layer: int | None, op: Any,
                    storage: Any, extent: Any) -> Part | None:
        """Under the lock: ``t``'s bytes ``[lo, hi)``, copied to host ``extent``, join ``scope``'s
        open group, or a new one (Note [saves handed over together share an entry]); its part. None:
        it is an entry of its own (Note [the last save waits]: under a quarter of the open group's
        last save, which does not go for it)."""
        g, stream, n = scope.group, device.producer_stream(t), hi - lo
        if g is not None and not g.takes(n, stream, t.device, self._group_saves):
            if 4 * n < g.parts[-1].nbytes:
                return None
            self._writer.hand_over_group(scope, op)
            g = None
        base = t._base
        waits = (t if base is None else base).grad_fn is None  # Note [bytes an earlier op made may go at once]
        if g is None:
            g = scope.group = Group(next(self._ids), t, lo, hi, scope, layer, storage, extent, GroupExtent())
            if self._carve and 2 * n <= GROUP_BYTES:  # room for more: Note [a group's parts are carved from one region]
                g.extent.region = self._tier.pool.allocate(GROUP_BYTES - n, wanted=False)
            self._cache.add_group(g)
            scope.live_entries += 1
            scope.add(g)
            g.stream = stream
            g.op = op if waits else None
            return g.parts[0]
        p = g.add(t, lo, hi, storage, extent)
        self._cache.add_part(p, scope.stats_id)
        if waits:
            g.op = op
        return p

    # -- safe points -----------------------------------------------------------------------------
    def _safe_point(self, *, raise_errors: bool) -> None:
        # Pack and unpack ask these conditions (less _lagging_may_go) before calling here, to
        # spare the call (Note [pack's common case in one function]): a condition added here is
        # added there too (``failures.pending`` stands for what surface() has to do).
        if (self._graveyard or self._writer.completed or self._cache.late or self._cache.small.dead
                or (self._cache.lagging and self._lagging_may_go())):
            self._drain()
        self._failures.surface(raise_errors=raise_errors)

    # Note [a lagging copy is looked at without the lock]
    # While the host tier's copies lag behind forward (written, not yet due: ``Cache.lagging``),
    # every safe point used to drain: the engine's lock, the settling calls, and a look at the
    # oldest copy's fence entering its device first (about 4 us a save on a GPU's host, where the
    # tier's copies lag for most of a forward). The oldest lagging copy goes first (in order), so
    # a safe point drains only once it may go: due by the copy clock, or its fence passed (asked
    # on the training thread, in its device's context already). A hint read without the lock:
    # the drain decides again under it.
    def _lagging_may_go(self) -> bool:
        try:
            ext = self._cache.lagging[0].extent
        except IndexError:  # emptied meanwhile
            return False
        return self._copy_may_go(ext)

    def _drain(self, *, reconcile: bool = False) -> None:
        """Settles dead references and finished writes, on the thread that runs compute.

        Note [release at a safe point]: a write that finished on an I/O thread may have raced an
        in-place op still running on the compute thread (its version bump comes at the end of
        the op). Here, between ops of that thread, every such op has completed, so one more version
        check is exact; only then is the in-memory copy dropped.
        """
        with self._lock:
            self._cache.small.settle()
            self._cache.free_late()
            self._graveyard.urgent = False  # first: a death from here on sets it again
            while self._graveyard:
                # Given back before it leaves the graveyard: an interrupt in between leaves it there, and
                # giving it back again does nothing (Note [an interrupt never unbalances a count]).
                e, gen, weak = self._graveyard[0]
                self._drop_ref(e, gen, weak)
                e.dying -= 1
                self._graveyard.popleft()
            for e, weak in self._cache.lost_refs() if reconcile else ():  # Note [a lost __del__ is found again]
                self._drop_ref(e, -1, weak)
            self._cache.settle_written(self._writer.completed, self._copy_due if self._tier is not None else None)

    # Note [a save the budget keeps skips the cache]
    # Once a forward's budget refused a save (the drive's, Note [write only what comes back in
    # time]; the host tier's, Note [copy what leaves before the peak]), the rest of that forward
    # is kept: its latest saves are what backward needs first, and a smaller save that would still
    # fit must not be written while a larger one before it stays. A save known to stay needs no
    # entry: it is held as a small save is (Note [a small save skips the cache]), at a fraction of
    # the training thread's cost; on a GPU most of a forward's saves are such (the drive took 1%
    # of them on an H100, 2026-11-24; the copy engine about 15%), and the host has about 15 us per
    # save of slack there. A storage that already has an entry keeps using it.
    def _kept_at_once(self, t: torch.Tensor, nbytes: int) -> str | None:
        """Under the lock: whether a new save of ``t`` (``nbytes``) will be kept whatever its entry
        would say, and why (the counter its bytes add to): its forward closed its budget, or its
        write would end after the peak (Note [write what leaves before the peak])."""
        if self.config.when_full != "keep":
            return None
        if self._tier is not None and (t.is_cuda or self._tier_cpu):
            return "budget_kept_bytes" if self._tier.clock.closed else None
        if self._budget.current.bound:
            return "budget_kept_bytes"
        if nbytes >= self.config.min_bytes and not self._peak.fits(nbytes, self._writer.queued_bytes, _now()):
            return "peak_kept_bytes"
        return None

    def _drop_ref(self, e: Entry, gen: int, weak: Any) -> None:
        """A Ref of ``e`` died (``weak`` None: only ``e``'s release is owed); the last releases it."""
        if not self._cache.give_back(e, gen, weak):
            return
        if not e.scope_dropped:
            e.scope_dropped = True  # first: cut short here, the scope outlives it (never counted twice)
            e.scope.drop(e)
        self._scopes.forget_if_empty(e.scope)
        if self._cache.release(e) is State.QUEUED:
            self._writer.forget(e)

    # -- backward begins ----------------------------------------------------------------------------
    def _begin_backward(self, scope: Scope) -> None:
        """Under the lock. Adaptive keep: writes still queued are exactly what backward needs
        first, so cancel them and keep those tensors; then start reading the tail."""
        scope.backward_started = True
        scope.held = None  # cancelled below with the rest of the queue
        scope.fresh = []  # the same
        if self._fwd_timer is not None:
            self._fwd_timer.stop(self._fwd_dev)
        now = _now()
        step = scope.stats_id is None
        if step and self._peak.active:
            self._forward_ended(scope, now)
        scope.restart()
        g, scope.group = scope.group, None
        if g is not None and g.state is State.KEPT and g.extent is not None:  # its copies never went
            self._cache.free_extent(g)
            self._counters.add(scope.stats_id, "adaptive_keep_bytes", g.nbytes)
        for e in scope.queued():
            self._writer.cancel(e)
            self._counters.add(scope.stats_id, "adaptive_keep_bytes", e.nbytes)
        self._window.begin_pass(now, self._counters.total.resident_bytes,
                                peak=self._counters.forward_peak if step else None)
        self._reads_pending = True
        self._reader.prefetch(scope, None)

    def _forward_ended(self, scope: Scope, now: float) -> None:
        """Under the lock: a step's forward ended; its saves peaked in it (Note [write what leaves
        before the peak]): what that peak fell by (the bytes it saved, less the most it held at
        once), against what the drive could have taken."""
        seconds = self._peak.end(now)
        t = self._counters.total
        unique = t.unique_bytes - scope.unique_at_start
        t.peak_fall_bytes = max(0, unique - (self._counters.forward_peak - scope.resident_at_start))
        t.peak_bound_bytes = possible_bytes(self._meter.rate, seconds, unique)
        t.drive_write_bps = self._meter.rate
