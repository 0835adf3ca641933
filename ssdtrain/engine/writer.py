"""The write queue: writes waiting in pack order, the bytes in flight, backpressure, completion.

Pack hands entries to :class:`WriteQueue` (:meth:`~WriteQueue.hold`, :meth:`~WriteQueue.hand_over_group`) and
:meth:`WriteQueue.pump` moves them to the backend, a few at a time: from pack, and again from
each write's completion, so the drive never idles while writes wait (not until the next save,
which may come a long op later). Every count lives under the engine's lock, which the queue
shares (its condition is its own), so that an entry's state and the counts change together.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from functools import partial
from typing import Any

from ssdtrain.device import cuda as device
from ssdtrain.engine.cache import Cache, Entry, State, byte_view
from ssdtrain.engine.failures import WriteFailures
from ssdtrain.engine.group import requests as group_requests
from ssdtrain.store import Backend, on_drive
from ssdtrain.store._mem import profiled

__all__ = ["WriteQueue", "WriteFailures"]

WRITE_AHEAD = 0.02
"""Seconds of the drive's (measured) writing handed to it at once: ``WriteQueue._writing_cap``."""
HAND_OVER_SAVES = 8
"""Saves queued before pack hands them to a backend that takes writes in batches (the host tier), unless
``HAND_OVER_BYTES`` or ``HAND_OVER_SECONDS`` come first (Note [tier copies are handed over a batch at a time])."""
HAND_OVER_BYTES = 256 << 20
"""Bytes queued that are handed over however few the saves: 5 ms of a 54 GB/s copy engine."""
HAND_OVER_SECONDS = 0.001
"""The oldest queued save's age (since its pack) at which the queue is handed over however little waits."""


class WriteQueue:
    """Writes of offloaded entries, oldest first, at most ``max_inflight_bytes`` of them.

    Args:
        backend: where the bytes go.
        cache: the entries' owner (their state changes go through it).
        lock: the engine's lock; every method but :meth:`close` is called with it held, except
            where it says otherwise.
        max_inflight_bytes: bytes queued or being written, at most (``when_full`` decides what
            pack does at that cap; see :meth:`has_room` and :meth:`wait_for_room`).
        max_writing_bytes: bytes handed to the backend at once: enough to keep every I/O thread
            busy, few enough that the rest stays queued, cancellable when backward wants it
            first (adaptive keep), and not in the way of reads.
        verify: checksum each write.
        budget: the :class:`~ssdtrain.engine.schedule.WriteBudget`, told the bytes each step wrote.
        failures: where a failed write's error goes (:class:`WriteFailures`).
        endurance: the :class:`~ssdtrain.store.endurance.EnduranceMonitor` counting bytes per drive, if any.
        meter: the :class:`~ssdtrain.engine.peak.DriveMeter` told when drive writes start and finish
            (the host tier's are not the drive's), with ``clock``'s times.
        gate: ``gate(scope, nbytes, now)``, whether a queued drive write may start now
            (:meth:`ssdtrain.engine.peak.PeakClock.may_start`); one it refuses stays in memory.
        due: ``due(nbytes)``, the forward position at which a host-tier copy handed over now is
            due (:meth:`ssdtrain.host.copy_clock.CopyClock.schedule`; Note [a copy is due from its
            hand-over]); set on its extent as it is handed over.
        wall: the host's clock that ages the saves waiting for a batch (``HAND_OVER_SECONDS``):
            the modelled GPU's on the model (Note [the modelled host's clock decides the hand-over]
            in ``device/cuda.py``).
    """

    def __init__(self, backend: Backend, cache: Cache, lock: threading.Lock, *, max_inflight_bytes: int,
                 max_writing_bytes: int, verify: bool, budget: Any, failures: WriteFailures,
                 endurance: Any = None, meter: Any = None, clock: Any = time.perf_counter,
                 wall: Any = time.perf_counter,
                 gate: Any = None, due: Any = None) -> None:
        self._backend = backend
        self._cache = cache
        # ``with`` takes the lock itself: Condition.__enter__ is Python code, and a
        # KeyboardInterrupt raised as it returns would leave the lock held for good.
        self._lock = lock
        self._cond = threading.Condition(lock)
        self._max_inflight = max_inflight_bytes
        self._max_writing = max_writing_bytes
        self._verify = verify
        self._budget = budget
        self._failures = failures
        self._endurance = endurance
        self._meter = meter
        self._clock = clock
        self.wall = wall  # the hand-over's clock (Note [the modelled host's clock decides the hand-over])
        self._gate = gate
        self._due = due
        self._queue: deque[Entry] = deque()
        self.inflight_bytes = 0  # queued (held too) or being written
        self._flight: dict[int, tuple[Entry, Any]] = {}  # entry id -> (entry, future): being written
        self._writing_bytes = 0
        self._drive_writing = 0  # of which a drive's (the host tier's copies are not capped)
        self._batches: set = set()  # futures of batches out (Note [tier copies are handed over a batch at a time])
        self._many = getattr(backend, "submit_writes", None)  # writes taken in batches (the host tier)
        self.completed: deque[Entry] = deque()  # written; memory released at a safe point

    # -- pack's side (lock held) --------------------------------------------------------------
    def hold(self, scope: Any, e: Entry, op: Any, early: bool = False) -> None:
        """Queues ``e`` (QUEUED), saved by op ``op``, as ``scope``'s last save, and the save held
        before it for real; ``early``: a drive's write known to end before its forward's peak, not
        held (Note [a save well before the peak goes at once] in ``peak.py``).

        Note [the last save waits]: a write starts only once the next save came. The last save
        of a forward is what backward needs first; had its write already started, the bytes
        would go to the drive only to be handed back from memory. When backward begins the
        held write is cancelled like any other queued one (adaptive keep). It is queued after
        all when another forward starts first (pipelines), on ``wait()``, and when pack waits
        for room. A save under a quarter of the held one's size does not release it: it is
        queued itself (the loss's targets after the logits), so the large save that backward
        needs first is not written in vain as forward ends. Whatever is queued goes only once
        the op that saved it has returned (Note [a save is copied only after its op returned]),
        and a drive's write known to end well before its forward's peak is not held (Note [a save
        well before the peak goes at once]).
        """
        self.inflight_bytes += e.nbytes
        if self._many is not None:  # its age makes a batch go (pack_pumps)
            e.packed_at = self.wall()
        self._op_began(scope, op)
        held = scope.held
        if held is not None and (early or 4 * e.nbytes >= held.nbytes):  # not the last save any more
            self._enqueue(scope, held)
            scope.held = held = None
        if early or held is not None:  # it goes at once; or it is under a quarter of the held one
            self._enqueue(scope, e)
        else:
            scope.held = e

    def passed(self, scope: Any, nbytes: int, op: Any) -> bool:
        """A save of ``nbytes`` by op ``op`` came after ``scope``'s held one and is kept: the held
        one is not the last save any more (unless this one is under a quarter of its size, as in
        :meth:`hold`), so it joins the queue. Returns whether it did."""
        self._op_began(scope, op)
        held = scope.held
        if held is None or 4 * nbytes < held.nbytes:
            return False
        self._enqueue(scope, held)
        scope.held = None
        return True

    def release_held(self, scopes: Iterable[Any], op: Any = None) -> None:
        """The held last saves of ``scopes`` join the queue: called between ops (``op`` None: every
        save's op has returned), or by a save of op ``op``, whose own saves stay until it returned."""
        for scope in scopes:
            if op is None:
                scope.op = None  # no op runs: what waits for its op's return may go
                self._op_returned(scope)
            else:
                self._op_began(scope, op)
            if scope.held is not None:
                self._enqueue(scope, scope.held)
                scope.held = None
            self.hand_over_group(scope, op)

    def hand_over_group(self, scope: Any, op: Any) -> None:
        """``scope``'s open group (if any) joins the queue, by a save of op ``op`` (None: between
        ops): Note [saves handed over together share an entry] in ``group.py``."""
        g, scope.group = scope.group, None
        if g is None or g.state is not State.KEPT:  # none, or freed meanwhile
            return
        if g.extent.region is not None:  # Note [a group's parts are carved from one region]
            self._backend.fit_region(g.extent)
        self._cache.queue(g, g.extent)  # its parts' host extents, reserved as they joined
        self.inflight_bytes += g.nbytes
        g.packed_at = self.wall()
        self._op_began(scope, op)  # None: between ops, every op returned
        self._enqueue(scope, g)

    # Note [bytes an earlier op made may go at once]
    # The op-return rule below guards the bytes an op writes after it saved them without a version
    # bump: buffers such as ``rrelu``'s ``noise``, which carry no autograd history. A tensor with a
    # ``grad_fn`` was made by an op that returned (or is an output of the running op, which saves
    # its outputs after its kernels were queued); an op that wrote it after saving it would give
    # wrong gradients without offloading too. So such a save has no op to wait for (``Entry.op``
    # None) and is queued with its producer fence as soon as it is let go. The case that needs it:
    # a checkpoint's saved inputs (``torch.utils.checkpoint``'s, made after the block's ops by a
    # Function that takes no sequence number of its own), whose op the engine could otherwise see
    # return only at the next block's save.
    # Note [a save is copied only after its op returned]
    # Autograd hands a save to pack when the op saves it, which for an op's inputs is before the
    # op's kernel runs; and an op may write a tensor it saved without bumping its version, so that
    # no version check sees it: ``rrelu_with_noise`` saves ``noise`` and then fills it (torch 2.13:
    # a hook that copied at pack read uninitialised memory, 1048576 of 1048576 gradient elements
    # wrong; ours, whose write started at the op's next save, up to all of them). So no save's
    # bytes are copied before the op that saved it returned. The engine sees that return as a
    # save of another op: every op that saves creates its autograd node first, and each node
    # takes the thread's next sequence number (``torch.autograd._get_sequence_nr``), so saves of
    # one op see one number and a save that sees another comes from a later op, begun after the
    # earlier one returned. A save queued while its op may still run waits in ``scope.fresh``;
    # the next op's save, ``wait()``, the end of forward or a new forward queue it. On a GPU the
    # producer fence is recorded then (``_queue_now``), on the stream that was current at pack:
    # after every kernel the op queued, not just those before the save.
    def _op_began(self, scope: Any, op: Any) -> None:
        if op != scope.op:
            scope.op = op
            if scope.fresh:
                self._op_returned(scope)

    def _op_returned(self, scope: Any) -> None:
        fresh, scope.fresh = scope.fresh, []
        fence = None
        for e in fresh:
            fence = self._queue_now(e, fence)

    def _enqueue(self, scope: Any, e: Entry) -> None:
        if e.op == scope.op and e.op is not None:
            scope.fresh.append(e)  # its op may still be running
        else:
            self._queue_now(e, None)

    def _queue_now(self, e: Entry, fence: Any) -> Any:
        """``e`` joins the write queue, with its producer fence (shared with ``fence``, the last
        one made, where its stream is the same); returns the fence."""
        if e.stream is not None and e.state is State.QUEUED:
            if fence is None or fence.stream is not e.stream:
                fence = device.fence_on(e.stream)
            e.fence = fence
        self._queue.append(e)
        return fence

    def has_room(self, nbytes: int) -> bool:
        return not self.inflight_bytes or self.inflight_bytes + nbytes <= self._max_inflight

    def wait_for_room(self, nbytes: int, scopes: Iterable[Any], op: Any) -> float:
        """Note [bounded memory in flight]: blocks (lock released) until ``nbytes`` more fit (a
        save of op ``op``; that op's own saves cannot go yet and are not waited for); returns the
        seconds it waited."""
        start = time.perf_counter()
        with profiled("ssdtrain.stall.backpressure"):
            self.release_held(scopes, op)  # they count as in flight: let them go
            while not self.has_room(nbytes):
                if not self.writing:  # nothing in flight to wait for: start queued writes
                    if not self._queue:  # what counts is held by the op still running: it stays
                        break
                    self._lock.release()
                    try:
                        self.pump()
                    finally:
                        self._lock.acquire()
                    continue
                self._cond.wait(1.0)
        return time.perf_counter() - start

    def cancel(self, e: Entry) -> None:
        """A queued write is not needed (backward wants the tensor first): the entry is kept."""
        self._cache.cancel(e)
        self.inflight_bytes -= e.nbytes
        self._cond.notify_all()

    def forget(self, e: Entry) -> None:
        """A queued entry died before its write started."""
        self.inflight_bytes -= e.nbytes
        self._cond.notify_all()

    def idle(self) -> bool:
        return not self.writing and not any(e.state is State.QUEUED for e in self._queue)

    def settle(self) -> None:
        """Lock held: waits until no write is queued or in flight and every extent of a late
        read is given back (healing what an interrupt cut short on the way)."""
        while not self.idle() or self._cache.late:
            self._cache.free_late()
            self._cond.wait(0.01)
            self._lock.release()
            try:
                self.heal()
            finally:
                self._lock.acquire()

    # -- submission (lock NOT held) -------------------------------------------------------
    def pump(self) -> None:
        """Starts queued writes, oldest first, a drive's up to ``max_writing_bytes`` in flight."""
        batch: list = []
        submitting = None
        try:
            with self._lock:
                cap = self._writing_cap()
                while self._queue:
                    # Note [an interrupt never unbalances a count]: in this order, whatever step
                    # an interrupt stops at, _interrupted finds ``e`` and undoes it.
                    e = self._queue[0]
                    drive = e.state is State.QUEUED and getattr(e.extent, "path_index", 0) >= 0  # on_drive
                    if drive and self._drive_writing >= cap:
                        break
                    if drive and self._late(e):
                        pass  # Note [write what leaves before the peak]: kept (by _late)
                    elif e.state is State.QUEUED:
                        if not drive and self._due is not None:  # Note [a copy is due from its hand-over]
                            e.extent.due = self._due(e.nbytes)
                        # Note [an entry's bytes are its storage's]: the tier reads a span by address
                        batch.append((e, byte_view(e.data, e.lo, e.nbytes, e.device) if drive else e.span()))
                        e.state = State.WRITING
                        self._flight[e.id] = (e, None)
                        self._writing_bytes += e.nbytes
                        if drive:
                            self._drive_writing += e.nbytes
                            if self._meter is not None:
                                self._meter.started(e.nbytes, self._clock())
                    self._queue.popleft()
            many = self._many
            if many is not None and batch:  # Note [tier copies are handed over a batch at a time]
                submitting = batch
                try:
                    requests, firsts = group_requests([(e, src, self._verify, e.fence) for e, src in batch])
                    futures, shared = many(requests)
                    futures = [futures[i] for i in firsts]
                except Exception as err:  # the pool is gone (closing) or the backend refused
                    submitting = None
                    for e, _ in batch:
                        self._finish(e, None, err)
                    return
                together = []
                with self._lock:
                    for (e, _), fut in zip(batch, futures):
                        self._flight[e.id] = (e, fut)
                        if fut is shared:
                            together.append(e)
                    if shared is not None:
                        self._batches.add(shared)
                    submitting = None
                for (e, _), fut in zip(batch, futures):
                    if fut is not shared:
                        fut.add_done_callback(partial(self._finish, e))
                if shared is not None:
                    shared.add_done_callback(partial(self._finish_all, together))
                return
            for e, src in batch:
                submitting = [(e, src)]
                try:
                    fut = self._backend.submit_write(e.extent, src, checksum=self._verify, ready=e.fence)
                except Exception as err:  # the pool is gone (closing) or the backend refused
                    submitting = None
                    self._finish(e, None, err)
                    continue
                self._flight[e.id] = (e, fut)
                submitting = None
                fut.add_done_callback(partial(self._finish, e))
        except BaseException:
            self._interrupted([e for e, _ in batch], [e for e, _ in submitting or ()])
            raise

    def _late(self, e: Entry) -> bool:
        """Lock held: whether ``e``'s write to a drive, about to start, would end after its
        forward's peak; if so it is not started, and ``e`` stays in memory."""
        if self._gate is None or self._gate(e.scope, e.nbytes, self._clock()):
            return False
        self.cancel(e)
        for field in ("kept_bytes", "peak_kept_bytes"):
            self._cache.counters.add(e.scope.stats_id, field, e.nbytes)
        return True

    def _writing_cap(self) -> int:
        """Note [write what leaves before the peak]: bytes handed to the drive at once. A slow
        drive gets what it writes in ``WRITE_AHEAD`` seconds (one entry at least): entries
        written side by side share it, and all of them finish late."""
        rate = self._meter.rate if self._meter is not None else None
        if not rate:
            return self._max_writing
        return min(self._max_writing, max(1 << 20, int(rate * WRITE_AHEAD)))

    @property
    def queued_bytes(self) -> int:
        """Bytes queued (or held) and not handed to the backend yet."""
        return self.inflight_bytes - self._writing_bytes

    @property
    def pack_pumps(self) -> bool:
        """Whether pack should pump (read without the lock: a hint): writes wait in the queue; and
        for a backend that takes writes in batches (the host tier), no batch is out (its completion
        pumps) and enough waits to make one (Note [tier copies are handed over a batch at a time])."""
        try:
            head = self._queue[0]
        except IndexError:  # empty (or emptied meanwhile by a completion's pump)
            return False
        if self._many is None or getattr(head.extent, "path_index", 0) >= 0:  # on_drive, inline
            return True  # a drive's write first: at once, as ever
        return not self._batches and (head.grouped or len(self._queue) >= HAND_OVER_SAVES
                                      or self.queued_bytes >= HAND_OVER_BYTES
                                      or self.wall() - head.packed_at >= HAND_OVER_SECONDS)

    # The queue of a batched backend is emptied by pack once a batch's worth waits; by every
    # other pump (wait(), backpressure, a drive write's completion) whatever waits.

    @property
    def writing(self) -> int:
        return len(self._flight)

    def _interrupted(self, batch: list[Entry], submitting: list[Entry]) -> None:
        """Note [an interrupt never unbalances a count]: a KeyboardInterrupt came while these
        writes were being handed over. A write with its future recorded is settled as usual (or
        by :meth:`heal`, if its callback was not registered); those being handed over may have
        reached the backend unseen: their extents are never reused (a late write would land on
        the next owner's bytes) and their entries are kept in memory; the others go back to the
        queue."""
        with self._lock:
            for e in reversed(batch):
                held = self._flight.get(e.id)
                if held is not None and held[1] is not None:
                    continue  # handed over and recorded: it finishes as usual
                self._flight.pop(e.id, None)
                if any(e is s for s in submitting):
                    self.inflight_bytes -= e.nbytes
                    self._cache.lose_extent(e)
                    continue
                e.state = State.QUEUED
                if not (self._queue and self._queue[0] is e):  # not popped yet: still queued
                    self._queue.appendleft(e)
            self._recount_writing()
            self._cond.notify_all()

    def _finish(self, e: Entry, fut, err: BaseException | None = None) -> None:
        """When a write finished (on an I/O thread, or inline where it was already done).
        Idempotent: :meth:`heal` may call it again for a write whose callback was cut short."""
        if fut is not None:
            err = fut.exception()
        with self._lock:
            self._settle(e, fut, err)
            self._cond.notify_all()
        self.pump()

    def _finish_all(self, entries: list[Entry], fut) -> None:
        """:meth:`_finish` of writes handed over together under one future (Note [tier copies are
        handed over a batch at a time]): one lock, one wake-up, one pump."""
        err = fut.exception()
        with self._lock:
            for e in entries:
                self._settle(e, fut, err)
            self._batches.discard(fut)
            self._cond.notify_all()
        if self.pack_pumps:  # a batch's worth waits (else pack hands it over when there is)
            self.pump()

    def _settle(self, e: Entry, fut, err: BaseException | None) -> None:
        """Lock held: the bookkeeping of ``e``'s finished write (nothing if it was settled)."""
        if e.id not in self._flight:
            return
        # Read first: the extent may go below (written() frees a dead entry's).
        path = getattr(e.extent, "path_index", 0)
        drive = path >= 0  # a drive's (the host tier's extents have none)
        # The entry's state first, the flight record last: an interrupt in between (this runs
        # inline on the main thread for a write done before its callback was added) leaves
        # the record, and heal() finishes it again, idempotently: the entry has left WRITING
        # (or, dead, its extent is gone), so nothing is counted twice.
        unsettled = e.state is State.WRITING or (e.state is State.FREED and e.extent is not None)
        if unsettled and err is None:
            if self._cache.written(e, fut.result()):
                self.completed.append(e)
            if drive:
                self._budget.written(e.nbytes, e.scope.tally)
                if self._endurance is not None:
                    self._endurance.record(path, e.nbytes)
        elif unsettled and self._cache.write_failed(e):
            self._failures.failed(err)
        if self._flight.pop(e.id, None) is not None:
            self._writing_bytes -= e.nbytes
            self.inflight_bytes -= e.nbytes
            if drive:
                self._drive_writing -= e.nbytes
                if self._meter is not None:
                    self._meter.finished(e.nbytes if err is None else 0, self._clock())

    def _recount_writing(self) -> None:
        """Lock held: the bytes being written, derived from the flight records again."""
        self._writing_bytes = sum(e.nbytes for e, _ in self._flight.values())
        self._drive_writing = sum(e.nbytes for e, _ in self._flight.values()
                                  if on_drive(e.extent))

    def heal(self) -> None:
        """Lock NOT held. Finishes writes that are done but were never settled (a callback that
        ran inline on the main thread and was interrupted), and derives the bytes in flight from
        the entries' states again (Note [an interrupt never unbalances a count])."""
        for e, fut in list(self._flight.values()):
            if fut is not None and fut.done():
                self._finish(e, fut)
        with self._lock:
            self.inflight_bytes = sum(e.nbytes for e in self._cache.entries.values()
                                      if e.state in (State.QUEUED, State.WRITING))
            self._recount_writing()
            self._batches = {fut for _, fut in self._flight.values() if fut is not None and fut in self._batches}
            if self._meter is not None:
                self._meter.recount(sum(on_drive(e.extent) for e, _ in self._flight.values()),
                                    self._clock())

    # -- shutdown (lock NOT held) ------------------------------------------------------------
    def close(self) -> None:
        """Cancels what has not started and waits for what has."""
        with self._lock:
            for e in self._queue:
                if e.state is State.QUEUED:
                    self.cancel(e)
            self._queue.clear()
            while self._flight:
                self._cond.wait(0.1)
                self._lock.release()
                try:
                    self.heal()
                finally:
                    self._lock.acquire()
