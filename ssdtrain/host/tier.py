"""The host tier: a bounded pool of pinned host memory between the GPU and the drives.

PCIe to pinned host memory carries 25-55 GB/s each way on a current GPU (53 GB/s device to host
on an H100, measured 2026-11-25), 10-20 times one NVMe drive. So a CUDA save's first stop is
this pool: it leaves the GPU when its copy is due (Note [a tier copy is released in stream
order] in ``device/copies.py``), comes back from it in backward, and goes to the drives only
when the pool cannot hold it. CPU tensors never use the tier: they have no device memory to free.

Three pieces, each usable without a GPU (the tests drive them with made-up numbers):

* :class:`~ssdtrain.host.host_pool.HostPool` (its own file): the pinned memory, pinned in slabs as
  it fills (never a pinned allocation per tensor: each costs milliseconds and synchronises the
  device), on a thread of its own;
* :class:`~ssdtrain.host.copy_clock.CopyClock` (its own file): what each forward may copy before
  its peak, and when each copy is due;
* :class:`TieredBackend`: a :class:`~ssdtrain.store.Backend` in front of the drive backend,
  which moves host extents by device copies and hands everything else to the drives.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from ssdtrain.device import copies, measure
from ssdtrain.device import cuda as device
from ssdtrain.host.copy_clock import CopyClock
from ssdtrain.host.host_pool import GroupExtent, HostExtent, HostPool, _host_empty, auto_host_bytes
from ssdtrain.store._pool import IOFuture, IOPool
from ssdtrain.store.base import Backend, Extent

__all__ = ["TieredBackend"]

log = logging.getLogger(__name__)


FENCE_BYTES = 4 << 20
"""Copies in share a fence up to this many bytes (Note [a copy is due when its fence is])."""


def _fenced(part: list[tuple]) -> list[list[tuple]]:
    """``part``'s copies in order, cut after each run of at least ``FENCE_BYTES``."""
    out, cur, n = [], [], 0
    for item in part:
        cur.append(item)
        n += item[0].nbytes
        if n >= FENCE_BYTES:
            out.append(cur)
            cur, n = [], 0
    if cur:
        out.append(cur)
    return out


PROBE_MIN_BYTES = 1 << 20
"""Under this many bytes allocated at the first save, no rate probe (Note [the rate probe stays
under the step's peak]); the modelled soak lowers it to give its tiny models a learned clock."""


class TieredBackend(Backend):
    """The host tier in front of ``inner`` (the drives): host extents move by device copies on
    threads of their own, everything else goes to ``inner``.

    Args:
        inner: the drive backend.
        capacity: bytes of the pool; ``None``: :func:`auto_host_bytes`, resolved when the first
            CUDA tensor is offloaded.
        pool: a ready :class:`HostPool` (tests); else one is made on first use.
    """

    def __init__(self, inner: Backend, capacity: int | None, *, pool: HostPool | None = None) -> None:
        self.inner = inner
        self.name = inner.name
        self._capacity = capacity
        self.why = "asked for" if capacity is not None else ""
        self.pool = pool
        self.clock = CopyClock()
        self.copied = self.read = self.spilled = 0
        self._lock = threading.Lock()
        self._copy = IOPool(1, "ssdtrain-d2h")   # one stream: copies in pack order
        self._ins = _Batches(self._copy, self._copy_in)
        self._outs = _Batches(IOPool(1, "ssdtrain-h2d"), self._copy_out)
        self._rate_pending = False
        self._probing: IOFuture | None = None  # the copy-rate probe, until a batch has waited for it
        self._closed = False
        self._watch_fork()

    # -- placement ----------------------------------------------------------------------------
    def allocate_host(self, nbytes: int, dev: torch.device) -> HostExtent | None:
        """A host extent for a save of ``nbytes`` on ``dev``, or ``None`` (the pool is full, or
        still being pinned): then the drives take it."""
        if self._forked:  # Backend._check_process, without its call (a call a save)
            self._check_process()
        if self.pool is None:
            self._start(dev)
        ext = self.pool.allocate(nbytes)
        if ext is None:
            with self._lock:
                self.spilled += nbytes
        return ext

    def _start(self, dev: torch.device) -> None:
        if self._capacity is None:
            self._capacity, self.why = auto_host_bytes()
        cuda = device.gpu_device(dev)
        modelled = device.modelled_gpu() is not None
        # The tests' way through the tier (CPU tensors): plain host memory, at once. On the modelled
        # GPU, slabs are pinned on the training thread too (Note [the modelled tier runs in a fixed order]).
        self.pool = HostPool(self._capacity, pin=device.pinned_empty if cuda else _host_empty,
                             background=cuda and not modelled)
        start = time.perf_counter()
        self.pool.pin_first()  # Note [the first step's saves find the pool pinned]
        if cuda:
            log.info("ssdtrain: the host tier pinned its first %d MiB in %.2f s (once)", self.pool.pinned >> 20,
                     time.perf_counter() - start)
            measured = self._copy.submit(self._measure_rate, dev)
            if modelled:  # Note [the modelled tier runs in a fixed order]
                measured.exception()
            elif copies.runtime_copies():
                self._probing = measured  # Note [copies are made where they are handed over]
            else:
                self.inline_copies(False)  # torch's copies hold the GIL: on the copy threads, as before

    # Note [the first step's saves find the pool pinned]: the first slab is pinned on the training
    # thread at the first CUDA save (about 0.35 s for 512 MiB on an H100's host, once per process),
    # not in the background. Pinned in the background, it came in after the first step's forward at
    # a long sequence, so that step's saves went to the drive or stayed: its peak was the peak
    # without the tier, and a user at a length only the tier makes fit ran out of memory on step 1
    # (a likely cause of recompute+offload failing at 40960 tokens on an H200 under a 6 GiB cap,
    # 2026-11-27, where it trained 65536, whose longer forward let the pinning finish: not proven).
    # Later slabs are pinned in the background as the pool fills (``host_pool.GROW_AT``).
    # Note [the rate probe stays under the step's peak]
    # The copy-rate probe copies from a device buffer of its own, allocated at the first save. At
    # 64 MiB it made the first step's peak on a small model: on the modelled GPU, a 4-block GPT
    # (hidden 128, seq 512, batch 4) peaked at 67 MiB in the step with recompute+offload against
    # 28 MiB without ssdtrain, and the modelled longest-sequence search found nothing that fit a
    # 16 MiB budget. The probe now takes at most what is allocated at the first save (the weights,
    # the batch, what forward made so far): the step's backward holds as much again in gradients,
    # so the probe is below the peak it would otherwise have raised, and 64 MiB from 64 MiB of
    # weights on (any model worth offloading). Under 1 MiB allocated (a toy: a copy that small
    # times the copy's latency, not its rate) there is no probe, and no rate, as when pinning fails.
    def _measure_rate(self, dev: torch.device) -> None:
        n = min(64 << 20, measure.allocated(dev))  # Note [the rate probe stays under the step's peak]
        if n < max(PROBE_MIN_BYTES, 1):
            return
        mem = self.pool.allocate(n)  # the first slab is in (or pinning it failed: no rate)
        if mem is None:
            return
        try:
            self.clock.rate = measure.copy_rate(dev, self.pool.view(mem))
        finally:
            self.pool.free(mem)

    def allocate(self, nbytes: int) -> Extent:
        return self.inner.allocate(nbytes)

    # Note [a pool extent outlives its copy back]
    # A save's copy back to the device (``extent.back``, queued on the read thread's side stream)
    # reads its pool extent until it has run; unpack makes the compute stream wait for it, and the
    # next copies into the pool come after the compute stream's later work (their producers), so
    # they never overwrite what it still reads. A backward cut short (an exception, a graph dropped
    # after its reads were issued ahead) never unpacks some saves read ahead: their extents were
    # freed at once, and the next step's copy in could overwrite one while its copy back still read
    # it, a race by CUDA's rules (found by the modelled GPU's soak, benchmarks/model_soak.py,
    # 2026-11-28: about 3% of its seeds; the bytes went into buffers no one used again). Such an
    # extent now waits for its copy back before it is freed: a host wait, on that path only. An
    # extent read back twice (read ahead, given back, read again; a group read again) was marked
    # ordered by its first copy back's wait, and its second went unwaited (the soak, 2026-11-29: 2 of
    # 1000 seeds once deaths were settled later): ``ordered`` holds the copy back that was waited for.
    def free(self, extent: Any) -> None:
        if type(extent) is HostExtent:
            back = extent.back
            if back is not None and extent.ordered is not back:  # not waited for: a second read's, too
                back()
            if extent.reserved:  # else carved from a group's region (Note [a group's parts are carved from one region])
                self.pool.free(extent)
        elif type(extent) is GroupExtent:  # Note [saves handed over together share an entry]
            for ext in extent.parts:
                self.free(ext)
            region, extent.region = extent.region, None
            if region is not None:
                self.pool.free(region)
        else:
            self.inner.free(extent)

    def fit_region(self, extent: GroupExtent) -> None:
        """A group closed: its region keeps what its parts use, the rest goes back to the pool
        (Note [a group's parts are carved from one region] in ``engine/group.py``)."""
        if extent.used:
            if extent.used < extent.region.reserved:  # else its tail passed on already
                self.pool.shrink(extent.region, extent.used)
        else:
            region, extent.region = extent.region, None
            self.pool.free(region)

    # -- I/O ----------------------------------------------------------------------------------
    def submit_write(self, extent: Any, src: torch.Tensor, *, checksum: bool = False,
                     ready: Callable[[], None] | None = None) -> Future:
        if type(extent) is not HostExtent:
            return self.inner.submit_write(extent, src, checksum=checksum, ready=ready)
        self._check_process()
        return self._ins.submit([(extent, src, ready)])

    def submit_writes(self, requests: list[tuple[Any, torch.Tensor, bool, Any]]) -> tuple[list[Future], Future | None]:
        """Writes of ``(extent, src, checksum, ready)``: their futures, in order, and the one
        future that the host extents' copies share (``None`` if there are none): those are made
        together (Note [tier copies are handed over a batch at a time]), the drives' writes one by
        one."""
        return self._split(self._ins, requests, self.inner.submit_write)

    def _split(self, batches: _Batches, requests: list[tuple], inner: Callable) -> tuple[list[Future], Future | None]:
        """``requests`` ``(extent, tensor, checksum, ready)``: the host extents' to ``batches``
        together, under one future (also returned; ``None`` if none), the others to ``inner``
        one by one; their futures, in order."""
        host = [(extent, t, ready) for extent, t, _, ready in requests if type(extent) is HostExtent]
        shared = None
        if host:
            self._check_process()
            shared = batches.submit(host)
        return [shared if type(extent) is HostExtent else inner(extent, t, checksum=checksum, ready=ready)
                for extent, t, checksum, ready in requests], shared

    # Note [tier copies are handed over a batch at a time]
    # A tier save's copy is cheap for the device and dear for the host: every microsecond of Python
    # on any thread is one the training thread, which launches the model's kernels, waits for the
    # GIL (issue 29: at most 10 us a save). Handed over one by one, each copy made a future, a
    # completion callback, and a completion that took the engine's lock, woke its waiters and
    # pumped the queue again: about half of a tier pack's 38-41 us on the CPU (2026-11-27,
    # benchmarks/cpu-results/2026-11-27-pack-cost/isolated_pump.py). So the write queue hands the
    # copies of one pump over in one request with one future (made at once since 2026-11-30: Note
    # [copies are made where they are handed over]), and settles them in one completion
    # (``WriteQueue._finish_all``). Pack, and that completion, pump only when no
    # batch is out and ``HAND_OVER_SAVES`` (8) saves or ``HAND_OVER_BYTES`` (256 MiB) wait in the
    # queue, or the oldest was packed ``HAND_OVER_SECONDS`` (1 ms) ago (``WriteQueue.pack_pumps``):
    # with the copy thread faster than pack (on the CPU, where a copy is a memmove; on a GPU, where
    # it is queued without the GIL) a batch was otherwise one save. So a copy is queued at most
    # about a millisecond of the host later than its pack, while the copy engine (the bottleneck:
    # forward makes activations 4-6 times faster than PCIe carries them) still has earlier copies
    # to run; a long sequence's block inputs, a block apart, go at the next save. The drives'
    # writes (a spill) are not held back, and the tier's copies in flight count against no cap:
    # they are queued on the device, not written by threads. What is still in the queue when
    # backward begins is kept, as every queued write is (adaptive keep): the last saves of a
    # forward, due after its peak anyway.

    # Note [a copy is due when its fence is]
    # Copies queued together share one fence (Note [copies are queued a batch at a time]), and a
    # save's release makes the compute stream wait for its copy's fence: for a save early in a
    # batch, that was the whole batch's end, not its own. Each copy is due at its own predicted end
    # (Note [a copy is due from its hand-over]), so the first saves of a batch were released while
    # the rest of it still ran, and the compute stream waited: on the modelled H200 at the bench's
    # GPU shape, plain offload's step had one 3.5 ms wait early in forward, for a batch of six
    # copies (256 MiB), x1.059 of baseline (x1.055 with pack at 5 us a save: the hooks were not the
    # cost). A batch is now fenced every ``FENCE_BYTES`` (an event each, on the copy thread: 6.5 us
    # against 73 us of copying at 55 GB/s), and a copy is due when the last copy of its fence is.
    # Due when the whole batch is (tried first), the step was x1.003 at that shape but a 4-block
    # model of hidden 1024 lost its peak's fall (71% to 0%): the releases came after its peak.
    def _copy_in(self, batch: list[tuple]) -> None:
        """A batch of copies into the pool, queued together (Note [copies are queued a batch at a
        time]), a fence every ``FENCE_BYTES`` (Note [a copy is due when its fence is])."""
        self._after_probe()
        bases, n = self.pool.bases, 0  # an extent's address: HostPool.address, without its call
        for part in _by_device(batch):
            if not device.is_cuda(part[0][1]):  # the tests' way through the tier: host to host, at once
                for _, _, ready in part:
                    if ready is not None:
                        ready()
                # Note [a batch of copies releases the GIL once]
                copies.copy_host([(bases[ext.slab] + ext.offset, src.data_ptr(), ext.nbytes) for ext, src, _ in part])
                for ext, _, _ in part:
                    ext.landed = None
                    n += ext.nbytes
                continue
            for chunk in _fenced(part):
                srcs, readys = [src for _, src, _ in chunk], [ready for _, _, ready in chunk]
                fence = copies.queue_to_host([bases[ext.slab] + ext.offset for ext, _, _ in chunk], srcs, readys)
                if fence is None:
                    fence = copies.queue_copies([self.pool.view(ext) for ext, _, _ in chunk], [_tensor(s) for s in srcs],
                                                readys)
                due = max(ext.due for ext, _, _ in chunk)
                for ext, _, _ in chunk:
                    ext.due, ext.landed = due, fence
                    n += ext.nbytes
        with self._lock:
            self.copied += n

    def submit_read(self, extent: Any, dst: torch.Tensor, *, checksum: object = None,
                    ready: Callable[[], None] | None = None) -> Future:
        if type(extent) is not HostExtent:
            return self.inner.submit_read(extent, dst, checksum=checksum, ready=ready)
        self._check_process()
        return self._outs.submit([(extent, dst, ready)])

    def submit_reads(self, requests: list[tuple[Any, torch.Tensor, Any, Any]]) -> list[Future]:
        """Reads of ``(extent, buffer, checksum, ready)``, a future each, in order: the host
        extents' copies back handed over together under one future (Note [tier reads are issued a
        batch at a time]), the drives' reads one by one."""
        return self._split(self._outs, requests, self.inner.submit_read)[0]

    def _copy_out(self, batch: list[tuple]) -> None:
        """Copies back to the device, queued, not waited for: unpack makes the compute stream wait for ``extent.back``."""
        self._after_probe()
        bases, n = self.pool.bases, 0  # an extent's address: HostPool.address, without its call
        for part in _by_device(batch):
            dsts = [dst for _, dst, _ in part]
            if device.is_cuda(dsts[0]):
                # After the allocation point of each buffer, and after the copy in of its bytes
                # (on the device: the copy in is long done, almost always).
                readys = list({id(ready): ready for _, _, ready in part if ready is not None}.values())
                readys += {id(e.landed): e.landed for e, _, _ in part if e.landed is not None}.values()
                # Note [reads back are issued without the GIL too]; through torch where they cannot be
                fence = copies.queue_to_device(dsts, [bases[ext.slab] + ext.offset for ext, _, _ in part], readys)
                if fence is None:  # byte for byte (a buffer may have its save's shape: Note [a whole save is read into its own shape])
                    fence = copies.queue_copies([_bytes(d) for d in dsts], [self.pool.view(ext) for ext, _, _ in part], readys)
                for ext, _, _ in part:
                    ext.back = fence
                    n += ext.nbytes
            else:
                for ext, _, ready in part:
                    if ready is not None:
                        ready()
                    n += ext.nbytes
                copies.copy_host([(dst.data_ptr(), bases[ext.slab] + ext.offset, ext.nbytes) for ext, dst, _ in part])
        with self._lock:
            self.read += n

    def alloc_buffer(self, nbytes: int, dev: torch.device, extent: Any = None, shape: Any = None,
                     dtype: Any = None) -> torch.Tensor:
        """A buffer for a read of ``extent``: a host extent's of ``shape`` and ``dtype`` if given
        (``nbytes`` in all: Note [a whole save is read into its own shape] in ``reader.py``), else
        of bytes."""
        if type(extent) is HostExtent:
            if shape is not None:
                return torch.empty(shape, dtype=dtype, device=dev)
            return torch.empty(nbytes, dtype=torch.uint8, device=dev)
        return self.inner.alloc_buffer(nbytes, dev, extent=extent)

    def inline_copies(self, on: bool = True) -> None:
        """Copies made on the thread that hands them over (the default), or, ``on=False``, on the
        copy threads (Note [copies are made where they are handed over]); set before the first save."""
        self._ins.inline = self._outs.inline = on

    def _after_probe(self) -> None:
        """A batch's copies come after the rate probe (Note [copies are made where they are handed over])."""
        if self._probing is not None:
            self._probing.exception()
            self._probing = None

    # -- bookkeeping --------------------------------------------------------------------------
    def fill(self, snap: Any) -> None:
        """Sets the tier's fields of an :class:`~ssdtrain.engine.stats.OffloadStats`."""
        with self._lock:
            snap.host_copied_bytes, snap.host_read_bytes, snap.spilled_bytes = self.copied, self.read, self.spilled
        snap.host_copy_limit_bytes = self.clock.limit if self.clock.reference is not None else None
        pool = self.pool
        if pool is not None:
            snap.host_tier_bytes, snap.host_tier_peak_bytes = pool.used, pool.peak
            snap.host_tier_pinned_bytes = pool.pinned

    def written_bytes_by_path(self) -> dict[str, int]:
        return self.inner.written_bytes_by_path()

    def heal(self) -> None:
        self.inner.heal()

    def describe(self) -> str:
        size = "sized at first use" if self.pool is None else f"{self.pool.capacity >> 20} MiB"
        return f"{self.inner.describe()}; host tier: {size}{f' ({self.why})' if self.why else ''}"

    def _after_fork_in_child(self) -> None:
        self._forked = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._copy.shutdown(wait=not self._forked)
        self._outs.pool.shutdown(wait=not self._forked)
        if self.pool is not None:
            self.pool.close()
        self.inner.close()


def _tensor(src: Any) -> torch.Tensor:
    """A write's source as a tensor: a :class:`~ssdtrain.engine.views.Span`'s byte view (Note [an
    entry's bytes are its storage's]), or the tensor given."""
    return src if isinstance(src, torch.Tensor) else src.tensor()


def _bytes(buf: torch.Tensor) -> torch.Tensor:
    """A fresh (contiguous) read buffer as its bytes, 1-D."""
    return buf if buf.dtype is torch.uint8 and buf.dim() == 1 else buf.reshape(-1).view(torch.uint8)


def _by_device(batch: list[tuple]) -> list[list[tuple]]:
    """The requests ``(extent, tensor, ready)`` of a batch grouped by the tensor's device, in order."""
    first = batch[0][1].device
    for request in batch:
        if request[1].device != first:
            break
    else:  # the common case: one device, no call a request
        return [batch]
    parts: dict[torch.device, list[tuple]] = {}
    for request in batch:
        parts.setdefault(request[1].device, []).append(request)
    return list(parts.values())


class _Batches:
    """Requests taken a batch at a time by one thread of ``pool``: each submission (a list of
    requests) gets one future, completed once ``process`` has handled the batch it went in (with
    its exception, if it raised)."""

    def __init__(self, pool: IOPool, process: Callable[[list], None]) -> None:
        self.pool, self._process = pool, process
        self._lock = threading.Lock()
        self._pending: list[tuple[list, IOFuture]] = []
        self._draining = False
        self.inline = True  # Note [copies are made where they are handed over]

    # Note [copies are made where they are handed over]
    # A batch handed to a sleeping copy thread cost the training thread about 60 us on this VM: a
    # wake-up (~17 us in ``submit``: a futex call and the other core's interrupt) and the GIL
    # passed back and forth twice while the copy thread ran its Python (2026-11-30, pack_cost's GPT
    # through the tier: 30 batches and 60 sleeps a step). The copies themselves are a memmove on
    # the CPU and, on a GPU, calls into the CUDA runtime made with the GIL released (Note [a batch
    # of copies releases the GIL once] in ``device/copies.py``): cheaper than the hand-over. So each
    # batch is now made on the thread that hands it over (pack's pump on the training thread, a
    # read on the thread that runs unpack), under this object's lock (one batch at a time, as the
    # copy thread took them), and its future is done when ``submit`` returns: its completion runs
    # where the caller adds it (as on the modelled GPU). On pack_cost's GPT (3 runs, every mode):
    # all threads beyond the copy 17.8-18.4 us a save against 22.0-23.7 with the copy threads, the
    # training thread's whole step +20.5-21.2 against +21.2-22.3 although it now makes the
    # memmoves, pack 8.4-9.0 us against 8.3-8.6, no sleeps. The modelled H200 is unchanged (its
    # one host clock charges every copy's issue to the step either way). A failed batch fails its
    # future; an interrupt goes to the caller's hand-over (``WriteQueue._interrupted``). The copy
    # threads stay for the rate probe (the first batch waits for it: copies beside it would slow the
    # engine it measures) and for copies through torch (no CUDA runtime to call: ``Tensor.copy_``
    # holds the GIL some 38 us a copy): ``inline_copies(False)``. Whether a GPU host gains as this
    # VM does: the GPU queue's ``overhead`` stage (``tier-threads`` beside ``tier``).

    # Note [the modelled tier runs in a fixed order]
    # On the modelled GPU (Note [the seam answers for the modelled GPU] in ``device/cuda.py``) the
    # copy threads' calls move the one host clock and make streams and events: left to the OS
    # scheduler, two runs of one program would give two timelines. So there the submitting thread
    # waits until its batch was processed: the copies are still queued on the copy thread, on its
    # own side stream (as on a GPU), but at a fixed point of the training thread's program. The
    # batch's completion callbacks then run on the thread that adds them (``IOFuture``), also in
    # program order. No engine lock may be held by a submitter whose batch completion takes it:
    # the write queue submits without it, and the reads' futures have no callbacks.
    def submit(self, requests: list) -> IOFuture:
        fut = IOFuture()
        if self.inline:
            with self._lock:
                try:
                    self._process(requests)
                except Exception as e:  # the batch's failure, as on the copy thread
                    fut.set_exception(e)
                    return fut
            fut.set_result(None)
            return fut
        with self._lock:
            self._pending.append((requests, fut))
            start, self._draining = not self._draining, True
        if start:
            try:
                self.pool.submit(self._drain)
            except BaseException:  # Note [a batch's drain is started or undone]
                with self._lock:
                    self._draining = False
                raise
        if device.modelled_gpu() is not None:
            fut.exception()  # waits for the batch, not for its copies on the device
        return fut

    # Note [a batch's drain is started or undone]
    # A KeyboardInterrupt as ``IOPool.submit`` began (the interrupt stress on the copy threads,
    # 2026-11-30) left ``_draining`` set, no drain queued: every later batch waited forever. The flag
    # is cleared when the drain was not queued; the next drain makes the batch left pending, whose
    # hand-over the caller treats as interrupted (``WriteQueue._interrupted``).
    def _drain(self) -> None:
        while True:
            with self._lock:
                batch, self._pending = self._pending, []
                if not batch:
                    self._draining = False
                    return
            try:
                self._process([request for requests, _ in batch for request in requests])
            except BaseException as e:  # each request of the batch fails with it
                for _, fut in batch:
                    fut.set_exception(e)
                continue
            for _, fut in batch:
                fut.set_result(None)
