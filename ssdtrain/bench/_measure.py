"""Measuring helpers for ``ssdtrain bench``: saved-activation bytes and resident-set growth.

* :class:`SavedMeter` - a ``saved_tensors_hooks`` counter of the unique storages autograd holds
  for backward (parameters and buffers excluded), live until autograd releases them; peak and
  timeline. Used only in untimed steps.
* :class:`RssSampler` - this process's resident set from ``/proc/self/statm`` on a thread.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

import torch

__all__ = ["RecomputeMarks", "RssSampler", "SavedMeter", "block_saved_bytes"]


class _Held:
    """What the saved-bytes counter hands autograd: what was packed, and a release on collection."""

    __slots__ = ("packed", "meter", "key", "__weakref__")

    def __init__(self, packed: Any, meter: SavedMeter, key: int | None) -> None:
        self.packed, self.meter, self.key = packed, meter, key

    def __del__(self) -> None:
        if self.key is not None:
            self.meter._release(self.key)


def _on_device(packed: Any, device: torch.device) -> torch.Tensor | None:
    """The tensor in what a pack hook returned that still lives on ``device``, if any."""
    items = packed if isinstance(packed, (tuple, list)) else (packed,)
    for item in items:
        if isinstance(item, torch.Tensor) and item.device == device:
            return item
    return None


class SavedMeter:
    """Live bytes of unique storages saved for backward, with their peak and a timeline.

    Used in one untimed step per mode: timed steps run with no hooks at all. Parameters and
    buffers are excluded (they are not activations). A storage counts once however many saves
    (views) refer to it, until the last of them is released by autograd.

    ``inner`` is a ``saved_tensors_hooks`` object whose pack and unpack the meter runs (its own
    would shadow them: the innermost hooks win); then what counts is what its pack keeps on the
    saved tensor's device (``save_on_cpu`` on a GPU keeps nothing there; on the CPU, everything).
    """

    def __init__(self, model: torch.nn.Module, *, recompute_block_bytes: int = 0, inner: Any = None) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in model.parameters()}
        self._excluded |= {t.untyped_storage().data_ptr() for t in model.buffers()}
        self._live: dict[int, list[int]] = {}
        self._lock = threading.Lock()
        self.bytes = 0
        self.peak = 0
        self.t0 = time.perf_counter()
        self.timeline: list[tuple[float, int]] = [(self.t0, 0)]
        self._inner = inner
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._handles: list[Any] = []
        if recompute_block_bytes:
            self._block_bytes = recompute_block_bytes
            for block in model.blocks:
                self._handles.append(block.register_forward_pre_hook(self._block_pre))

    # saved_tensors_hooks
    def _pack(self, t: torch.Tensor) -> Any:
        if self._inner is None:
            key = self._acquire(t)
            return t if key is None else _Held(t, self, key)
        packed = self._inner.pack_hook(t)
        kept = _on_device(packed, t.device)
        return _Held(packed, self, None if kept is None else self._acquire(kept))

    def _unpack(self, held: Any) -> torch.Tensor:
        if self._inner is not None:
            return self._inner.unpack_hook(held.packed)
        return held.packed if isinstance(held, _Held) else held

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


class RecomputeMarks:
    """When each block is recomputed in backward (``+bytes``) and when its backward is done
    (``-bytes``), as ``(perf_counter, delta)`` events: what a recomputed block holds beside the
    saves of a mode with an offloader (Note [one peak saved for every mode])."""

    def __init__(self, model: torch.nn.Module, block_bytes: int) -> None:
        self.events: list[tuple[float, int]] = []
        self._bytes = block_bytes
        self._handles = [block.register_forward_pre_hook(self._pre) for block in model.blocks]

    def _pre(self, module: torch.nn.Module, args: tuple) -> None:
        # As SavedMeter's: the recomputation (in backward) adds the block; the gradient of the
        # block's input, hooked in forward, says its backward is done.
        if torch._C._current_graph_task_id() != -1:
            self.events.append((time.perf_counter(), self._bytes))
            module._ssdtrain_bench_marked = True
            return
        x = args[0] if args else None
        if not (isinstance(x, torch.Tensor) and x.requires_grad):
            return
        module._ssdtrain_bench_marked = False

        def done(grad: torch.Tensor) -> None:
            if getattr(module, "_ssdtrain_bench_marked", False):
                module._ssdtrain_bench_marked = False
                self.events.append((time.perf_counter(), -self._bytes))

        x.register_hook(done)

    def peak(self, points: list[tuple[float, int]]) -> int:
        """The most of ``points`` (``(perf_counter, saved bytes held)``) plus the recomputed blocks'
        bytes at any moment."""
        merged = sorted([(t, 0, b) for t, b in points] + [(t, 1, d) for t, d in self.events])
        held = extra = best = 0
        for _, kind, value in merged:
            if kind == 0:
                held = value
            else:
                extra += value
            best = max(best, held + max(0, extra))
        return best

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def block_saved_bytes(block: torch.nn.Module, batch: int, seq: int, hidden: int, dtype, device=None) -> int:
    """Unique bytes one block saves for backward (what recomputing it brings back)."""
    x = torch.randn(batch, seq, hidden, dtype=dtype, device=device, requires_grad=True)
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
        self._over: list = [None, None]  # the limit and what to call past it (start)

    @property
    def available(self) -> bool:
        return self._fd is not None

    def rss(self) -> int:
        raw = os.pread(self._fd, 128, 0)
        return int(raw.split()[1]) * self._page

    def start(self, limit: int | None = None, on_over: Callable[[int], None] | None = None) -> None:
        """Starts sampling. With ``limit``, ``on_over(growth)`` is called once, the first time the
        growth since now passes ``limit`` bytes: on the sampling thread, or at :meth:`stop` by its
        last sample (a step shorter than the interval passes it between two samples)."""
        if self._fd is None:
            return
        self.start_rss = self.peak_rss = self.rss()
        self._stop.clear()
        self._over = [limit, on_over]  # cleared once called
        self._thread = threading.Thread(target=self._run, args=(self._over,), name="ssdtrain-bench-rss",
                                        daemon=True)
        self._thread.start()

    def _check(self, over: list) -> None:
        limit, on_over = over
        if limit is not None and on_over is not None and self.peak_rss - self.start_rss > limit:
            over[:] = [None, None]
            on_over(self.peak_rss - self.start_rss)

    def _run(self, over: list) -> None:
        while not self._stop.wait(self.interval):
            self.peak_rss = max(self.peak_rss, self.rss())
            self._check(over)

    def stop(self) -> int | None:
        """Stops sampling; returns the peak growth in bytes (``None`` without /proc)."""
        if self._fd is None or self._thread is None:
            return None
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.peak_rss = max(self.peak_rss, self.rss())
        self._check(self._over)
        return self.peak_rss - self.start_rss

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
