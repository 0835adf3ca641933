"""The :class:`Offloader`: saved-tensor hooks that send activations to storage and bring them back.

Pack and unpack are short: they ask the cache (``cache.py``) which entry a save belongs to, the
schedule (``schedule.py``) what to keep and what to read ahead, and the backend (``store/``) to do
the I/O. All shared state is guarded by one lock; I/O threads touch it only in the write
completion callback. Reads are polled by the thread that needs them, never called back.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
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

from ssdtrain import device
from ssdtrain.cache import SPAN_ALIGN, Entry, Ref, State, StorageIndex, byte_span, rebuild
from ssdtrain.config import OffloadConfig
from ssdtrain.schedule import Scope, find_blocks
from ssdtrain.stats import Counters, OffloadStats
from ssdtrain.store import Backend, StorageError, make_backend
from ssdtrain.store._mem import profiled

__all__ = ["Offloader", "offload", "no_offload"]

log = logging.getLogger(__name__)

# Note [a window as small as the drive allows]: the share of time backward may wait on reads
# before the read-ahead window doubles (at the next pass), and the share that doubles it at once.
# A wait is time the step loses outright, while the memory a larger window holds is bounded by
# ``prefetch_bytes``; so the budget is a quarter of a percent. At 1% the bench model settled on
# a 32 MiB window and waited 0.7% of every step; at 0.25% the window swings between 25 and
# 64 MiB (it shrinks after clean passes), and the median step waits for nothing.
STALL_BUDGET = 0.0025
STALL_RUSH = 0.10
_now = time.perf_counter  # a seam for the tests of that policy



class Offloader:
    """Offloads the activations saved for backward inside ``with off:`` (or ``off.microbatch(i)``).

    Args:
        model: the model being trained (optional), or its chunks in layer order (interleaved
            pipelines). Parameters and buffers are never written; its repeated blocks tag saves for
            ``keep_last_layers`` and block-wise prefetch.
        config: an :class:`OffloadConfig` (or a mapping of its fields).
        store: a ready :class:`~ssdtrain.store.Backend` to use instead of the one ``backend``
            names (custom storage; the tests use a store whose I/O they complete by hand).
        **overrides: fields of :class:`OffloadConfig` that replace those of ``config``.

    Raises:
        ValueError: for bad settings or an unusable ``path``, before any tensor is touched.

    Example::

        off = ssdtrain.Offloader(model, path="/nvme/ssdtrain")
        for x, y in data:
            with off:
                loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
        off.close()
    """

    def __init__(self, model: nn.Module | list[nn.Module] | None = None, config: OffloadConfig | Mapping | None = None, *,
                 store: Backend | None = None, **overrides: Any) -> None:
        if config is None:
            config = OffloadConfig.from_dict(overrides)
        else:
            if isinstance(config, Mapping):
                config = OffloadConfig.from_dict(config)
            elif not isinstance(config, OffloadConfig):
                raise TypeError(f"config must be an OffloadConfig or a mapping, not {type(config).__name__}")
            if overrides:
                config = config.replace(**overrides)
        if model is None:
            models: list[nn.Module] = []
        elif isinstance(model, nn.Module):
            models = [model]
        elif isinstance(model, (list, tuple)) and model and all(isinstance(m, nn.Module) for m in model):
            models = list(model)  # model chunks (interleaved pipelines), first layers first
        else:
            raise TypeError(f"model must be an nn.Module, a list of them (model chunks), or None; "
                            f"not {type(model).__name__}")
        self.config = config
        self.model = model
        self._models = models
        self._blocks = [b for m in models for b in find_blocks(m, config.layers)]
        if config.keep_last_layers and not self._blocks:
            raise ValueError(
                f"keep_last_layers={config.keep_last_layers} needs blocks to count from: pass model= with an "
                "nn.ModuleList of blocks (or layers='dotted.name'), or set keep_last_layers=0")
        self._backend: Backend = store if store is not None else make_backend(config)  # checks the paths
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._index = StorageIndex()
        self._entries: dict[int, Entry] = {}
        self._graveyard: deque = deque()
        self._completed: deque = deque()
        self._write_queue: deque = deque()
        self._writing = 0
        self._writing_bytes = 0
        self._late_frees = 0  # extents of freed entries still being read into a dropped buffer
        self._late_extents: deque = deque()  # ... and those whose read is done: free at a safe point
        # Note [a window as small as the drive allows]: read-ahead starts small and is resized
        # once per backward pass (at its start) from what the pass before it cost: it doubles
        # when backward waited on reads for more than STALL_BUDGET of that time, and shrinks by
        # a quarter after a pass with no wait at all. A fast drive thus costs little memory, a
        # slow one gets the window it needs, with no profiling pass; and one wait caused by a
        # hiccup of the machine does not grow the window for the rest of the run. A drive far
        # too slow for the window grows it at once (STALL_RUSH), without waiting for the pass.
        self._window_min = min(config.prefetch_bytes, max(2 * config.chunk_bytes, 16 << 20))
        self._window = self._window_min
        self._period_start = _now()
        self._period_stall = 0.0
        self._period_misses = 0
        self._last_period = 0.0
        # Writes handed to the backend at once: enough to keep every I/O thread busy, few enough
        # that the rest stays queued: cancellable when backward wants it first (adaptive keep),
        # and not in the way of reads.
        self._max_writing_bytes = 2 * config.chunk_bytes * config.io_threads * len(config.paths)
        self._inflight_bytes = 0
        self._disk_bytes = 0
        self._counters = Counters()
        self._ids = itertools.count()
        self._steps = itertools.count()
        self._scopes: dict[Any, Scope] = {}
        self._scope_stack: list[Scope] = []
        self._layer_stack: list[int] = []
        self._pinned: frozenset[int] = frozenset()
        self._error: BaseException | None = None
        self._warnings: list[str] = []
        self._warned_keep = False
        self._closed = False
        self._hook_handles = []
        # The model must not keep the offloader alive (its finalizer closes it): hooks hold it weakly.
        layers = _LayerTracker(self._layer_stack)
        for i, block in enumerate(self._blocks):
            self._hook_handles.append(block.register_forward_pre_hook(partial(layers.enter, i)))
            self._hook_handles.append(block.register_forward_hook(layers.leave))
        self._counters.total.backend = self._backend.describe()
        self._finalizer = weakref.finalize(self, _shutdown, self._backend, self._hook_handles)
        self._endurance = self._make_endurance()

    # -- public surface --------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """The backend in use (``auto`` resolved), e.g. ``"posix"``."""
        return self._backend.name

    def __enter__(self) -> Offloader:
        self._activate(Scope(("step", next(self._steps))))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        scope = self._scope_stack[-1]
        self._deactivate(raise_errors=exc_type is None)
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
            scope = self._scopes.get(mb_id)
            if scope is not None and not scope.backward_started:
                self._begin_backward(scope)

    def wait(self) -> None:
        """Blocks until every write issued so far is on storage (or has failed), and its memory
        is released; backward then reads back what it needs, ahead of need. That includes the
        last save of a forward whose backward has not begun (Note [the last save waits]); once
        backward has begun, that save stays in memory. Space of entries that died while a read
        into them was in flight is returned too."""
        self._drain()  # references already dropped free their extents (or schedule it) first
        with self._lock:
            self._release_held([s for s in self._scopes.values() if not s.backward_started])
        self._pump()
        with self._lock:
            while self._write_queue or self._writing or self._late_frees:
                self._wait_io()
            armed = [s for s in self._scopes.values() if s.armed]
            for scope in armed:
                # The window kept what it passed in memory; release it too. Writes that finished
                # before now were settled at an earlier safe point and kept for the window: they
                # go through the drain again.
                scope.restart()
                self._completed.extend(e for e in scope.order if e.state is State.WRITTEN)
        self._safe_point(raise_errors=True)
        with self._lock:
            for scope in armed:
                self._prefetch(scope, None)

    def stats(self) -> OffloadStats:
        """Counters since creation (see :class:`OffloadStats`)."""
        self._safe_point(raise_errors=False)
        with self._lock:
            snap = self._counters.snapshot()
            snap.live_entries = len(self._entries)
            snap.live_disk_bytes = self._disk_bytes
            snap.prefetch_window_bytes = self._window
        snap.written_bytes_by_path = self._backend.written_bytes_by_path()
        if self._endurance is not None:
            snap.endurance = self._endurance.projection()
        return snap

    def written_bytes_by_path(self) -> dict[str, int]:
        return self._backend.written_bytes_by_path()

    def reset_peak(self) -> None:
        """Restarts ``peak_resident_bytes`` from the bytes resident now (e.g. at each step)."""
        with self._lock:
            t = self._counters.total
            t.peak_resident_bytes = t.resident_bytes

    def record_timeline(self, enabled: bool = True) -> list[tuple[float, int]]:
        """Starts (or stops) recording ``(perf_counter, resident_bytes)`` at every change; returns
        the list being filled."""
        with self._lock:
            if enabled:
                self._counters.timeline = []
                return self._counters.timeline
            timeline, self._counters.timeline = self._counters.timeline or [], None
            return timeline

    def close(self) -> None:
        """Finishes I/O in flight and releases files and threads; idempotent.

        Saved references that are still on storage afterwards cannot be unpacked (a clear error
        says so); those still in memory can.
        """
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._release_held(self._scopes.values())
            for e in list(self._write_queue):
                if e.state is State.QUEUED:
                    self._cancel_write(e)
            self._write_queue.clear()
            while self._writing:
                self._wait_io()
        self._drain()
        with self._lock:
            for e in self._entries.values():
                if e.state is State.ON_DISK and e.loaded is None:
                    e.error = RuntimeError("ssdtrain: this saved tensor was on storage when its Offloader was "
                                           "closed; run backward before close()")
        self._finalizer()

    # -- activation -------------------------------------------------------------------------
    def _activate(self, scope: Scope) -> None:
        self._check_open()
        self._safe_point(raise_errors=True)
        if self._models:
            self._pinned = frozenset(t.untyped_storage()._cdata for m in self._models
                                     for t in itertools.chain(m.parameters(), m.buffers()))
        self._layer_stack.clear()
        with self._lock:
            # Another forward comes before their backward: the waiting last saves of the scopes
            # still in forward are written after all (Note [the last save waits]).
            self._release_held([s for s in self._scopes.values() if not s.backward_started])
            self._scopes[scope.id] = scope
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._scope_stack.append(scope)
        scope.hooks = hooks  # type: ignore[attr-defined]

    def _deactivate(self, *, raise_errors: bool) -> None:
        scope = self._scope_stack.pop()
        scope.hooks.__exit__(None, None, None)  # type: ignore[attr-defined]
        self._pump()
        if self._endurance is not None:  # once per step or micro-batch: it stats the drives
            msg = self._endurance.check()
            if msg:
                warnings.warn(msg, RuntimeWarning, stacklevel=3)
        self._safe_point(raise_errors=raise_errors)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Offloader is closed; create a new one")

    # -- pack ---------------------------------------------------------------------------------
    def _keeps_as_is(self, t: torch.Tensor) -> bool:
        """Tensors that are not activations, or that we cannot store: returned to autograd as is."""
        if type(t) is not torch.Tensor or t.layout is not torch.strided or t.is_inference():
            return True  # parameters (nn.Parameter), tensor subclasses, sparse, inference tensors
        if t.device.type not in ("cpu", "cuda") or t.numel() == 0:
            return True
        base = t._base
        if t.requires_grad and t.is_leaf and base is None:
            return True  # a leaf that wants gradients lives anyway (a parameter in all but name)
        if base is not None and (type(base) is not torch.Tensor or (base.requires_grad and base.is_leaf)):
            return True  # a view of a parameter (e.g. weight.t() saved by mm)
        try:
            return t.untyped_storage()._cdata in self._pinned
        except (RuntimeError, NotImplementedError):
            return True  # no real storage (functional / fake tensors)

    def _pack(self, t: torch.Tensor) -> Any:
        if self._keeps_as_is(t):
            return _as_is(t)
        with profiled("ssdtrain.pack"):
            self._safe_point(raise_errors=True)
            scope = self._scope_stack[-1] if self._scope_stack else self._orphan_scope()
            lo, hi = view_lo, view_hi = byte_span(t)
            storage_bytes = t.untyped_storage().nbytes()
            if 2 * (hi - lo) >= storage_bytes:
                # Most of the storage: cover all of it, so other views of it (q, k, v of a fused
                # QKV; transposes) are found in the same entry.
                lo, hi = 0, storage_bytes
            else:
                lo -= lo % SPAN_ALIGN
            layer = self._layer_stack[-1] if self._layer_stack else None
            with self._lock:
                self._counters.add(scope.stats_id, "saved_bytes", t.numel() * t.element_size())
                entry = self._index.find(t, view_lo, view_hi)
                if entry is None:
                    entry = self._new_entry(t, lo, hi, scope, layer)
                entry.refs += 1
                ref = Ref(entry, t, self._graveyard)
            if entry.state is State.QUEUED:
                self._pump()
            return ref

    def _orphan_scope(self) -> Scope:
        # Hooks entered by hand (torch.autograd.graph.saved_tensors_hooks(off._pack, off._unpack)).
        scope = Scope(("step", next(self._steps)))
        self._scope_stack.append(scope)  # stays: hooks entered by hand have no exit of ours
        self._scopes[scope.id] = scope
        return scope

    def _new_entry(self, t: torch.Tensor, lo: int, hi: int, scope: Scope, layer: int | None) -> Entry:
        """Called under the lock. Decides keep or write, and queues the write."""
        cfg = self.config
        e = Entry(next(self._ids), t, lo, hi, scope, layer)
        n = e.nbytes
        self._index.add(e)
        self._entries[e.id] = e
        scope.live_entries += 1
        self._counters.add(scope.stats_id, "unique_bytes", n)
        self._counters.resident(n)
        last = len(self._blocks) - cfg.keep_last_layers
        if n < cfg.min_bytes or (layer is not None and layer >= last and cfg.keep_last_layers):
            self._counters.add(scope.stats_id, "kept_bytes", n)
            return e
        if self._inflight_bytes and self._inflight_bytes + n > cfg.max_inflight_bytes:
            if cfg.when_full == "keep":
                self._counters.add(scope.stats_id, "backpressure_keeps", 1)
                self._counters.add(scope.stats_id, "kept_bytes", n)
                return e
            self._wait_for_room(scope, n)
        try:
            e.extent = self._backend.allocate(n)
        except StorageError as err:
            return self._keep_after_error(e, err)
        self._disk_bytes += e.extent.length
        e.fence = device.producer_fence(t)
        e.state = State.QUEUED
        e.offloaded = True
        scope.add(e)
        # Note [the last save waits]: a write starts only once the next save came. The last
        # save of a forward is what backward needs first; had its write already started, the
        # bytes would go to the drive only to be handed back from memory. When backward begins
        # the waiting write is cancelled like any other queued one (adaptive keep). It is
        # queued after all when another forward starts first (pipelines), on wait(), and when
        # pack waits for room.
        if scope.held is not None:
            self._write_queue.append(scope.held)
        scope.held = e
        self._inflight_bytes += n
        return e

    def _release_held(self, scopes) -> None:
        """Under the lock: the waiting last saves of ``scopes`` join the write queue."""
        for scope in scopes:
            if scope.held is not None:
                self._write_queue.append(scope.held)
                scope.held = None

    def _wait_for_room(self, scope: Scope, n: int) -> None:
        """Note [bounded memory in flight]: pack waits (lock released) until writes drain."""
        self._counters.add(scope.stats_id, "backpressure_waits", 1)
        self._release_held(self._scopes.values())  # they count as in flight: let them go
        start = time.perf_counter()
        with profiled("ssdtrain.stall.backpressure"):
            while self._inflight_bytes and self._inflight_bytes + n > self.config.max_inflight_bytes:
                if not self._writing:
                    # Nothing in flight to wait for: start queued writes (we hold the lock).
                    self._lock.release()
                    try:
                        self._pump()
                    finally:
                        self._lock.acquire()
                    continue
                self._wait_io()
        waited = time.perf_counter() - start
        self._counters.add(scope.stats_id, "backpressure_stall_seconds", waited)
        self._counters.add(scope.stats_id, "stall_seconds", waited)

    # -- writes -------------------------------------------------------------------------------
    def _pump(self) -> None:
        """Starts queued writes, oldest first, up to the number the backend keeps in flight."""
        batch = []
        with self._lock:
            while self._write_queue and (not self._writing or self._writing_bytes < self._max_writing_bytes):
                e = self._write_queue.popleft()
                if e.state is State.QUEUED:
                    e.state = State.WRITING
                    self._writing += 1
                    self._writing_bytes += e.nbytes
                    batch.append(e)
        for e in batch:
            try:
                fut = self._backend.submit_write(e.extent, e.data, checksum=self.config.verify, ready=e.fence)
            except Exception as err:  # the pool is gone (closing) or the backend refused
                with self._lock:
                    self._writing -= 1
                    self._writing_bytes -= e.nbytes
                    self._inflight_bytes -= e.nbytes
                    self._write_failed(e, err)
                    self._cond.notify_all()
                continue
            e.write_future = fut
            fut.add_done_callback(partial(self._write_done, e))

    def _write_done(self, e: Entry, fut) -> None:
        """On an I/O thread, when a write finished."""
        err = fut.exception()
        with self._lock:
            self._writing -= 1
            self._writing_bytes -= e.nbytes
            self._inflight_bytes -= e.nbytes
            e.write_future = None
            if err is not None:
                self._write_failed(e, err)
            else:
                e.checksum = fut.result()
                self._counters.add(e.scope.stats_id, "written_bytes", e.nbytes)
                self._counters.add(e.scope.stats_id, "writes", 1)
                if self._endurance is not None:
                    self._endurance.record(e.extent.path_index, e.nbytes)
                if e.state is State.WRITING:
                    e.state = State.WRITTEN
                    self._completed.append(e)
                elif e.state is State.FREED:
                    self._free_extent(e)
            self._cond.notify_all()
        self._pump()

    def _write_failed(self, e: Entry, err: BaseException) -> None:
        """Under the lock. Note [a failing drive does not corrupt training]: the bytes never left
        memory (they are dropped only after a successful write), so the entry simply stays."""
        self._counters.add(e.scope.stats_id, "failed_writes", 1)
        if e.state is State.FREED:
            self._free_extent(e)
            return
        self._keep_after_error(e, err)

    def _keep_after_error(self, e: Entry, err: BaseException) -> Entry:
        if e.extent is not None:
            self._free_extent(e)
        e.state = State.KEPT
        self._counters.add(e.scope.stats_id, "kept_bytes", e.nbytes)
        if self.config.on_error == "raise":
            if self._error is None:
                self._error = err
        elif not self._warned_keep:
            self._warned_keep = True
            self._warnings.append(f"ssdtrain: a write failed ({err}); on_error='keep': tensors that cannot be "
                                  "written stay in memory (see stats().failed_writes)")
        return e

    def _free_extent(self, e: Entry) -> None:
        self._disk_bytes -= e.extent.length
        self._backend.free(e.extent)
        e.extent = None

    def _cancel_write(self, e: Entry) -> None:
        """Under the lock: a queued write is not needed (backward wants the tensor first)."""
        e.state = State.KEPT
        self._inflight_bytes -= e.nbytes
        self._free_extent(e)
        self._counters.add(e.scope.stats_id, "cancelled_writes", 1)
        self._cond.notify_all()

    def _wait_io(self) -> None:
        """Under the lock: waits for some I/O to finish. I/O that the caller completes (the
        posix backend's ring) is waited for with the lock released, so its callbacks can take it."""
        if self._late_extents:
            self._free_late()
            return
        # Late frees are queued by their callbacks without the lock, so without a notification.
        self._cond.wait(timeout=0.01 if self._late_frees else 1.0)

    # -- safe points -----------------------------------------------------------------------------
    def _safe_point(self, *, raise_errors: bool) -> None:
        if self._graveyard or self._completed or self._late_extents:
            self._drain()
        if self._warnings:
            for msg in self._warnings:
                warnings.warn(msg, RuntimeWarning, stacklevel=3)
            self._warnings.clear()
        if raise_errors and self._error is not None:
            err, self._error = self._error, None
            raise err

    def _drain(self) -> None:
        """Settles dead references and finished writes, on the thread that runs compute.

        Note [release at a safe point]: a write that finished on an I/O thread may have raced an
        in-place op still running on the compute thread (its version bump comes at the end of
        the op). Here, between ops of that thread, every such op has completed, so one more version
        check is exact; only then is the in-memory copy dropped.
        """
        with self._lock:
            self._free_late()
            while self._graveyard:
                e, gen = self._graveyard.popleft()
                self._drop_ref(e, gen)
            while self._completed:
                e = self._completed.popleft()
                if e.state is State.WRITTEN:
                    e.check_version()
                    if e.counted_ahead:
                        continue  # inside the read-ahead window: backward needs it soon, keep it
                    e.release_memory()
                    e.state = State.ON_DISK
                    self._counters.resident(-e.nbytes)

    def _drop_ref(self, e: Entry, gen: int) -> None:
        e.refs -= 1
        if gen == e.gen:
            e.unpacked_refs -= 1
        if e.refs > 0:
            self._maybe_drop_loaded(e)
            return
        self._index.remove(e)
        self._entries.pop(e.id, None)
        scope = e.scope
        scope.used(e)
        scope.live_entries -= 1
        if scope.held is e:
            scope.held = None
        if scope.live_entries == 0 and self._scopes.get(scope.id) is scope and scope not in self._scope_stack:
            del self._scopes[scope.id]
        state, e.state = e.state, State.FREED
        if state is State.QUEUED:
            self._inflight_bytes -= e.nbytes
            self._cond.notify_all()
        if e.data is not None:
            self._counters.resident(-e.nbytes)
        if e.loaded is not None or e.read_future is not None:
            self._counters.resident(-e.nbytes)
        if e.read_future is not None and not e.read_future.done():
            # The read still fills its buffer: give the extent back only when it is done.
            # The callback only queues the extent: it may run on this thread, inside this lock,
            # if the read completes between the check above and this line.
            ext, late = e.extent, self._late_extents
            e.extent = None
            self._late_frees += 1
            e.read_future.add_done_callback(lambda f: late.append(ext))
        elif e.extent is not None and state is not State.WRITING:
            self._free_extent(e)
        e.data = e.guard = e.loaded = e.read_buf = e.read_future = None

    def _free_late(self) -> None:
        """Under the lock: gives back the extents whose reads into dropped buffers are done."""
        while self._late_extents:
            extent = self._late_extents.popleft()
            self._disk_bytes -= extent.length
            self._backend.free(extent)
            self._late_frees -= 1

    def _maybe_drop_loaded(self, e: Entry) -> None:
        """Once every live save of a reloaded entry has been unpacked, hold its buffer weakly."""
        if e.loaded is not None and e.unpacked_refs >= e.refs:
            e.loaded_weak = weakref.ref(e.loaded)
            e.loaded = None
            e.consumed_pass = e.scope.passes
            e.gen += 1
            e.unpacked_refs = 0
            self._counters.resident(-e.nbytes)

    # -- unpack -------------------------------------------------------------------------------------
    def _unpack(self, ref: Any) -> torch.Tensor:
        if isinstance(ref, torch.Tensor):
            return ref
        with profiled("ssdtrain.unpack"):
            self._safe_point(raise_errors=False)
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
                self._prefetch(scope, e.layer)
                scope.used(e)
                if e.data is not None:
                    return self._forward(e, ref)
                if e.error is not None:
                    # A fresh copy each time: a raised exception keeps its traceback, and the
                    # frames in it (holding saved references) must not live on in the entry.
                    raise copy.copy(e.error).with_traceback(None)
                buf = e.loaded if e.loaded is not None else (e.loaded_weak() if e.loaded_weak else None)
                fut = None
                if buf is None:
                    if e.read_future is None:
                        self._issue_read(e)
                    fut, buf = e.read_future, e.read_buf
                else:
                    self._counters.add(scope.stats_id, "prefetch_hits", 1)
            if fut is not None:
                self._await_read(e, fut)
            with self._lock:
                if fut is not None and e.read_future is fut:
                    e.loaded, e.read_buf, e.read_future = buf, None, None
                if ref.gen != e.gen:
                    ref.gen = e.gen
                    e.unpacked_refs += 1
                out = rebuild(buf, ref)
                self._maybe_drop_loaded(e)
            return out

    def _forward(self, e: Entry, ref: Ref) -> torch.Tensor:
        """Under the lock: the bytes are still in memory; hand them back without a read."""
        if e.state is State.QUEUED:
            self._cancel_write(e)
        if not e.forwarded and e.offloaded:
            e.forwarded = True
            self._counters.add(e.scope.stats_id, "forwarded_bytes", e.nbytes)
        return rebuild(e.data, ref)

    def _begin_backward(self, scope: Scope) -> None:
        """Under the lock. Adaptive keep: writes still queued are exactly what backward needs
        first, so cancel them and keep those tensors; then start reading the tail."""
        scope.backward_started = True
        scope.held = None  # cancelled below with the rest of the queue
        self._resize_window()
        scope.restart()
        for e in scope.queued():
            self._cancel_write(e)
            self._counters.add(scope.stats_id, "adaptive_keep_bytes", e.nbytes)
        self._prefetch(scope, None)

    def _note_read_stall(self, waited: float) -> None:
        """Under the lock: backward waited ``waited`` seconds for a read."""
        self._period_misses += 1
        self._period_stall += waited
        now = _now()
        # Against the last pass's length too: waits right after a pass starts are common.
        if self._period_stall > STALL_RUSH * max(now - self._period_start, self._last_period):
            self._window = min(2 * self._window, self.config.prefetch_bytes)
            self._period_start, self._period_stall = now, 0.0

    def _resize_window(self) -> None:
        """Under the lock, as a backward pass begins: Note [a window as small as the drive allows]."""
        now = _now()
        elapsed = now - self._period_start
        if self._period_stall > STALL_BUDGET * elapsed:
            self._window = min(2 * self._window, self.config.prefetch_bytes)
        elif self._period_misses == 0:
            self._window = max(self._window_min, self._window - self._window // 4)
        self._period_start, self._period_stall, self._period_misses = now, 0.0, 0
        self._last_period = elapsed

    def _prefetch(self, scope: Scope, layer: int | None) -> None:
        cfg = self.config
        for e in scope.advance(layer, max_bytes=self._window, max_layers=cfg.prefetch_layers):
            self._issue_read(e)

    def _issue_read(self, e: Entry) -> None:
        """Under the lock: starts reading ``e`` back into a fresh buffer."""
        buf = self._backend.alloc_buffer(e.nbytes, e.device, extent=e.extent)
        e.read_buf = buf
        e.read_future = self._backend.submit_read(e.extent, buf, checksum=e.checksum,
                                                  ready=device.consumer_fence(buf))
        self._counters.add(e.scope.stats_id, "reads", 1)
        self._counters.resident(e.nbytes)

    def _await_read(self, e: Entry, fut) -> None:
        if fut.done():
            self._counters_add_locked(e, "prefetch_hits", 1)
        else:
            start = time.perf_counter()
            with profiled("ssdtrain.stall.read"):
                fut.exception()  # waits
            waited = time.perf_counter() - start
            with self._lock:
                self._note_read_stall(waited)
                self._counters.add(e.scope.stats_id, "prefetch_misses", 1)
                self._counters.add(e.scope.stats_id, "read_stall_seconds", waited)
                self._counters.add(e.scope.stats_id, "stall_seconds", waited)
        err = fut.exception()
        if err is not None:
            with self._lock:
                self._counters.add(e.scope.stats_id, "failed_reads", 1)
                if e.read_future is fut:
                    e.read_future = e.read_buf = None
                    self._counters.resident(-e.nbytes)
            raise StorageError(getattr(err, "errno", None) or 5,
                               f"ssdtrain could not read a saved activation back ({err}); "
                               "the backward pass cannot continue with missing data") from err
        self._counters_add_locked(e, "read_bytes", e.nbytes)

    def _counters_add_locked(self, e: Entry, field: str, amount: float) -> None:
        with self._lock:
            self._counters.add(e.scope.stats_id, field, amount)

    def _make_endurance(self):
        if self.backend not in ("posix", "kvikio"):
            return None
        try:
            from ssdtrain.endurance import EnduranceMonitor
        except ImportError:
            return None
        return EnduranceMonitor(list(self.config.paths), self.config.rated_tbw, self.config.endurance_horizon_days)


class _LayerTracker:
    """Forward hooks on the blocks: which block is running (a stack, for nested calls)."""

    def __init__(self, stack: list[int]) -> None:
        self.stack = stack

    def enter(self, index: int, module: nn.Module, args: Any) -> None:
        self.stack.append(index)

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack:
            self.stack.pop()


def _shutdown(backend: Backend, handles: list) -> None:
    for h in handles:
        h.remove()
    handles.clear()
    backend.close()


def offload(model: nn.Module | None = None, **overrides: Any) -> Offloader:
    """Shorthand for ``Offloader(model, **overrides)``."""
    return Offloader(model, **overrides)


@contextlib.contextmanager
def no_offload() -> Iterator[None]:
    """Tensors saved inside stay in memory, even within an offloading region."""
    # Innermost saved-tensor hooks win: identity hooks shadow any offloader's.
    with torch.autograd.graph.saved_tensors_hooks(_as_is, _identity):
        yield


def _as_is(t: torch.Tensor) -> torch.Tensor:
    """What a pack hook returns to keep a tensor in memory.

    Not the output tensor itself: the graph would then hold its own output (a reference cycle
    through C++), and frameworks that later swap that output's ``.data`` to free it (Megatron's
    ``deallocate_output_tensor``) would swap the saved bytes too. A detached alias shares the
    storage and the version counter, and neither problem.
    """
    return t if t.is_leaf else t.detach()


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t
