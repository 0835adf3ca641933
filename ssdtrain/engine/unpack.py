"""Unpack: what the saved-tensor hooks hand back to backward for each save (the half of
:class:`~ssdtrain.engine.hooks.SaveHooks` that runs in backward, on the training thread): what is
still in memory at once, else the read that the read-ahead window issued, waited for."""

from __future__ import annotations

import copy
from typing import Any

import torch

from ssdtrain.device import cuda as device
from ssdtrain.engine.cache import Small, State, rebuild_on
from ssdtrain.engine.parts import Parts
from ssdtrain.engine.ref import GRAVEYARD_BATCH, Ref
from ssdtrain.store._mem import profiled

__all__ = ["UnpackHooks"]

_profiler = torch.autograd.profiler


class UnpackHooks:
    """Unpack of an :class:`~ssdtrain.engine.offloader.Offloader` (a base of ``SaveHooks``): it uses
    the state the Offloader made and the safe points of ``hooks.py``."""

    def _unpack(self, ref: Any) -> torch.Tensor:
        kind = type(ref)
        if kind is Small:
            if self._reads_pending and (self._cache.small.dead or self._graveyard):
                self._read_on()
            return ref.unpack()
        if kind is not Ref:
            if kind is Parts:
                return ref.rebuild(self._unpack)
            return ref  # a tensor kept as it is (keep.alias)
        cache, dead = self._cache, self._graveyard  # Note [deaths that hold no memory wait] in ``ref.py``
        if ((dead.urgent or len(dead) >= GRAVEYARD_BATCH) or self._writer.completed or cache.late or cache.small.dead
                or cache.lagging or self._failures.pending):
            self._safe_point(raise_errors=False)  # its conditions, asked here without its call
        if self._tier is not None and self._fwd_dev is not None and self._tier.clock.reference is None:
            self._see_peak()  # its question asked here (Note [unpack's common case without calls])
        if _profiler._is_profiler_enabled:  # Note [pack's common case in one function]
            with profiled("ssdtrain.unpack"):
                return self._unpack_entry(ref)
        return self._unpack_entry(ref)

    # Note [unpack's common case without calls]
    # As pack (Note [pack's common case in one function] in ``hooks.py``), unpack runs once a save
    # on the training thread, and its Ref's common case (a part read back and landed, or still in
    # memory) made some 40 calls: here ``_see_peak``'s question is asked (only here), and the
    # first ones of ``check_version`` and ``Scope.used`` inline (a change to them is a change
    # here): those functions are called only where they have work to do. Since 2026-11-30 also
    # ``order_after``'s (a save with no copy back needs nothing); ``Reader.take`` asks ``claim``'s
    # question and makes its count for a save read ahead (then ``finished``, which asks
    # ``Cache.unload``'s); ``Reader.prefetch`` asks ``Scope.advance``'s first question (most
    # unpacks move no read: the window frees a group's room every eight saves or so); and
    # ``ReadWindow.limit`` and ``for_consumer`` answer without calls of their own: about 24 calls an
    # unpack to 19 on pack_cost's GPT through the tier.
    def _unpack_entry(self, ref: Ref) -> torch.Tensor:
        e = ref.entry
        scope = e.scope
        with self._lock:
            if e.state is State.FREED:
                raise RuntimeError("ssdtrain: a saved tensor was unpacked after it was freed (internal error)")
            if not scope.backward_started:
                self._begin_backward(scope)
            scope.armed = False
            p = ref.part  # the entry, or its part (Note [saves handed over together share an entry])
            guard = p.guard  # Entry.current_version's question, asked here
            if guard is None and p.guard_weak is not None:
                guard = p.guard_weak()
            if guard is not None and guard._version != p.version:
                p.check_version()
            if p.tainted:
                raise RuntimeError(p.tainted)
            if e.data is None and e.consumed_pass == scope.passes and e.loaded is None:
                # Unpacked again after every save of it was: a new backward pass (retain_graph).
                scope.passes += 1
                scope.restart()
            self._reader.prefetch(scope, e.layer)
            if e.counted_ahead:  # Scope.used, inline
                e.counted_ahead = False
                scope.ahead -= e.nbytes
            if e.data is not None:
                if e.state is State.QUEUED:
                    self._writer.cancel(e)
                self._cache.forwarded(e)
                return device.for_consumer(rebuild_on(p.data, p.lo + ref.offset, ref, e.device))
            if e.error is not None:
                # A fresh copy each time: a raised exception keeps its traceback, and the
                # frames in it (holding saved references) must not live on in the entry.
                raise copy.copy(e.error).with_traceback(None)
            got = self._reader.take(e, ref)  # read ahead and landed, the common case: claim and finished in one
            if got is not None:
                fut = None
                out, ext, back = got
            else:
                fut, buf = self._reader.claim(e, ref)
                if fut is not None and fut.done() and fut.exception() is None:
                    self._reader.landed(e, fut, buf)  # Reader.wait's and finish's counting, done here
                    fut = None
                if fut is None:  # read ahead and landed: Reader.finish's work under this same lock
                    out, ext, back = self._reader.finished(e, ref, buf)
        if fut is None:
            if back is not None:  # Reader.order_after's question, asked here
                self._reader.order_after(ext, back)
            return device.for_consumer(out)
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
