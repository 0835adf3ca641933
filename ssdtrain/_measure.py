"""Measuring helpers for ``ssdtrain bench``: saved-activation bytes and resident-set growth.

* :class:`SavedMeter` - a ``saved_tensors_hooks`` counter of the unique storages autograd holds
  for backward (parameters and buffers excluded), live until autograd releases them; peak and
  timeline. Used only in untimed steps.
* :class:`RssSampler` - this process's resident set from ``/proc/self/statm`` on a thread.
* :func:`mmap_large_allocations` and :func:`malloc_trimmer` - glibc settings so that RSS follows
  live memory: large tensors are returned to the system when freed, and a step's growth is not
  hidden by memory an earlier step freed but the allocator kept; :func:`usual_allocations` puts
  glibc back to what it does unattended, for timing.
* :func:`stolen_seconds` - CPU time the hypervisor gave to other guests (``steal``), to tell a
  slow step from a busy host.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import time
from typing import Any

import torch

__all__ = ["RssSampler", "SavedMeter", "block_saved_bytes", "malloc_trimmer", "mmap_large_allocations",
           "stolen_seconds", "usual_allocations"]


class _Held:
    """What the saved-bytes counter hands autograd: the tensor, and a release on collection."""

    __slots__ = ("tensor", "meter", "key", "__weakref__")

    def __init__(self, tensor: torch.Tensor, meter: SavedMeter, key: int) -> None:
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self) -> None:
        self.meter._release(self.key)


class SavedMeter:
    """Live bytes of unique storages saved for backward, with their peak and a timeline.

    Used in one untimed step per mode: timed steps run with no hooks at all. Parameters and
    buffers are excluded (they are not activations). A storage counts once however many saves
    (views) refer to it, until the last of them is released by autograd.
    """

    def __init__(self, model: torch.nn.Module, *, recompute_block_bytes: int = 0) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in model.parameters()}
        self._excluded |= {t.untyped_storage().data_ptr() for t in model.buffers()}
        self._live: dict[int, list[int]] = {}
        self._lock = threading.Lock()
        self.bytes = 0
        self.peak = 0
        self.t0 = time.perf_counter()
        self.timeline: list[tuple[float, int]] = [(self.t0, 0)]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._handles: list[Any] = []
        if recompute_block_bytes:
            self._block_bytes = recompute_block_bytes
            for block in model.blocks:
                self._handles.append(block.register_forward_pre_hook(self._block_pre))

    # saved_tensors_hooks
    def _pack(self, t: torch.Tensor) -> Any:
        key = self._acquire(t)
        return t if key is None else _Held(t, self, key)

    @staticmethod
    def _unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def _acquire(self, t: torch.Tensor, extra: int = 0) -> int | None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._excluded or storage.nbytes() == 0:
            return None
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                self._live[key] = [1, storage.nbytes()]
                self._change(storage.nbytes())
            else:
                entry[0] += 1
        return key

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] == 0:
                del self._live[key]
                self._change(-entry[1])

    def _change(self, delta: int) -> None:
        self.bytes += delta
        self.peak = max(self.peak, self.bytes)
        self.timeline.append((time.perf_counter(), self.bytes))

    # Non-reentrant checkpoint saves through hooks of its own (innermost wins), so for the
    # recompute mode we account for what it holds instead: the block's input, kept by the
    # checkpoint frame until the block's backward is done, and while the block is recomputed
    # in backward, its activations (``recompute_block_bytes``, measured on one block).
    def _block_pre(self, module: torch.nn.Module, args: tuple) -> None:
        x = args[0]
        if torch._C._current_graph_task_id() != -1:  # recomputation, inside backward
            with self._lock:
                self._change(self._block_bytes)
            module._ssdtrain_bench_recomputed = True
            return
        if not (isinstance(x, torch.Tensor) and x.requires_grad):
            return
        key = self._acquire(x)
        module._ssdtrain_bench_recomputed = False

        def done(grad: torch.Tensor) -> None:
            if key is not None:
                self._release(key)
            if getattr(module, "_ssdtrain_bench_recomputed", False):
                module._ssdtrain_bench_recomputed = False
                with self._lock:
                    self._change(-self._block_bytes)

        x.register_hook(done)

    def __enter__(self) -> SavedMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def block_saved_bytes(block: torch.nn.Module, batch: int, seq: int, hidden: int, dtype) -> int:
    """Unique bytes one block saves for backward (what recomputing it brings back)."""
    x = torch.randn(batch, seq, hidden, dtype=dtype, requires_grad=True)
    meter = SavedMeter(block)
    with meter:
        y = block(x)
    peak = meter.peak
    del y
    return peak


class RssSampler:
    """Samples this process's resident set on a thread; ``peak_growth`` since ``start``."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        try:
            self._fd: int | None = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            self._fd = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.start_rss = 0
        self.peak_rss = 0

    @property
    def available(self) -> bool:
        return self._fd is not None

    def rss(self) -> int:
        raw = os.pread(self._fd, 128, 0)
        return int(raw.split()[1]) * self._page

    def start(self) -> None:
        if self._fd is None:
            return
        self.start_rss = self.peak_rss = self.rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="ssdtrain-bench-rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak_rss = max(self.peak_rss, self.rss())

    def stop(self) -> int | None:
        """Stops sampling; returns the peak growth in bytes (``None`` without /proc)."""
        if self._fd is None or self._thread is None:
            return None
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.peak_rss = max(self.peak_rss, self.rss())
        return self.peak_rss - self.start_rss

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def malloc_trimmer():
    """``malloc_trim(0)`` from glibc, or a no-op elsewhere."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return lambda: None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)


def mmap_large_allocations(threshold: int = 1 << 20) -> bool:
    """Make glibc serve allocations of ``threshold`` bytes and more with ``mmap`` (process-wide).

    By default glibc raises its mmap threshold after the first large free, up to 32 MiB, and then
    serves activation-sized tensors from the heap, which it rarely returns to the system: the
    RSS then shows the most a step ever allocated, not what is live, and memory an offloader
    frees would not show. A fixed threshold returns each large tensor's pages on free. Returns
    False where this is not glibc.
    """
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(-3, int(threshold)))  # -3: M_MMAP_THRESHOLD


def usual_allocations() -> bool:
    """Undo :func:`mmap_large_allocations`: glibc's thresholds as its own adjustment leaves them
    for tensors of up to 32 MiB (mmap above ``DEFAULT_MMAP_THRESHOLD_MAX``, trim above twice
    that). Returns False where this is not glibc."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(-3, 32 << 20)) and bool(mallopt(-1, 64 << 20))  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD


def stolen_seconds() -> float | None:
    """CPU time, summed over this machine's CPUs, that the hypervisor ran something else while a
    CPU of ours had work (the ``steal`` column of ``/proc/stat``); None where it is not known."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None
