"""The :class:`Offloader`: saved-tensor hooks that send activations to storage and bring them back.

The data path and its wiring: pack asks ``keep.py`` what stays as it is, the cache which entry a
save belongs to, and hands new entries to the write queue; unpack hands back what is still in
memory, or waits for the read that the read-ahead window issued. One lock guards shared state.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

import torch
from torch import nn

from ssdtrain import device, keep
from ssdtrain.cache import Cache, Entry, Parts, Ref, Small, State, byte_span, entry_span, rebuild
from ssdtrain.config import OffloadConfig
from ssdtrain.endurance import EnduranceMonitor
from ssdtrain.peak import DriveMeter, PeakClock, possible_bytes
from ssdtrain.schedule import DriveAdvice, KeepPolicy, ReadWindow, Scope, Scopes, WriteBudget, find_blocks
from ssdtrain.stats import Counters, OffloadStats
from ssdtrain.store import Backend, StorageError, make_backend
from ssdtrain.store._mem import profiled
from ssdtrain.reader import Reader
from ssdtrain.tier import HostExtent, TieredBackend
from ssdtrain.writer import WriteFailures, WriteQueue

__all__ = ["Offloader"]

_now = time.perf_counter  # a seam for tests
_TIER_DEVICES = ("cuda",)  # device types whose saves use the host tier (tests add "cpu")


class Offloader:
    """Offloads the activations saved for backward inside ``with off:`` (or ``off.microbatch(i)``).

    Args:
        model: the model being trained (optional), or its chunks in layer order (interleaved
            pipelines). Parameters and buffers are never written; its repeated blocks tag saves for
            ``keep_last_layers`` and block-wise prefetch.
        config: an :class:`OffloadConfig` (or a mapping of its fields).
        store: a ready :class:`~ssdtrain.store.Backend` to use instead of the one ``backend``
            names (custom storage; a throttled drive; the tests' hand-driven store).
        **overrides: fields of :class:`OffloadConfig` that replace those of ``config``;
            ``keep_modules`` may also list the modules themselves.

    Raises:
        ValueError: for bad settings or an unusable ``path``, before any tensor is touched.

    ``with off:`` switches offloading on for what runs inside; leaving it marks the end of a
    forward pass, so wrap each step's forward (backward then starts its reads at once). A
    ``with off:`` around a whole training loop works too: each forward after a backward starts
    a new step. Either way the object lives until :meth:`close` (or garbage collection). A
    ``with off:`` inside an open block of the same offloader is part of that block.
    """

    def __init__(self, model: nn.Module | list[nn.Module] | None = None, config: OffloadConfig | Mapping | None = None, *,
                 store: Backend | None = None, **overrides: Any) -> None:
        config, keep_objects = keep.resolve_config(config, overrides)
        self.config = config
        self.model = model
        self._models = keep.model_list(model)
        self._blocks = [b for m in self._models for b in find_blocks(m, config.layers)]
        if config.keep_last_layers and not self._blocks:
            raise ValueError(
                f"keep_last_layers={config.keep_last_layers} needs blocks to count from: pass model= with an "
                "nn.ModuleList of blocks (or layers='dotted.name'), or set keep_last_layers=0")
        kept_modules = keep_objects + [keep.named_module(self._models, name) for name in config.keep_modules]
        self._backend: Backend = store if store is not None else make_backend(config)  # checks the paths
        self._tier: TieredBackend | None = None
        self._tier_devices = _TIER_DEVICES
        # A CUDA build of torch: a build flag, no driver call (a CPU step must not touch CUDA,
        # tests/test_import.py); the tier starts only at the first CUDA save.
        if config.host_bytes != 0 and (torch.backends.cuda.is_built() or "cpu" in _TIER_DEVICES):
            self._backend = self._tier = TieredBackend(self._backend, config.host_bytes)
        self._fwd_timer: device.GpuTimer | None = None
        self._ordered: tuple = ()  # the last (copy fence, stream) ordered (Offloader._copy_due)
        self._fwd_dev: torch.device | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._counters = Counters()
        self._cache = Cache(self._counters, self._backend.free)
        self._entries = self._cache.entries
        self._small_bytes = config.min_bytes  # smaller storages: Note [a small save skips the cache]
        self._endurance = None
        if self.backend in ("posix", "kvikio"):
            self._endurance = EnduranceMonitor(list(config.paths), config.rated_tbw, config.endurance_horizon_days)
        self._failures = WriteFailures(config.on_error)
        self._budget = WriteBudget(_now(), 1 << 20)
        self._meter = DriveMeter()
        self._peak = PeakClock(self._meter)  # Note [write what leaves before the peak]
        self._peak.enforce = config.when_full == "keep" and not config.late_writes
        self._advice = DriveAdvice()
        self._policy = KeepPolicy(min_bytes=config.min_bytes, when_full=config.when_full, budget=self._budget,
                                  keep_from_layer=len(self._blocks) - config.keep_last_layers
                                  if config.keep_last_layers else None)
        # Writes handed to the backend at once: enough to keep every I/O thread busy.
        writing = 2 * config.chunk_bytes * config.io_threads * len(config.paths)
        self._writer = WriteQueue(self._backend, self._cache, self._lock, max_inflight_bytes=config.max_inflight_bytes,
                                  max_writing_bytes=writing, verify=config.verify, budget=self._budget,
                                  failures=self._failures, endurance=self._endurance, meter=self._meter,
                                  clock=_clock, gate=self._peak.may_start)
        self._graveyard: deque = deque()
        self._window = ReadWindow(max(2 * config.chunk_bytes, 16 << 20), config.prefetch_bytes, _now())
        self._reader = Reader(self._backend, self._cache, self._lock, self._window, self._budget,
                              max_layers=config.prefetch_layers, clock=_clock)
        self._ids = itertools.count()
        self._scopes = Scopes(on_forget=partial(_learn, self._budget))
        self._layer_stack: list[int] = []
        self._keep_depth = [0]
        self._nested = 0  # ``with off:`` blocks open inside another of ours: Note [nested blocks are one]
        self._pinned: frozenset[int] = frozenset()
        self._reads_pending = False  # a scope in backward may still read ahead (Offloader._read_on)
        self._closed = False
        # The model must not keep the offloader alive (its finalizer closes it): hooks hold no self.
        self._hook_handles = keep.install_hooks(self._blocks, kept_modules, self._layer_stack, self._keep_depth)
        self._counters.total.backend = self._backend.describe()
        self._finalizer = weakref.finalize(self, _shutdown, self._writer, self._backend, self._hook_handles)

    # -- public surface --------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """The backend in use (``auto`` resolved), e.g. ``"posix"``."""
        return self._backend.name

    def __enter__(self) -> Offloader:
        # Note [nested blocks are one]: a ``with off:`` inside an open block of this offloader
        # (``with off:`` or ``off.microbatch``: a framework's and the user's own) only counts;
        # its saves go to the outer block, whose exit alone ends the forward. A step whose
        # ``__exit__`` was cut short as it began is such an outer block: still exact.
        if self._scopes.opened_by(self):
            self._nested += 1
            return self
        self._activate(self._scopes.new_step())
        return self

    def _leave_stale_steps(self) -> None:
        for scope in keep.leave_stale_steps(self, self._scopes.active):
            with self._lock:
                self._scopes.forget_if_empty(scope)

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._nested:
            self._nested -= 1
            return
        depth = len(self._scopes.active)
        try:
            scope = self._deactivate(raise_errors=exc_type is None)
        except BaseException:
            if len(self._scopes.active) == depth:  # interrupted before the hooks were popped
                keep.leave_stale_steps(self, self._scopes.active)
            raise
        if exc_type is None:
            # Forward is over and backward comes next: keep what is still queued, start reading.
            with self._lock:
                if not scope.backward_started:
                    self._begin_backward(scope)

    @contextlib.contextmanager
    def microbatch(self, mb_id: Any) -> Iterator[Offloader]:
        """Scope for micro-batch ``mb_id``'s forward: its saves get their own order and prefetch
        queue. Activates the hooks itself; pipeline schedules call ``prefetch(mb_id)`` before
        that micro-batch's backward."""
        self._activate(Scope(mb_id, stats_id=mb_id))
        ok = False
        try:
            yield self
            ok = True
        finally:
            self._deactivate(raise_errors=ok)

    def prefetch(self, mb_id: Any) -> None:
        """Micro-batch ``mb_id``'s backward comes next: keep what is still queued, read its tail."""
        self._check_open()
        self._safe_point(raise_errors=False)
        with self._lock:
            scope = self._scopes.by_id.get(mb_id)
            if scope is not None and not scope.backward_started:
                self._begin_backward(scope)

    def wait(self) -> None:
        """Blocks until every write issued so far is on storage (or has failed), and its memory
        is released; backward then reads back what it needs, ahead of need. That includes the
        last save of a forward whose backward has not begun (Note [the last save waits]); once
        backward has begun, that save stays in memory. Space of entries that died while a read
        into them was in flight is returned too."""
        self._drain(reconcile=True)  # references already dropped free their extents (or schedule it) first
        with self._lock:
            self._writer.release_held(self._scopes.in_forward())
        self._writer.pump()
        with self._lock:
            self._writer.settle()
            self._backend.heal()
            self._cache.recount()
            armed = self._scopes.restart_armed(self._writer.completed)
        self._safe_point(raise_errors=True)
        with self._lock:
            for scope in armed:
                self._reader.prefetch(scope, None)

    def stats(self) -> OffloadStats:
        """Counters since creation (see :class:`OffloadStats`)."""
        self._safe_point(raise_errors=False)
        with self._lock:
            snap = self._counters.snapshot()
            snap.live_entries = len(self._cache)
            snap.live_disk_bytes = self._cache.disk_bytes
            snap.prefetch_window_bytes = self._window.bytes
            snap.write_budget_bytes = self._budget.limit
        if self._tier is not None:
            self._tier.fill(snap)
        snap.written_bytes_by_path = self._backend.written_bytes_by_path()
        if self._endurance is not None:
            snap.endurance = self._endurance.projection()
        return snap

    def reset_peak(self) -> None:
        """Restarts ``peak_resident_bytes`` from the bytes resident now (e.g. at each step)."""
        with self._lock:
            self._counters.reset_peak()

    def record_timeline(self, enabled: bool = True) -> list[tuple[float, int]]:
        """Starts (or stops) recording ``(perf_counter, resident_bytes)`` at every change; returns
        the list being filled."""
        with self._lock:
            return self._counters.record_timeline(enabled)

    def close(self) -> None:
        """Finishes I/O in flight and releases files and threads; idempotent.

        Saved references that are still on storage afterwards cannot be unpacked (a clear error
        says so); those still in memory can.
        """
        if self._closed:
            return
        self._closed = True
        self._nested = 0
        self._leave_stale_steps()
        with self._lock:
            self._writer.release_held(self._scopes.by_id.values())
        self._writer.close()
        self._drain()
        with self._lock:
            self._cache.orphan_on_disk()
        self._finalizer()

    # -- activation -------------------------------------------------------------------------
    def _activate(self, scope: Scope) -> None:
        self._check_open()
        self._safe_point(raise_errors=True)
        if self._models:
            self._pinned = keep.storage_keys(t for m in self._models for t in itertools.chain(m.parameters(), m.buffers()))
        self._layer_stack.clear()
        self._keep_depth[0] = 0
        with self._lock:
            self._open_scope(scope)
        keep.enter_hooks(keep.untraced(self._pack), keep.untraced(self._unpack), self._scopes.active, scope)

    def _open_scope(self, scope: Scope) -> None:
        """Under the lock: a forward begins. Another forward comes before their backward: the
        waiting last saves of the scopes still in forward are written after all (Note [the last
        save waits])."""
        self._writer.release_held(self._scopes.in_forward())
        self._scopes.by_id[scope.id] = scope
        now = _now()
        scope.tally = self._budget.new_step(now)
        scope.unique_at_start = self._counters.total.unique_bytes
        scope.resident_at_start = self._counters.forward_peak = self._counters.total.resident_bytes
        if scope.stats_id is None:  # a step: Note [write what leaves before the peak]
            self._peak.begin(scope, now)
        else:  # a micro-batch: its stage's peak is elsewhere
            self._peak.active = False
        if self._tier is not None:
            self._tier_forward_begins()

    def _deactivate(self, *, raise_errors: bool) -> Scope:
        rec = self._scopes.active[-1]
        scope = rec[1]
        try:
            torch._C._autograd._pop_saved_tensors_default_hooks()  # C: see keep.enter_hooks
        finally:
            if self._scopes.active and self._scopes.active[-1] is rec:
                self._scopes.active.pop()
        with self._lock:
            self._scopes.forget_if_empty(scope)
        self._writer.pump()
        if self._endurance is not None:  # once per step or micro-batch: it stats the drives
            msg = self._endurance.check()
            if msg:
                warnings.warn(msg, RuntimeWarning, stacklevel=3)
        tier_used = self._tier is not None and self._tier.pool is not None
        if not self._advice.given and not tier_used:  # Note [say when the drive carries little]
            with self._lock:
                t = self._counters.total
                msg = self._advice.observe(t.unique_bytes, t.written_bytes,
                                           t.budget_kept_bytes + t.adaptive_keep_bytes + t.peak_kept_bytes)
            if msg:
                warnings.warn(msg, RuntimeWarning, stacklevel=3)
        self._safe_point(raise_errors=raise_errors)
        return scope

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Offloader is closed; create a new one")
        if os.getpid() != self._pid:
            raise RuntimeError(f"this Offloader was created in process {self._pid} and cannot be used in a forked "
                               f"child ({os.getpid()}): its files and I/O threads belong to the parent; create a new "
                               "Offloader in the child")

    def _step_scope(self) -> Scope:
        """The scope saves go to (a new step's, when a forward follows a backward: Scopes.current)."""
        scope, done = self._scopes.current(in_backward=torch._C._current_graph_task_id() != -1)
        if done is not None:
            with self._lock:
                self._scopes.forget_if_empty(done)
                self._open_scope(scope)
        return scope

    # -- pack ---------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        if keep.as_is(t, self._pinned, self._keep_depth[0] > 0):
            return keep.alias(t)
        if type(t) is not torch.Tensor:
            return self._pack_parts(t)
        # Note [pack is the training thread's time]: every call below is paid once per save, on
        # the thread that launches the model's kernels (about 325 saves a step at the bench's GPU
        # shape; 37 us a save doubled an H200's host forward, 2026-11-27): each value is read
        # once, no context manager is entered unless a profiler runs. benchmarks/pack_cost.py counts the calls and times them.
        self._check_open()
        storage = t.untyped_storage()
        nbytes = t.nbytes
        storage_bytes = storage.nbytes()
        if storage_bytes < self._small_bytes:  # Note [a small save skips the cache]
            scope = self._step_scope()
            with self._lock:
                if self._peak.active:
                    self._peak.produced(nbytes, _now())
                return self._cache.small.add(t, storage, scope.stats_id)
        self._safe_point(raise_errors=True)
        if torch.autograd.profiler._is_profiler_enabled:
            with profiled("ssdtrain.pack"):
                return self._pack_entry(t, storage, nbytes, storage_bytes)
        return self._pack_entry(t, storage, nbytes, storage_bytes)

    def _pack_entry(self, t: torch.Tensor, storage: Any, nbytes: int, storage_bytes: int) -> Any:
        """Pack of a save that is not small: shared, kept at once, or a new entry."""
        scope = self._step_scope()
        view_lo, view_hi = byte_span(t)
        lo, hi = entry_span(view_lo, view_hi, storage_bytes)
        layer = self._layer_stack[-1] if self._layer_stack else None
        with self._lock:
            if self._peak.active:
                self._peak.produced(nbytes, _now())
            entry = self._cache.index.find(t, view_lo, view_hi)
            small = None
            if entry is None:  # Note [a save the budget keeps skips the cache]
                why = self._kept_at_once(t, hi - lo)
                if why is not None:
                    if (self._tier is not None and t.device.type in self._tier_devices
                            and storage._cdata not in self._cache.small.rows):
                        self._tier.clock.produced(hi - lo)  # Note [the copy clock counts every save]
                    small = self._cache.small.add(t, storage, scope.stats_id, why)
                    self._writer.passed(scope, hi - lo)
            if small is None:
                self._counters.add(scope.stats_id, "saved_bytes", nbytes)
                fresh = entry is None
                try:
                    if fresh:
                        entry = self._new_entry(t, lo, hi, scope, layer)
                    ref = Ref(entry, t, self._graveyard)
                except BaseException:
                    if fresh and entry is not None and entry.refs == 0:  # interrupted: nothing holds it
                        self._drop_ref(entry, -1, None)
                    raise
        if self._writer.pending:
            self._writer.pump()
        return ref if small is None else small

    def _pack_parts(self, t: torch.Tensor) -> Any:
        """Note [a DTensor is saved by its parts]: each tensor part packed as a save of its own."""
        parts, ctx = keep.parts(t)
        packed = {name: self._pack(p) for name, p in parts.items() if isinstance(p, torch.Tensor)}
        if all(isinstance(ref, torch.Tensor) for ref in packed.values()):
            return keep.alias(t)  # every part stays in memory: so does the whole
        others = {n: p for n, p in parts.items() if n not in packed}
        return Parts(t, ctx, packed, others, keep.version_guard(t, packed))

    def _new_entry(self, t: torch.Tensor, lo: int, hi: int, scope: Scope, layer: int | None) -> Entry:
        """Under the lock: a new entry, kept or queued for writing (Note [write only what comes
        back in time] for the budget, Note [write what leaves before the peak] for the time)."""
        e = self._cache.new(next(self._ids), t, lo, hi, scope, layer)
        scope.live_entries += 1
        n = e.nbytes
        tier = self._tier is not None and e.device.type in self._tier_devices
        if tier:
            self._tier.clock.produced(n)
            if self._fwd_dev is None and e.device.type == "cuda":
                self._fwd_dev = e.device  # forwards are timed on it from the next one on
        late = not tier and not self._peak.fits(n, self._writer.queued_bytes, _now())
        choice = self._policy.decide(n, layer, self._writer.has_room(n), budget=self._tier.clock if tier else None,
                                     late=late)
        if choice == "wait":
            waited = self._writer.wait_for_room(n, self._scopes.by_id.values())
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
            self._writer.passed(scope, n)  # pumped by pack's caller if so: the entry is not queued
            return e
        extent = self._tier.allocate_host(n, e.device) if tier else None
        if extent is not None:
            extent.due = self._tier.clock.schedule(n)
        elif tier and self.config.when_full == "keep" and not self._budget.allows(n):
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
        e.fence = device.producer_fence(t)
        scope.add(e)
        self._writer.hold(scope, e)
        return e

    # -- safe points -----------------------------------------------------------------------------
    def _safe_point(self, *, raise_errors: bool) -> None:
        if (self._graveyard or self._writer.completed or self._cache.late or self._cache.small.dead
                or self._cache.lagging):
            self._drain()
        self._failures.surface(raise_errors=raise_errors)

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
            while self._graveyard:
                # Given back before it leaves the graveyard: an interrupt in between leaves it
                # there, and giving it back again does nothing (Note [an interrupt never
                # unbalances a count]).
                e, gen, weak = self._graveyard[0]
                self._drop_ref(e, gen, weak)
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
    # Note [the copy clock counts every save]
    # The copy clock's positions are the bytes a forward produced, and the forward measured for
    # its reference copies nothing: its budget closes at the first save, and every later save is
    # kept at once, with no entry. Those saves are counted too; counting entries alone gave that
    # forward a total of one save, and every copy after was refused as due after forward's end
    # (the H200, 2026-11-27: the tier copied nothing, offload lowered no peak).
    def _kept_at_once(self, t: torch.Tensor, nbytes: int) -> str | None:
        """Under the lock: whether a new save of ``t`` (``nbytes``) will be kept whatever its entry
        would say, and why (the counter its bytes add to): its forward closed its budget, or its
        write would end after the peak (Note [write what leaves before the peak])."""
        if self.config.when_full != "keep":
            return None
        if self._tier is not None and t.device.type in self._tier_devices:
            return "budget_kept_bytes" if self._tier.clock.closed else None
        if self._budget.current.bound:
            return "budget_kept_bytes"
        if nbytes >= self.config.min_bytes and not self._peak.fits(nbytes, self._writer.queued_bytes, _now()):
            return "peak_kept_bytes"
        return None

    # -- the host tier ------------------------------------------------------------------------------
    def _copy_due(self, e: Entry) -> bool:
        """Under the lock: whether ``e``'s device memory may go now (Note [a tier copy is released
        in stream order], Note [copy what leaves before the peak]); if so, the compute stream is
        made to wait for its copy first."""
        ext = e.extent
        if type(ext) is not HostExtent or ext.landed is None:
            return True  # on a drive (its write is done), or copied with no device
        if not (self._tier.clock.is_due(ext.due) or ext.landed.done()):
            return False
        # The producer's stream used the save (it is the allocation stream, or the user tied the
        # tensor to it with record_stream): work it queues from now on runs after the copy.
        stream = e.fence.stream if e.fence is not None else device.current_stream(e.device)
        if self._ordered != (ext.landed, stream):  # one copy fence marks a whole batch: once is enough
            self._ordered = (ext.landed, stream)
            device.order_current(ext.landed, stream)
        return True

    def _tier_forward_begins(self) -> None:
        """Under the lock: the copy clock learns from the last forward's device time, and starts
        over; this forward's start is marked on the device."""
        clock = self._tier.clock
        timer, self._fwd_timer = self._fwd_timer, None
        if timer is not None:
            clock.learn(timer.seconds(), clock.pos)
        room = True
        if clock.wants_reference() and self._fwd_dev is not None:  # Note [the reference forward needs room]
            need = REFERENCE_ROOM * clock.sent + REFERENCE_SLACK
            room = not clock.sent or device.room_above_peak(self._fwd_dev) >= need
            if not room and not clock.deferred:
                warnings.warn(
                    f"ssdtrain: the host tier took {clock.sent / 2**30:.2f} GiB off the last step's "
                    f"peak, and {self._fwd_dev} has no room to measure a forward without it; the tier copies every "
                    "save it can until it has (a slower step than a learned copy budget, not out of memory)",
                    RuntimeWarning, stacklevel=4)
        clock.begin(room)
        if self._fwd_dev is not None:
            self._fwd_timer = device.GpuTimer(self._fwd_dev)

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

    # -- unpack -------------------------------------------------------------------------------------
    def _unpack(self, ref: Any) -> torch.Tensor:
        if isinstance(ref, torch.Tensor):
            return ref
        if type(ref) is Small:
            if self._reads_pending and (self._cache.small.dead or self._graveyard):
                self._read_on()
            return ref.unpack()
        if type(ref) is Parts:
            return ref.rebuild(self._unpack)
        self._safe_point(raise_errors=False)
        if torch.autograd.profiler._is_profiler_enabled:  # Note [pack is the training thread's time]
            with profiled("ssdtrain.unpack"):
                return self._unpack_entry(ref)
        return self._unpack_entry(ref)

    def _unpack_entry(self, ref: Ref) -> torch.Tensor:
        e = ref.entry
        scope = e.scope
        with self._lock:
            if e.state is State.FREED:
                raise RuntimeError("ssdtrain: a saved tensor was unpacked after it was freed (internal error)")
            if not scope.backward_started:
                self._begin_backward(scope)
            scope.armed = False
            e.check_version()
            if e.tainted:
                raise RuntimeError(e.tainted)
            if e.data is None and e.consumed_pass == scope.passes and e.loaded is None:
                # Unpacked again after every save of it was: a new backward pass (retain_graph).
                scope.passes += 1
                scope.restart()
            self._reader.prefetch(scope, e.layer)
            scope.used(e)
            if e.data is not None:
                if e.state is State.QUEUED:
                    self._writer.cancel(e)
                self._cache.forwarded(e)
                return device.for_consumer(rebuild(e.data, ref))
            if e.error is not None:
                # A fresh copy each time: a raised exception keeps its traceback, and the
                # frames in it (holding saved references) must not live on in the entry.
                raise copy.copy(e.error).with_traceback(None)
            fut, buf = self._reader.claim(e)
        return device.for_consumer(self._reader.finish(e, ref, fut, buf))

    # Note [reads go on while kept saves are used]
    # Read-ahead advances at unpacks (Reader.prefetch), into the memory backward frees. In the
    # drive-limited regime most saves are kept, held as small saves are (Note [a save the budget
    # keeps skips the cache]), and their unpacks skip the engine: a backward made of them would
    # issue no read until it reached the first offloaded save, and then wait for all of them
    # (measured on the bench model at 100 MB/s: 1.1 s of waits in a 6 s step). So while a scope
    # in backward has saves left to read, a small save's unpack that finds saves died since
    # settles them (the memory they free is room for reads) and moves the read-ahead on.
    def _read_on(self) -> None:
        self._drain()
        with self._lock:
            pending = False
            for scope in list(self._scopes.by_id.values()):
                if scope.backward_started and scope.cursor >= 0:
                    self._reader.prefetch(scope, scope.layer_now)
                    pending = pending or scope.cursor >= 0
            self._reads_pending = pending

    def _begin_backward(self, scope: Scope) -> None:
        """Under the lock. Adaptive keep: writes still queued are exactly what backward needs
        first, so cancel them and keep those tensors; then start reading the tail."""
        scope.backward_started = True
        scope.held = None  # cancelled below with the rest of the queue
        if self._fwd_timer is not None:
            self._fwd_timer.stop(self._fwd_dev)
        now = _now()
        step = scope.stats_id is None
        if step and self._peak.active:
            self._forward_ended(scope, now)
        scope.restart()
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


REFERENCE_ROOM = 1.25
REFERENCE_SLACK = 256 << 20
"""The room above the last peak that a forward measured with no copy needs (Note [the reference
forward needs room]): ``REFERENCE_ROOM`` times what left the device in the last forward, plus
``REFERENCE_SLACK`` bytes; both margins are for a fragmented allocator."""


def _clock() -> float:
    return _now()  # the seam, looked up at each call


def _learn(budget: WriteBudget, scope: Scope) -> None:
    """A scope is forgotten: its backward is over; the write budget learns from its forward."""
    if scope.tally is not None:
        budget.finish(scope.tally, _now())


def _shutdown(writer: WriteQueue, backend: Backend, handles: list) -> None:
    for h in handles:
        h.remove()
    handles.clear()
    writer.close()
    backend.close()
