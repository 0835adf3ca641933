"""The :class:`Offloader`: saved-tensor hooks that send activations to storage and bring them back.

This file holds its public surface (the context manager, micro-batch scopes, ``wait``, ``stats``,
``close``), the wiring of its parts, when forwards begin and end, and its side of the host tier;
what the hooks do with each save, pack, unpack and the safe points, is its base class
:class:`~ssdtrain.engine.hooks.SaveHooks` (``hooks.py``). One lock guards shared state.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import warnings
import weakref
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

import torch
from torch import nn

from ssdtrain.device import copies, measure
from ssdtrain.device import cuda as device
from ssdtrain.engine import hooks, keep, sac_probe
from ssdtrain.engine.cache import Cache, Entry
from ssdtrain.engine.group import GROUP_SAVES
from ssdtrain.engine.ref import Graveyard
from ssdtrain.config import OffloadConfig
from ssdtrain.store.endurance import EnduranceMonitor
from ssdtrain.engine.peak import DriveMeter, PeakClock
from ssdtrain.engine.schedule import DriveAdvice, KeepPolicy, ReadWindow, Scope, Scopes, WriteBudget, find_blocks
from ssdtrain.engine.stats import Counters, OffloadStats
from ssdtrain.store import Backend, make_backend
from ssdtrain.engine.reader import Reader
from ssdtrain.host.host_pool import GroupExtent, HostExtent
from ssdtrain.host.tier import TieredBackend
from ssdtrain.engine.failures import WriteFailures
from ssdtrain.engine.writer import WriteQueue

__all__ = ["Offloader"]

_TIER_DEVICES = ("cuda",)  # device types whose saves use the host tier (tests add "cpu")

# Note [an offloader made under the modelled GPU]
# Inside ``ssdtrain.device.model.modelled(gpu)`` the model's device tensors are CPU tensors that
# the seam calls CUDA (Note [the seam answers for the modelled GPU] in ``device/cuda.py``). Pack
# asks ``t.is_cuda or self._tier_cpu`` for every save, and must not pay a call into the seam for
# it (Note [pack's common case in one function] in ``hooks.py``): so an Offloader made under the model has
# ``_tier_cpu`` set, as the tests' way through the tier has, and its saves use the host tier; the
# seam then tells the model's device tensors (copied by the model) from host ones (memmove). Make
# the Offloader inside the block and use it there.


class Offloader(hooks.SaveHooks):
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
        # CPU saves use the tier too: the tests' way through it, and the modelled GPU's, whose device
        # tensors are CPU tensors (Note [an offloader made under the modelled GPU]).
        modelled = device.modelled_gpu() is not None
        self._tier_cpu = "cpu" in _TIER_DEVICES or modelled
        # A CUDA build of torch: a build flag, no driver call (a CPU step must not touch CUDA,
        # tests/test_import.py); the tier starts only at the first CUDA save.
        if config.host_bytes != 0 and (torch.backends.cuda.is_built() or "cpu" in _TIER_DEVICES or modelled):
            self._backend = self._tier = TieredBackend(self._backend, config.host_bytes)
        self._fwd_timer: measure.GpuTimer | None = None
        self._ordered = copies.OrderOnce()  # the compute stream after a released save's copy (_copy_due)
        self._fwd_dev: torch.device | None = None
        self._seen_peak = 0  # the allocator's peak seen in the last backward (Note [the step's peak, seen in backward])
        self._start_alloc: int | None = None  # bytes allocated as the last forward began (the same Note)
        self._unpacks = 0
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._counters = Counters()
        self._cache = Cache(self._counters, self._backend.free)
        self._entries = self._cache.entries
        self._small_bytes = config.min_bytes  # smaller storages: Note [a small save skips the cache]
        # Note [saves handed over together share an entry] (1: an entry a save)
        self._group_saves = GROUP_SAVES
        self._carve = True  # False: a part an extent of its own (Note [a group's parts are carved from one region])
        self._endurance = None
        if self.backend in ("posix", "kvikio"):
            self._endurance = EnduranceMonitor(list(config.paths), config.rated_tbw, config.endurance_horizon_days)
        self._failures = WriteFailures(config.on_error)
        self._budget = WriteBudget(hooks._now(), 1 << 20)
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
                                  clock=_clock, gate=self._peak.may_start,
                                  due=self._tier.clock.schedule if self._tier is not None else None,
                                  wall=device.host_clock())
        self._graveyard = Graveyard()
        self._window = ReadWindow(max(2 * config.chunk_bytes, 16 << 20), config.prefetch_bytes, hooks._now())
        self._reader = Reader(self._backend, self._cache, self._lock, self._window, self._budget,
                              max_layers=config.prefetch_layers, clock=_clock)
        self._ids = itertools.count()
        self._scopes = Scopes(on_forget=partial(_learn, self._budget))
        self._layer_stack: list[int] = []
        self._keep_depth = [0]
        self._sac_told = False  # Note [SAC without the switch is told]
        self._sac_probe = partial(sac_probe.warn_unswitched, self) if sac_probe.has_switch() else None
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
        says so); those still in memory can. Hooks are per thread: close() pops those of this
        thread's ``with off:`` left open (an interrupt as its ``__exit__`` began), again when
        another thread closed it first.
        """
        if self._closed:
            # A close on another thread could not pop this thread's hooks (they are per thread):
            # a step whose __exit__ was cut short left them; close() on this thread pops them.
            self._leave_stale_steps()
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
            self._pinned = keep.model_storage_keys(self._models)  # Note [a model's storages are found in one walk]
        self._layer_stack.clear()
        self._keep_depth[0] = 0
        with self._lock:
            self._open_scope(scope)
        pack, unpack = keep.untraced(self._pack), keep.untraced(self._unpack)
        gpu = device.modelled_gpu()
        if gpu is not None:  # Note [the modelled host pays for each hook]
            pack, unpack = gpu.charged(pack, gpu.rates.pack_s), gpu.charged(unpack, gpu.rates.unpack_s)
        keep.enter_hooks(keep.pack_hook(pack, self, self._sac_probe), unpack, self._scopes.active, scope)

    def _open_scope(self, scope: Scope) -> None:
        """Under the lock: a forward begins. Another forward comes before their backward: the
        waiting last saves of the scopes still in forward are written after all (Note [the last
        save waits])."""
        self._writer.release_held(self._scopes.in_forward())
        self._scopes.by_id[scope.id] = scope
        now = hooks._now()
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
            if scope.group is not None and len(scope.group.parts) > 1:  # its copies go as forward ends
                self._writer.hand_over_group(scope, None)
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
            if self._scopes.opened_by(self):
                raise RuntimeError(
                    "this Offloader is closed, but a `with off:` block of it is still open on this thread (its "
                    "__exit__ never ran, e.g. a Ctrl-C as it began) and its hooks still take every save; call "
                    "off.close() on this thread, which pops them")
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

    # -- the host tier ------------------------------------------------------------------------------
    def _copy_due(self, e: Entry) -> bool:
        """Under the lock: whether ``e``'s device memory may go now (Note [a tier copy is released
        in stream order], Note [copy what leaves before the peak]); if so, the compute stream is
        made to wait for its copy first."""
        ext = e.extent
        if not self._copy_may_go(ext):
            return False
        landed = getattr(ext, "landed", None)  # None: on a drive (its write is done), or copied with no device
        if landed is not None:
            # The producer's stream used the save (it is the allocation stream, or the user tied the
            # tensor to it with record_stream): work it queues from now on runs after the copy.
            self._ordered(landed, e.fence.stream if e.fence is not None else device.current_stream(e.device))
        return True

    def _copy_may_go(self, ext: Any) -> bool:
        """Whether the save written to ``ext`` may leave memory now: on a drive, copied with no
        device, due by the copy clock, or its copy's fence passed (asked on the training thread:
        Note [a lagging copy is looked at without the lock])."""
        if type(ext) is GroupExtent:  # as its last copy (Note [saves handed over together share an entry])
            ext = ext.last
        if type(ext) is not HostExtent or ext.landed is None:
            return True
        return self._tier.clock.is_due(ext.due) or ext.landed.passed()

    def _tier_forward_begins(self) -> None:
        """Under the lock: the copy clock learns from the last forward's device time, and starts
        over; this forward's start is marked on the device."""
        clock = self._tier.clock
        timer, self._fwd_timer = self._fwd_timer, None
        if timer is not None:
            clock.learn(timer.seconds(), clock.pos, timer.host_seconds())
        room = True
        if clock.wants_reference() and self._fwd_dev is not None:  # Note [the reference forward needs room]
            need = REFERENCE_ROOM * clock.sent + REFERENCE_SLACK
            room = not clock.sent or measure.room_above_peak(self._fwd_dev, self._seen_peak,
                                                                 self._start_alloc) >= need
            if not room and not clock.deferred:
                warnings.warn(
                    f"ssdtrain: the host tier took {clock.sent / 2**30:.2f} GiB off the last step's "
                    f"peak, and {'the modelled GPU' if device.modelled_gpu() is not None else self._fwd_dev} has no "
                    "room to measure a forward without it; the tier copies every "
                    "save it can until it has (a slower step than a learned copy budget, not out of memory)",
                    RuntimeWarning, stacklevel=4)
        clock.begin(room)
        self._seen_peak = self._unpacks = 0
        if self._fwd_dev is not None and clock.reference is None:
            self._start_alloc = measure.allocated(self._fwd_dev)
        if self._fwd_dev is not None:
            self._fwd_timer = measure.GpuTimer(self._fwd_dev)

    def _see_peak(self) -> None:
        """At an unpack, until the tier has measured a forward copying nothing: remembers the
        allocator's peak (Note [the step's peak, seen in backward]), at the first unpack of a
        backward and every ``PEAK_EVERY``-th after (the peak is a high-water mark: a later look
        sees an earlier peak; each look costs the allocator's whole statistics). Called by unpack
        only while there is one to watch: a CUDA save seen, the tier's reference not learned."""
        if self._unpacks % PEAK_EVERY == 0:
            self._seen_peak = max(self._seen_peak, measure.allocator_peak(self._fwd_dev))
        self._unpacks += 1

    # Note [the step's peak, seen in backward]: whether a forward copying nothing fits is judged
    # from the last step's peak, read from the allocator's high-water mark. Read only when the
    # next forward begins, it is what the user left it: a loop that resets the peak each step
    # (``torch.cuda.reset_peak_memory_stats()``, common for logging, and what the max-seq probe
    # does) leaves the model's bytes alone, the room looks ample, and that forward runs out of
    # memory (H200, 2026-11-27: recompute+offload at 40960 tokens under a 6 GiB cap, out of memory
    # in the step whose peak the probe had just reset, where recompute alone trains). So the peak
    # is also read in backward, at unpacks, where the step's peak has just been reached. And the
    # peak counts as its growth above the last forward's start, on top of what is allocated now:
    # the first step's backward ran before the optimizer had state (1.5 GiB there, made by its
    # first ``step()``), so that peak with what the tier took off fitted, and the next step's
    # forward copying nothing, with the state, did not (the same probe, once the peak was seen).


PEAK_EVERY = 8
REFERENCE_ROOM = 1.25
REFERENCE_SLACK = 256 << 20
"""The room above the last peak that a forward measured with no copy needs (Note [the reference
forward needs room]): ``REFERENCE_ROOM`` times what left the device in the last forward, plus
``REFERENCE_SLACK`` bytes; both margins are for a fragmented allocator."""


def _clock() -> float:
    return hooks._now()  # the seam, looked up at each call


def _learn(budget: WriteBudget, scope: Scope) -> None:
    """A scope is forgotten: its backward is over; the write budget learns from its forward."""
    if scope.tally is not None:
        budget.finish(scope.tally, hooks._now())


def _shutdown(writer: WriteQueue, backend: Backend, handles: list) -> None:
    for h in handles:
        h.remove()
    handles.clear()
    writer.close()
    backend.close()
