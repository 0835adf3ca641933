"""The bench's modes: one model, optimizer and (for the offload modes) offloader each.

* ``baseline`` - plain PyTorch, every activation stays in memory;
* ``recompute`` - ``torch.utils.checkpoint`` per block (``use_reentrant=False``);
* ``offload`` - :class:`ssdtrain.Offloader` on the model, default config;
* ``recompute+offload`` - checkpointing per block as ``recompute``, and an offloader with
  ``min_bytes=0`` around forward: what checkpointing keeps (each block's input) goes to the drive;
* ``save_on_cpu`` - ``torch.autograd.graph.save_on_cpu`` around forward, the host-RAM peer: on a
  GPU with ``pin_memory=True`` (every saved tensor, weights included, is copied to pinned host
  memory and back); on the CPU with ``pin_memory=False``, where it copies nothing (a tensor
  already on the CPU is kept as it is), so the mode costs only its hooks and holds what baseline
  holds: a check on the hooks' overhead, not a way to save memory there.

The model's device (its parameters') is the mode's: the offloader follows the tensors it is
given (``ssdtrain/device/cuda.py``), built as a GPU user builds it, ``Offloader(model, path=...)``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ssdtrain.bench import _device
from ssdtrain.bench._measure import RecomputeMarks, RssSampler, SavedMeter
from ssdtrain.bench.drive import DriveLimit, make_store

__all__ = ["MODES", "OFFLOAD_MODES", "PEERS", "RECOMPUTE_MODES", "Mode", "Step", "Timeline", "offloader_factory"]

MODES = ("baseline", "recompute", "offload", "recompute+offload", "save_on_cpu")
OFFLOAD_MODES = ("offload", "recompute+offload")
RECOMPUTE_MODES = ("recompute", "recompute+offload")
PEERS = ("baseline", "recompute", "save_on_cpu")
"""The modes without ssdtrain that every mode is compared with, where they ran."""
OFFLOAD_FIELDS = {"offload": {}, "recompute+offload": {"min_bytes": 0}}
"""Offloader settings per offload mode, on top of the default config."""


@dataclass
class Step:
    """One timed step of one mode."""

    seconds: float
    forward: float
    """From the step's start to the end of forward (``with off:`` left)."""
    backward: float
    """``loss.backward()`` (and the optimizer step is outside it)."""
    loss: float
    wait: float = 0.0
    """After the step, untimed: the time ``off.wait()`` took (writes of this step not done yet)."""
    peak_saved: int | None = None
    written: int = 0
    read: int = 0
    unique: int = 0
    """Bytes of distinct storages saved in forward (the offloader's count)."""
    left: int = 0
    """Of those, bytes on storage and out of memory when forward ended (``peak_fall_bytes``)."""
    stall: float = 0.0


@dataclass
class Timeline:
    """Saved bytes in memory over one untimed step, with forward's and backward's ends."""

    points: list[tuple[float, int]] = field(default_factory=list)
    forward_end: float = 0.0
    backward_end: float = 0.0
    step_end: float = 0.0


def offloader_factory(path: str | None, limit: DriveLimit | None) -> Callable[[torch.nn.Module, dict], Any]:
    """``make_offloader`` for :class:`Mode`: offloaders at ``path`` (None: the config's default),
    on a drive limited by ``limit`` where that is done in the backend."""
    def make(model: torch.nn.Module, fields: dict) -> Any:
        import ssdtrain
        from ssdtrain.config import OffloadConfig

        config = OffloadConfig(**({"path": path} if path else {}), **fields)
        return ssdtrain.Offloader(model, config=config, store=make_store(config, limit))
    return make


class Mode:
    """One mode's model, optimizer and offloader (or ``save_on_cpu`` hooks), on the model's device.

    ``make_offloader(model, fields)`` builds the offloader of an offload mode (with the bench's
    path and drive limit); ``fields`` are :data:`OFFLOAD_FIELDS` for the mode.
    """

    def __init__(self, name: str, model: torch.nn.Module,
                 make_offloader: Callable[[torch.nn.Module, dict], Any] | None = None) -> None:
        if name not in MODES:
            raise ValueError(f"unknown mode {name!r}; choose from {', '.join(MODES)}")
        self.name = name
        self.model = model
        self.device = next(model.parameters()).device
        model.recompute = name in RECOMPUTE_MODES
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.off = None
        self.pin_memory = name == "save_on_cpu" and self.device.type == "cuda"
        if name in OFFLOAD_MODES:
            if make_offloader is None:
                import ssdtrain

                self.off = ssdtrain.Offloader(model, **OFFLOAD_FIELDS[name])
            else:
                self.off = make_offloader(model, dict(OFFLOAD_FIELDS[name]))

    def hooks(self) -> Any:
        """What forward runs in: the offloader, ``save_on_cpu``'s hooks, or nothing."""
        if self.off is not None:
            return self.off
        if self.name == "save_on_cpu":
            return torch.autograd.graph.save_on_cpu(pin_memory=self.pin_memory)
        return contextlib.nullcontext()

    def forward_backward(self, tokens, targets, marks: _device.Marks | None = None,
                         hooks: Any = None) -> torch.Tensor:
        """zero_grad, forward, backward, optimizer step; returns the loss, detached (reading it
        would wait for the device). ``marks`` receives ``forward_end`` and ``backward_end``;
        ``hooks`` replaces :meth:`hooks` around forward."""
        self.opt.zero_grad(set_to_none=True)
        with self.hooks() if hooks is None else hooks:
            loss = self.model(tokens, targets)
        if marks is not None:
            marks.mark("forward_end")
        loss.backward()
        if marks is not None:
            marks.mark("backward_end")
        self.opt.step()
        return loss.detach()

    def drain(self) -> float:
        """Between steps, untimed: waits for the writes still in flight (a training loop never
        does; the drive then carries them into the next step), so that modes alternated in one
        process do not share the drive. Returns the seconds it took."""
        if self.off is None:
            return 0.0
        start = time.perf_counter()
        self.off.wait()
        return time.perf_counter() - start

    def timed_step(self, tokens, targets) -> Step:
        """A step with no instrumentation but the offloader's own counters; on a GPU it starts
        and ends with a synchronize (Note [timing a GPU step] in ``_device.py``)."""
        before = self.off.stats() if self.off is not None else None
        if self.off is not None:
            self.off.reset_peak()
        marks = _device.Marks(self.device)
        _device.synchronize(self.device)
        t0 = time.perf_counter()
        marks.mark("start")
        loss = self.forward_backward(tokens, targets, marks)
        _device.synchronize(self.device)
        end = time.perf_counter()
        step = Step(seconds=end - t0, forward=marks.seconds("start", "forward_end"),
                    backward=marks.seconds("forward_end", "backward_end"), loss=float(loss), wait=self.drain())
        if self.off is not None:
            after = self.off.stats()
            step.peak_saved = after.peak_resident_bytes
            step.written = after.written_bytes - before.written_bytes
            step.read = after.read_bytes - before.read_bytes
            step.unique = after.unique_bytes - before.unique_bytes
            step.left = after.peak_fall_bytes
            step.stall = after.stall_seconds - before.stall_seconds
        return step

    def measure_step(self, tokens, targets, block_bytes: int, sampler: RssSampler) -> tuple[int, Timeline, dict]:
        """An untimed step recording saved bytes over time; returns (peak, timeline, memory):
        ``memory`` holds ``rss_growth_bytes`` and, on a GPU, ``max_memory_allocated_bytes``,
        ``memory_allocated_start_bytes`` (weights, optimizer state and batch, gradients freed)
        and ``pinned_host_peak_bytes`` (Note [peak device memory per step] in ``_device.py``).

        Note [one peak saved for every mode]: the peak, over the step, of the saved bytes held in
        memory plus, with checkpointing, ``block_bytes`` while a block is recomputed. Without an
        offloader the saves are counted by a :class:`SavedMeter` around forward (for the
        recompute modes what checkpointing holds: each block's input; for ``save_on_cpu`` what
        its hooks keep on the model's device); with one, they are the offloader's resident bytes
        over time, and :class:`RecomputeMarks` adds the recomputed blocks when they run (not at
        the offloader's peak, which comes before any: recompute+offload showed x1.46 of
        recompute's peak saved on the quick bench while its resident growth was lower).
        """
        marks = _device.Marks(self.device)
        self.opt.zero_grad(set_to_none=True)  # the previous step's gradients do not count
        start_bytes = _device.reset_memory_peaks(self.device)
        sampler.start()
        record = getattr(self.off, "record_timeline", None)
        if self.off is not None:
            self.off.reset_peak()
            points = record(True) if record else []
            recomputed = RecomputeMarks(self.model, block_bytes) if self.model.recompute and record else None
            marks.mark("start")
            try:
                self.forward_backward(tokens, targets, marks)
                _device.synchronize(self.device)
            finally:
                if recomputed is not None:
                    recomputed.close()
            end = time.perf_counter()
            self.drain()
            if record:
                record(False)
            peak = self.off.stats().peak_resident_bytes
            t0 = marks["start"]
            if recomputed is not None:
                start = self.off.stats().resident_bytes if not points else points[0][1]
                peak = recomputed.peak([(t0, start)] + [(t, b) for t, b in points if t >= t0])
            points = [(t - t0, b) for t, b in points if t >= t0]
        else:
            inner = self.hooks() if self.name == "save_on_cpu" else None
            meter = SavedMeter(self.model, recompute_block_bytes=block_bytes if self.model.recompute else 0,
                               inner=inner)
            t0 = meter.t0
            try:
                self.forward_backward(tokens, targets, marks, hooks=meter)
                _device.synchronize(self.device)
            finally:
                meter.close()
            end = time.perf_counter()
            peak = meter.peak
            points = [(t - t0, b) for t, b in meter.timeline]
        memory = {"rss_growth_bytes": sampler.stop(), "memory_allocated_start_bytes": start_bytes,
                  **_device.memory_peaks(self.device)}
        timeline = Timeline(points=[(0.0, points[0][1] if points else 0)] + points,
                            forward_end=marks["forward_end"] - t0,
                            backward_end=marks["backward_end"] - t0, step_end=end - t0)
        return peak, timeline, memory

    def close(self) -> None:
        if self.off is not None:
            self.off.close()
