"""A modelled GPU: a deterministic virtual clock under which CPU tensors stand for device memory.

Work is queued on :class:`Stream` objects as on CUDA streams and takes the time the
:class:`~ssdtrain.device.rates.Rates` give it; the host thread has a virtual clock of its own that
moves only by the set cost of each call and when it waits (:meth:`Event.synchronize`, a blocking
copy). No wall clock is read anywhere: the same program gives the same timeline.

Two clocks are kept side by side. Virtual *time* says how long things take (the timeline).
*Order* says what is guaranteed to have happened before what, as CUDA's rules give it (the
queue order of a stream, events recorded and waited for, the host's synchronisations): each
stream, event and the host carry a vector clock (stream id -> how many of its ops are ordered
before). Correctness is judged on order alone, never on time, so a missing wait is caught even
when the timeline would have hidden it (Note [a modelled copy lands when it is seen]).

Ops run on the CPU, at once, in host order, under :class:`~ssdtrain.device.model_ops.ModelledCompute`;
copies between device and host memory go through :meth:`ModelledGPU.copy`. Device memory is the
storages registered as such (made by ops under the mode, :meth:`ModelledGPU.empty`,
:meth:`ModelledGPU.adopt`), counted from registration until the storage dies.
"""

from __future__ import annotations

import contextlib
import functools
import random
import threading
import weakref
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ssdtrain._units import fmt_bytes
from ssdtrain.device import cuda as seam
from ssdtrain.device.model_streams import (Event, ModelledRace, Stream, _Copy, _covers, _Engine, _merge, _overlap,
                                           _span, _Storage, poison)
from ssdtrain.device.rates import Rates

__all__ = ["ModelledGPU", "Stream", "Event", "ModelledRace", "poison", "modelled"]

DEVICE, PINNED, HOST = "device", "pinned", "host"


class ModelledGPU:
    """A GPU modelled on a virtual clock (see the module's docstring).

    Args:
        rates: what work costs (``rates.H100``, ``rates.H200`` or your own).
        seed: seeds the jitter; the same seed and program give the same timeline.
        jitter: each duration is multiplied by ``1 + jitter * u``, ``u`` uniform in [0, 1) from
            the seed (0: no jitter).
        strict: raise :class:`ModelledRace` at the next call after a race was recorded.
        trace: keep ``timeline``, a list of ``(stream, what, start, end)``.
        data: ``False``: memory the model makes holds no bytes (meta tensors: Note [a modelled
            GPU without data]); for timelines and peaks at shapes the CPU could not compute.
    """

    def __init__(self, rates: Rates, seed: int = 0, *, jitter: float = 0.0, strict: bool = False,
                 trace: bool = False, data: bool = True) -> None:
        self.rates, self.jitter, self.strict, self.data = rates, jitter, strict, data
        self._where = "cpu" if data else "meta"
        self.device = torch.device("cuda", 0)
        self._rng = random.Random(seed)
        self._lock = threading.RLock()
        self._local = threading.local()
        self.host_now = 0.0
        self._host_vc: dict[int, int] = {}
        self.streams: list[Stream] = []
        self.compute = self.new_stream("compute")
        self._engines = {k: _Engine(k) for k in ("sm", "d2h", "h2d")}
        self._storages: dict[int, _Storage] = {}
        self._pending: list[_Copy] = []
        self._allocated = self._peak = self._pinned = 0
        self.races: list[str] = []
        self._unraised: list[str] = []
        self.timeline: list[tuple[str, str, float, float]] | None = [] if trace else None

    # Note [a modelled GPU without data]
    # With ``data=False`` the model's memory is meta tensors: shapes, dtypes and storages, no
    # bytes. Ops still run (on meta: shapes only), are charged by their FLOPs and bytes, and device
    # memory is counted per storage; copies queue and land as with data, so races are still found
    # by order. Nothing can be compared but the timeline, the peaks and the counters: gradients
    # are checked with data, at shapes the CPU computes. The engine offloads a meta tensor only
    # while a modelled GPU is in use (``keep.as_is``); the pinned pool is meta too, so a host tier
    # of tens of GiB costs this machine nothing.

    # -- streams, events, the host clock -------------------------------------------------------

    def new_stream(self, name: str | None = None) -> Stream:
        with self._lock:
            s = Stream(self, name or f"side{len(self.streams)}", len(self.streams))
            self.streams.append(s)
            return s

    def current_stream(self) -> Stream:
        return getattr(self._local, "stream", None) or self.compute

    @contextlib.contextmanager
    def stream(self, stream: Stream) -> Iterator[Stream]:
        """Makes ``stream`` current on this thread, as ``torch.cuda.stream``."""
        before = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield stream
        finally:
            self._local.stream = before

    def event(self, enable_timing: bool = False, blocking: bool = False) -> Event:
        return Event(self, enable_timing, blocking)

    def host(self, seconds: float) -> None:
        """The host thread spends ``seconds`` (a call's cost)."""
        self._check()
        self.host_now += seconds

    # Note [the modelled host pays for each hook]
    # The saved-tensor hooks are the host's work per save (issue 64: tens of microseconds a save
    # on an H200's host): an Offloader made under the model wraps its pack and unpack with
    # :meth:`charged`, so that each call moves the host clock by ``Rates.pack_s`` or
    # ``Rates.unpack_s`` before it runs. The Python of the hooks itself runs free, as every host
    # call does on the model; only these set costs, and the ones of each launch, copy, event and
    # poll, are time on the model's host.
    def charged(self, fn, seconds: float):
        """``fn``, made to cost the host ``seconds`` a call (Note [the modelled host pays for each hook])."""
        @functools.wraps(fn)  # torch.compile's mark stays on it
        def call(*args, **kwargs):
            self.host(seconds)
            return fn(*args, **kwargs)
        call.__self__ = getattr(fn, "__self__", None)  # whose hook it is (the scopes ask)
        return call

    def synchronize(self) -> None:
        """The host waits for every stream."""
        for s in list(self.streams):
            s.synchronize()

    def _record(self, event: Event, stream: Stream) -> None:
        self._check()
        with self._lock:
            self.host_now += self.rates.event_s
            _merge(stream.vc, self._host_vc)  # Note [a modelled copy lands when it is seen]
            event.stream, event.time, event.vc = stream, max(stream.end, self.host_now), dict(stream.vc)

    def _wait(self, stream: Stream, event: Event) -> None:
        self._check()
        if event.time is None:
            return
        with self._lock:
            _merge(stream.vc, event.vc)
            stream.end = max(stream.end, event.time)

    def _query(self, event: Event) -> bool:
        self._check()
        with self._lock:
            self.host_now += self.rates.poll_s
            if event.time is not None and self.host_now < event.time:
                return False
            self._observe(event)
            return True

    def _observe(self, event: Event) -> None:
        self._check()
        if event.time is None:
            return
        with self._lock:
            self.host_now = max(self.host_now, event.time)
            _merge(self._host_vc, event.vc)
            for c in [c for c in self._pending if _covers(self._host_vc, c.key)]:
                self._land(c)

    def _enqueue(self, stream: Stream, engine: str, seconds: float, what: str) -> tuple[tuple[int, int], float]:
        """Queues ``seconds`` of work on ``stream``, run by ``engine``; its op key and end."""
        if self.jitter:
            seconds *= 1 + self.jitter * self._rng.random()
        _merge(stream.vc, self._host_vc)
        eng = self._engines[engine]
        start = max(self.host_now, stream.end, eng.free)
        end = eng.free = stream.end = start + seconds
        stream.seq += 1
        stream.vc[stream.index] = stream.seq
        if self.timeline is not None:
            self.timeline.append((stream.name, what, start, end))
        return (stream.index, stream.seq), end

    # -- memory ---------------------------------------------------------------------------------

    def _record_of(self, t: torch.Tensor) -> _Storage | None:
        return self._storages.get(id(t.untyped_storage()))

    def _register(self, t: torch.Tensor, kind: str, stream: Stream | None) -> _Storage:
        storage = t.untyped_storage()
        key = id(storage)  # the storage's Python object lives as long as the storage does
        with self._lock:
            rec = self._storages.get(key)
            if rec is not None:
                return rec
            rec = self._storages[key] = _Storage(kind, storage.nbytes(), stream)
            if kind == DEVICE:
                self._allocated += rec.nbytes
                self._peak = max(self._peak, self._allocated)
            elif kind == PINNED:
                self._pinned += rec.nbytes
        me = weakref.ref(self)
        weakref.finalize(storage, _released, me, key).atexit = False
        return rec

    def kind(self, t: torch.Tensor) -> str:
        """``"device"``, ``"pinned"`` or ``"host"`` (any tensor the model was not told about)."""
        rec = self._record_of(t)
        return HOST if rec is None else rec.kind

    def is_device(self, t: torch.Tensor) -> bool:
        rec = self._record_of(t)
        return rec is not None and rec.kind == DEVICE

    def empty(self, *size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A device tensor, allocated under the current stream (uninitialised: poisoned)."""
        self._check()
        with _disable_current_modes():
            t = torch.empty(*size, dtype=dtype, device=self._where)
        poison(t)
        self._register(t, DEVICE, self.current_stream())
        return t

    def adopt(self, *tensors: torch.Tensor) -> None:
        """Counts the storages of ``tensors`` (made outside the model: parameters, inputs) as
        device memory allocated under the current stream."""
        for t in tensors:
            self._register(t, DEVICE, self.current_stream())

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of pinned host memory: copies to and from it run at the full copy rate."""
        with _disable_current_modes():
            t = torch.empty(nbytes, dtype=torch.uint8, device=self._where)
        self._register(t, PINNED, None)
        return t

    def pinned_bytes(self) -> int:
        return self._pinned

    def allocated(self) -> int:
        """Device bytes allocated now (``torch.cuda.memory_allocated``)."""
        return self._allocated

    def peak(self) -> int:
        """The most device bytes allocated since the last :meth:`reset_peak`."""
        return self._peak

    def reset_peak(self) -> None:
        self._peak = self._allocated

    def record_stream(self, t: torch.Tensor, stream: Stream) -> None:
        """``t.record_stream(stream)``: its memory is reused only after ``stream``'s work queued so
        far ran (Note [a released device buffer waits for no copy])."""
        rec = self._record_of(t)
        if rec is not None:
            rec.recorded.add(stream.index)

    # -- copies ----------------------------------------------------------------------------------

    # Note [a modelled copy lands when it is seen]
    # A copy's destination is poisoned when the copy is queued, and its real bytes (the source's,
    # taken then: every write ordered before the copy has already run on the CPU, in host order)
    # are written only when someone that is *ordered after* the copy looks: the host once it
    # synchronised with, or queried true, an event recorded after the copy (or a blocking copy
    # made it wait), or an op on a stream that waited for such an event and reads the
    # destination. Order is CUDA's, kept as vector clocks, never the virtual time: a reader that
    # is not ordered after the copy reads poison (NaN, or bytes of 0x5A) and the race is recorded,
    # even when the timeline says the copy had ended -- a wrong order gives a wrong gradient or an
    # error, never luck. The same holds for the copy's source: a write to it by a stream not
    # ordered after the copy is recorded and poisons what the copy carries, and a copy queued
    # without waiting for the op that wrote its source is recorded (the source was not final).
    # Work queued by the host is ordered after everything the host has seen.
    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream | None = None,
             non_blocking: bool = True) -> None:
        """``dst.copy_(src, non_blocking=...)`` on ``stream`` (the current one by default).

        Device to host and back run on their copy engines at the direction's rate; device to
        device runs on the SMs at the HBM rate (bytes read and written). The host waits for the
        copy when ``non_blocking`` is false or the host side is not pinned. ``dst`` reads as
        poison until the copy is seen done (Note [a modelled copy lands when it is seen]).
        """
        self._check()
        stream = stream if stream is not None else self.current_stream()
        skind, dkind = self.kind(src), self.kind(dst)
        if DEVICE not in (skind, dkind):
            with _disable_current_modes(), torch.no_grad():
                dst.copy_(src)  # a host copy: not the device's business
            return
        nbytes = src.numel() * src.element_size()
        r = self.rates
        if skind == dkind:
            engine, seconds, label = "sm", 2 * nbytes / r.hbm_bytes_per_s, "copy d2d"
        elif skind == DEVICE:
            engine, seconds, label = "d2h", nbytes / r.d2h_bytes_per_s, "copy d2h"
        else:
            engine, seconds, label = "h2d", nbytes / r.h2d_bytes_per_s, "copy h2d"
        pageable = HOST in (skind, dkind)
        if pageable:
            seconds /= r.pageable
        with self._lock:
            self.host_now += r.copy_issue_s
            _merge(stream.vc, self._host_vc)
            ordered = self._reads(src, stream.vc, f"{label} on {stream.name}", stream)
            with _disable_current_modes(), torch.no_grad():
                data = src.detach().clone()
            if not ordered:
                poison(data)  # the source was not final when the copy read it
            key, end = self._enqueue(stream, engine, seconds, f"{label} {fmt_bytes(nbytes)}")
            self._writes(dst, stream, key, stream.vc, f"{label} on {stream.name}")
            storage = dst.untyped_storage()
            c = _Copy(stream, key, end, f"{label} #{key[1]} on {stream.name}", data, weakref.ref(storage),
                      (dst.dtype, dst.storage_offset(), tuple(dst.shape), tuple(dst.stride())), _span(src), _span(dst))
            poison(dst)
            self._pending.append(c)
            srec, drec = self._record_of(src), self._record_of(dst)
            if srec is not None:
                srec.outgoing = [o for o in srec.outgoing if not _covers(self._host_vc, o.key)]
                srec.outgoing.append(c)
            if drec is not None:
                drec.incoming.append(c)
        if pageable or not non_blocking:
            self._observe(stream.record_event())

    def _land(self, c: _Copy) -> None:
        """Writes a copy's bytes into its destination (once: Note [a modelled copy lands when it is seen])."""
        if c.landed:
            return
        c.landed = True
        self._pending.remove(c)
        storage = c.dst()
        if storage is None:
            return
        rec = self._storages.get(id(storage))
        if rec is not None and c in rec.incoming:
            rec.incoming.remove(c)
        if rec is not None and c.tainted is not None:  # Note [a copy of released memory matters when read]
            rec.tainted.append((c.dst_span, c.tainted))
        if storage.device.type == "meta":
            return  # no bytes to write (Note [a modelled GPU without data])
        dtype, offset, shape, stride = c.view
        with _disable_current_modes(), torch.no_grad():
            torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride).copy_(c.data)

    def _reads(self, t: torch.Tensor, vc: dict, who: str, stream: Stream | None) -> bool:
        """``who`` (ordered after ``vc``) reads ``t``: copies into it that are ordered before land;
        one that is not, or a write by another stream that is not, is a race (``t`` stays poison).
        Whether every write to ``t`` was ordered before."""
        rec = self._record_of(t)
        if rec is None:
            return True
        ordered = True
        span = _span(t)  # Note [races are found byte range by byte range]
        for c in list(rec.incoming):
            if not _overlap(c.dst_span, span):
                continue
            if _covers(vc, c.key):
                self._land(c)
            else:
                ordered = False
                self._race(f"{who} reads a buffer before {c.label} that writes it is ordered before it")
        for wstream, key, wspan in rec.writes:
            if wstream is not stream and _overlap(wspan, span) and not _covers(vc, key):
                ordered = False
                self._race(f"{who} reads a buffer written on {wstream.name} (op #{key[1]}) without waiting for it")
        for tspan, why in rec.tainted:
            if _overlap(tspan, span):
                ordered = False
                self._race(f"{who} reads bytes copied from released memory: {why}")
        return ordered

    def _writes(self, t: torch.Tensor, stream: Stream | None, key: tuple[int, int] | None, vc: dict,
                who: str) -> None:
        """``who`` writes ``t``: a copy still reading it and not ordered before is a race, and
        what that copy carries becomes poison."""
        rec = self._record_of(t)
        if rec is None:
            return
        span = _span(t)  # Note [races are found byte range by byte range]
        for c in list(rec.outgoing):
            if c.stream is not stream and _overlap(c.src_span, span) and not _covers(vc, c.key):
                self._race(f"{who} overwrites a buffer that {c.label} may still be reading")
                poison(c.data)
        if rec.tainted:  # what is written over is no longer tainted
            rec.tainted = [(t, why) for t, why in rec.tainted if not (t[0] >= span[0] and t[1] <= span[1])]
        if stream is not None and key is not None:
            # forget writes the host has seen (all later work is ordered after them) and those
            # this one covers that are ordered before it
            rec.writes = [w for w in rec.writes if not _covers(self._host_vc, w[1]) and not (
                w[2][0] >= span[0] and w[2][1] <= span[1] and (w[0] is stream or _covers(vc, w[1])))]
            rec.writes.append((stream, key, span))

    # -- races -----------------------------------------------------------------------------------

    def _race(self, what: str) -> None:
        self.races.append(what)
        self._unraised.append(what)

    def _check(self) -> None:
        if self.strict and self._unraised:
            what, self._unraised = self._unraised, []
            raise ModelledRace("; ".join(what))

    # Note [a released device buffer waits for no copy]
    # On the model, a device buffer is *released* when its storage dies on the host (its last
    # tensor dropped): the caching allocator may then hand its block to the next op of the stream
    # it was allocated on. That is safe only where every copy still reading or writing it is
    # ordered before that stream's next op -- the allocation stream waited for an event after the
    # copy, the host saw the copy end, the copy ran on that stream, or ``record_stream`` named the
    # copy's stream -- whatever the virtual clock says. Otherwise the release is recorded in
    # ``races`` (raised at the next call with ``strict``), and what a copy reading it carries
    # becomes poison. Pinned host buffers are not checked: torch's host allocator reuses a block
    # only after the copies that used it.
    #
    # Note [a copy of released memory matters when read]
    # A copy *from* a released buffer harms only whoever reads what it copied: the engine lets a
    # save die in backward while its copy to the pool is still queued (unpack handed back the
    # tensor itself), and that copy's extent, a dead entry's, is never read (the soak's seed 1513
    # once in 1300 replays on a busy machine: the last reference went on the drive's thread). So
    # such a copy is tainted, not a race: its bytes are poison, and a race is recorded when anyone
    # reads the bytes it landed (a copy back, an op), until they are written over. A copy *into*
    # a released buffer is a race at once: it may write into memory handed to another tensor.
    def _released(self, key: int) -> None:
        with self._lock:
            rec = self._storages.pop(key, None)
            if rec is None:
                return
            if rec.kind == DEVICE:
                self._allocated -= rec.nbytes
            elif rec.kind == PINNED:
                self._pinned -= rec.nbytes
            if rec.kind != DEVICE:
                return  # pinned blocks are reused only after their copies (torch's host allocator)
            alloc = rec.stream.vc if rec.stream is not None else {}
            for c in rec.outgoing + rec.incoming:
                if c.landed and c in rec.incoming:
                    continue
                if (_covers(self._host_vc, c.key) or _covers(alloc, c.key) or c.stream is rec.stream
                        or c.stream.index in rec.recorded):
                    continue
                name = rec.stream.name if rec.stream is not None else "?"
                why = (f"a device buffer of {fmt_bytes(rec.nbytes)} (allocated on {name}) was released "
                       f"while {c.label} (ends at {c.end * 1e6:.3f} us) was not ordered before {name}")
                if c in rec.outgoing:  # Note [a copy of released memory matters when read]
                    poison(c.data)  # its memory may be reused before the copy read it
                    c.tainted = why
                else:
                    self._race(why)  # a copy may write into memory handed to another tensor


@contextlib.contextmanager
def modelled(gpu: ModelledGPU) -> Iterator[ModelledGPU]:
    """Makes the device seam (``cuda.py``, ``copies.py``, ``measure.py``) answer for ``gpu`` inside
    the block, and restores what it answered for on exit (Note [the seam answers for the modelled
    GPU] in ``cuda.py``). Ops are charged to ``gpu`` only under
    :class:`~ssdtrain.device.model_ops.ModelledCompute` (per thread): enter both, and make the
    :class:`~ssdtrain.Offloader` inside this block (its host tier is set up for the device then)."""
    before = seam._use_model(gpu)
    try:
        yield gpu
    finally:
        seam._use_model(before)


def _released(gpu_ref: weakref.ref, key: int) -> None:
    gpu = gpu_ref()
    if gpu is not None:
        gpu._released(key)
