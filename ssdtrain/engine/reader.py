"""Reads back: issuing them ahead of need, and waiting for one that backward needs now."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from ssdtrain.device import copies
from ssdtrain.device import cuda as device
from ssdtrain.engine.cache import Cache, Entry, Ref, State, rebuild
from ssdtrain.engine.group import Bufs
from ssdtrain.engine.group import requests as group_requests
from ssdtrain.engine.schedule import ReadWindow, Scope, WriteBudget
from ssdtrain.store import Backend, StorageError, on_drive
from ssdtrain.store._mem import profiled

__all__ = ["Reader"]

READ_BATCH_SHARE = 0.25
"""Of the read-ahead window, what must be free before a backend that takes reads in batches is
given more (Note [tier reads are issued a batch at a time])."""


class Reader:
    """Reads of offloaded entries into fresh buffers; the engine calls :meth:`prefetch`,
    :meth:`issue` and :meth:`claim` under its lock, :meth:`finish` and :meth:`wait` without it."""

    def __init__(self, backend: Backend, cache: Cache, lock: threading.Lock, window: ReadWindow, budget: WriteBudget,
                 *, max_layers: int | None, clock=time.perf_counter) -> None:
        self._backend = backend
        self._cache = cache
        self._counters = cache.counters
        self._lock = lock
        self._window = window
        self._budget = budget
        self._max_layers = max_layers
        self._clock = clock
        self._many = getattr(backend, "submit_reads", None)  # Note [tier reads are issued a batch at a time]
        self._ordered = copies.OrderOnce()  # the consumer's stream after a tier copy back

    def prefetch(self, scope: Scope, layer: int | None) -> None:
        """Reads the entries ``scope`` will need next, as far as the window allows."""
        if layer is not None:
            scope.layer_now = layer
        ahead, cursor = scope.ahead, scope.cursor
        limit = self._window.limit(self._counters.total.resident_bytes, ahead)
        strict = self._window.peak is not None  # Note [reads never raise the peak]
        nxt = scope.order[cursor] if cursor >= 0 else None
        if nxt is not None and ahead and getattr(nxt.extent, "path_index", 0) < 0:  # not on a drive
            if self._many is not None and limit - ahead < limit * READ_BATCH_SHARE:
                return  # Note [tier reads are issued a batch at a time]: too little room for a batch yet
        # Scope.advance's first question, asked here: it would pick nothing (and change nothing)
        if ahead >= limit or (nxt is None and not scope.resume):
            return
        if nxt is not None and (ahead or strict) and ahead + nxt.nbytes > limit and nxt.state is State.ON_DISK:
            return
        picked = scope.advance(layer, max_bytes=limit, max_layers=self._max_layers, strict=strict)
        if len(picked) > 1 and self._many is not None:
            self._issue_all(picked)
            return
        for e in picked:
            self.issue(e)

    # Note [tier reads are issued a batch at a time]
    # As with the copies in (Note [tier copies are handed over a batch at a time]), a read handed to
    # the host tier's copy-back thread alone cost the training thread a future, a wake-up of that
    # thread, and on a GPU a fence of its own. In backward the window moves one save at a time (each
    # unpack frees one), so with a backend that takes reads in batches (the tier) it moves only once
    # ``READ_BATCH_SHARE`` of it is free, when nothing is read ahead, or when the next save to read
    # is on a drive (a spill: its read takes long, and the window is sized for it). The reads it
    # picks then go together: buffers allocated first, one consumer fence after all of them (Note
    # [reload waits for the allocation point]: every allocation point is before it), one request
    # for the tier's (the drives' still one by one). A read the window has not reached when
    # backward needs it is issued at once, as ever (``claim``).
    def _issue_all(self, entries: list[Entry]) -> None:
        """Starts reading ``entries`` back into fresh buffers, the tier's together."""
        bufs = [self._buffer(e) for e in entries]
        lasts = [buf[-1] if type(buf) is Bufs else buf for buf in bufs]  # a group's: one a part
        fences: dict = {}
        for last in lasts:
            if last.device not in fences:
                fences[last.device] = device.consumer_fence(last)
        requests, firsts = group_requests([(e, buf, e.checksum, fences[last.device])
                                           for e, buf, last in zip(entries, bufs, lasts)])
        futures = self._many(requests)
        for e, buf, fut in zip(entries, bufs, [futures[i] for i in firsts]):
            self._cache.reading(e, buf, fut)

    # Note [a whole save is read into its own shape]
    # A save is rebuilt on its read's buffer (``views.rebuild``: a tensor made, 3-5 us of the
    # training thread on the CPU, 2026-11-29). Most of the host tier's entries hold one save,
    # contiguous over all of its storage (``Ref.whole``): such an entry's read gets a buffer of that
    # save's own shape and dtype, and unpack hands the buffer itself back. The drives' buffers stay
    # bytes (their reads align and checksum them).
    def _buffer(self, e: Entry) -> torch.Tensor:
        """A fresh buffer for ``e``'s read (Note [a whole save is read into its own shape])."""
        if e.grouped:  # a buffer a part (Note [saves handed over together share an entry])
            alloc = self._backend.alloc_buffer
            return Bufs(alloc(p.nbytes, e.device, extent=p.extent, shape=p.whole[0], dtype=p.whole[1]) if p.whole
                        else alloc(p.nbytes, e.device, extent=p.extent) for p in e.parts)
        weaks = e.ref_weaks
        if self._many is not None and len(weaks) == 1 and not on_drive(e.extent):
            ref = weaks[0]()
            if ref is not None and ref.whole:
                return self._backend.alloc_buffer(e.nbytes, e.device, extent=e.extent, shape=ref.size, dtype=ref.dtype)
        return self._backend.alloc_buffer(e.nbytes, e.device, extent=e.extent)

    def issue(self, e: Entry) -> None:
        """Starts reading ``e`` back into a fresh buffer."""
        buf = self._buffer(e)
        if e.grouped:
            fut = self._many(group_requests([(e, buf, None, device.consumer_fence(buf[-1]))])[0])[0]
        else:
            fut = self._backend.submit_read(e.extent, buf, checksum=e.checksum, ready=device.consumer_fence(buf))
        self._cache.reading(e, buf, fut)

    def claim(self, e: Entry, ref: Ref) -> tuple[Any, torch.Tensor]:
        """Backward needs ``e`` (on storage) now, for ``ref``: ``(None, buffer)`` when it was read
        ahead, else ``(future, buffer)`` of its read, issued here if the window had not reached it."""
        buf = e.loaded if e.loaded is not None else (e.loaded_weak() if e.loaded_weak else None)
        if buf is not None and e.grouped and buf[ref.part.index] is None:  # let go (a new pass): read again
            if buf is e.loaded:
                self._cache.unread_loaded(e)
            buf = None
        if buf is not None:
            self._counters.add(e.scope.stats_id, "prefetch_hits", 1)
            return None, buf
        if e.read_future is None:
            for d in e.scope.missed(e):  # Note [backward that jumps down the pack order]
                self._cache.unread(d)
            self.issue(e)
        return e.read_future, e.read_buf

    def take(self, e: Entry, ref: Ref) -> tuple[torch.Tensor, Any, Any] | None:
        """Under the lock, unpack's common case: ``e`` was read ahead, its buffer is here and, in a
        group, its part's too. What :meth:`claim` (its question and count asked inline: Note
        [unpack's common case without calls], a change there is a change here) and then
        :meth:`finished` would do and answer; None where ``claim`` is needed."""
        buf = e.loaded
        if buf is None:
            return None
        grouped = e.grouped
        if grouped and buf[ref.part.index] is None:
            return None
        stats_id = e.scope.stats_id
        if stats_id is None:  # Counters.add's common case, inline: a step's saves have no scope of their own
            self._counters.total.__dict__["prefetch_hits"] += 1
        else:
            self._counters.add(stats_id, "prefetch_hits", 1)
        return self.finished(e, ref, buf)

    def finish(self, e: Entry, ref: Ref, fut: Any, buf: torch.Tensor) -> torch.Tensor:
        """Lock NOT held: waits for the read :meth:`claim` gave (if any); returns the saved tensor."""
        if fut is not None:
            self.wait(e, fut)
        with self._lock:
            if fut is not None:
                self._cache.read_done(e, fut, buf)
            out, ext, back = self.finished(e, ref, buf)
        self.order_after(ext, back)
        return out

    def landed(self, e: Entry, fut: Any, buf: torch.Tensor) -> None:
        """Under the lock: ``e``'s read ``fut`` (into ``buf``) is done without error, found so at
        unpack: what :meth:`wait` and :meth:`finish` would count and record, without taking the
        lock again (a read ahead of a tier copy is mostly such)."""
        stats_id = e.scope.stats_id
        self._counters.add(stats_id, "prefetch_hits", 1)
        self._counters.add(stats_id, "read_bytes", e.nbytes)
        self._cache.read_done(e, fut, buf)

    def finished(self, e: Entry, ref: Ref, buf: torch.Tensor) -> tuple[torch.Tensor, Any, Any]:
        """Under the lock: ``e``'s read into ``buf`` has landed; the saved tensor, ``e``'s extent,
        and the host tier's copy back (or None) that :meth:`order_after` orders the consumer after."""
        first = ref.gen != e.gen
        if first:
            ref.gen = e.gen
            e.unpacked_refs += 1
        if e.grouped:  # its part's buffer (Note [saves handed over together share an entry])
            p, bufs = ref.part, buf
            buf = bufs[p.index]
            if first:
                p.unpacked += 1
                if p.unpacked >= p.refs:  # Note [a group's buffers go part by part]
                    bufs[p.index] = None
        # Note [a whole save is read into its own shape]: the buffer is the save
        out = buf if ref.whole and buf.dtype is ref.dtype and buf.shape == ref.size else rebuild(buf, ref)
        ext = ref.part.extent
        back = getattr(ext, "back", None)  # the host tier's copy back, queued on a side stream
        if e.unpacked_refs >= e.refs:  # Cache.unload's first question, asked here (it asks the rest)
            self._cache.unload(e)
        return out, ext, back

    def order_after(self, ext: Any, back: Any) -> None:
        """Lock NOT held: the consumer's stream waits for ``ext``'s copy back ``back`` (if any)."""
        if back is not None:
            self._ordered(back, device.current_stream(back.device))
            ext.ordered = back  # this copy back (Note [a pool extent outlives its copy back]): not a later one

    def wait(self, e: Entry, fut: Any) -> None:
        """Waits for ``e``'s read; a wait feeds the window and the write budget.

        Raises:
            StorageError: the read failed (garbage is never returned).
        """
        stats_id = e.scope.stats_id
        if fut.done():
            with self._lock:
                self._counters.add(stats_id, "prefetch_hits", 1)
        else:
            start = self._clock()
            with profiled("ssdtrain.stall.read"):
                fut.exception()  # waits
            waited = self._clock() - start
            with self._lock:
                self._window.stalled(self._clock(), waited)
                if on_drive(e.extent):  # a drive's read (not the host tier's)
                    self._budget.stalled(waited, e.scope.tally)
                for field, amount in (("prefetch_misses", 1), ("read_stall_seconds", waited), ("stall_seconds", waited)):
                    self._counters.add(stats_id, field, amount)
        err = fut.exception()
        with self._lock:
            if err is None:
                self._counters.add(stats_id, "read_bytes", e.nbytes)
                return
            self._counters.add(stats_id, "failed_reads", 1)
            self._cache.read_failed(e, fut)
        raise StorageError(getattr(err, "errno", None) or 5,
                           f"ssdtrain could not read a saved activation back ({err}); "
                           "the backward pass cannot continue with missing data") from err
