"""Reads back: issuing them ahead of need, and waiting for one that backward needs now."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from ssdtrain import device, host_copies
from ssdtrain.cache import Cache, Entry, Ref, rebuild
from ssdtrain.schedule import ReadWindow, Scope, WriteBudget
from ssdtrain.store import Backend, StorageError
from ssdtrain.store._mem import profiled

__all__ = ["Reader"]


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

    def prefetch(self, scope: Scope, layer: int | None) -> None:
        """Reads the entries ``scope`` will need next, as far as the window allows."""
        if layer is not None:
            scope.layer_now = layer
        limit = self._window.limit(self._counters.total.resident_bytes, scope.ahead)
        strict = self._window.peak is not None  # Note [reads never raise the peak]
        for e in scope.advance(layer, max_bytes=limit, max_layers=self._max_layers, strict=strict):
            self.issue(e)

    def issue(self, e: Entry) -> None:
        """Starts reading ``e`` back into a fresh buffer."""
        buf = self._backend.alloc_buffer(e.nbytes, e.device, extent=e.extent)
        fut = self._backend.submit_read(e.extent, buf, checksum=e.checksum, ready=device.consumer_fence(buf))
        self._cache.reading(e, buf, fut)

    def claim(self, e: Entry) -> tuple[Any, torch.Tensor]:
        """Backward needs ``e`` (on storage) now: ``(None, buffer)`` when it was read ahead, else
        ``(future, buffer)`` of its read, issued here if the window had not reached it."""
        buf = e.loaded if e.loaded is not None else (e.loaded_weak() if e.loaded_weak else None)
        if buf is not None:
            self._counters.add(e.scope.stats_id, "prefetch_hits", 1)
            return None, buf
        if e.read_future is None:
            self.issue(e)
        return e.read_future, e.read_buf

    def finish(self, e: Entry, ref: Ref, fut: Any, buf: torch.Tensor) -> torch.Tensor:
        """Lock NOT held: waits for the read :meth:`claim` gave (if any); returns the saved tensor."""
        if fut is not None:
            self.wait(e, fut)
        with self._lock:
            if fut is not None:
                self._cache.read_done(e, fut, buf)
            if ref.gen != e.gen:
                ref.gen = e.gen
                e.unpacked_refs += 1
            out = rebuild(buf, ref)
            back = getattr(e.extent, "back", None)  # the host tier's copy back, queued on a side stream
            self._cache.unload(e)
        if back is not None:
            host_copies.order_current(back)
        return out

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
                if getattr(e.extent, "path_index", 0) >= 0:  # a drive's read (not the host tier's)
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
