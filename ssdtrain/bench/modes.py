"""The bench's modes: one model, optimizer and (for the offload modes) offloader each.

* ``baseline`` - plain PyTorch, every activation stays in memory;
* ``recompute`` - ``torch.utils.checkpoint`` per block (``use_reentrant=False``);
* ``offload`` - :class:`ssdtrain.Offloader` on the model, default config;
* ``recompute+offload`` - checkpointing per block as ``recompute``, and an offloader with
  ``min_bytes=0`` around forward: what checkpointing keeps (each block's input) goes to the drive.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ssdtrain.bench._measure import RssSampler, SavedMeter
from ssdtrain.bench.drive import DriveLimit, make_store

__all__ = ["MODES", "OFFLOAD_MODES", "RECOMPUTE_MODES", "Mode", "Step", "Timeline", "offloader_factory"]

MODES = ("baseline", "recompute", "offload", "recompute+offload")
OFFLOAD_MODES = ("offload", "recompute+offload")
RECOMPUTE_MODES = ("recompute", "recompute+offload")
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
    """One mode's model, optimizer and offloader.

    ``make_offloader(model, fields)`` builds the offloader of an offload mode (with the bench's
    path and drive limit); ``fields`` are :data:`OFFLOAD_FIELDS` for the mode.
    """

    def __init__(self, name: str, model: torch.nn.Module,
                 make_offloader: Callable[[torch.nn.Module, dict], Any] | None = None) -> None:
        if name not in MODES:
            raise ValueError(f"unknown mode {name!r}; choose from {', '.join(MODES)}")
        self.name = name
        self.model = model
        model.recompute = name in RECOMPUTE_MODES
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.off = None
        if name in OFFLOAD_MODES:
            if make_offloader is None:
                import ssdtrain

                self.off = ssdtrain.Offloader(model, **OFFLOAD_FIELDS[name])
            else:
                self.off = make_offloader(model, dict(OFFLOAD_FIELDS[name]))

    def forward_backward(self, tokens, targets, marks: dict | None = None) -> float:
        """zero_grad, forward, backward, optimizer step; returns the loss. ``marks`` receives
        ``perf_counter`` times ``forward_end`` and ``backward_end``."""
        self.opt.zero_grad(set_to_none=True)
        if self.off is not None:
            with self.off:
                loss = self.model(tokens, targets)
        else:
            loss = self.model(tokens, targets)
        if marks is not None:
            marks["forward_end"] = time.perf_counter()
        loss.backward()
        if marks is not None:
            marks["backward_end"] = time.perf_counter()
        self.opt.step()
        return float(loss.detach())

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
        """A step with no instrumentation but the offloader's own counters."""
        before = self.off.stats() if self.off is not None else None
        if self.off is not None:
            self.off.reset_peak()
        marks: dict[str, float] = {}
        t0 = time.perf_counter()
        loss = self.forward_backward(tokens, targets, marks)
        end = time.perf_counter()
        step = Step(seconds=end - t0, forward=marks["forward_end"] - t0,
                    backward=marks["backward_end"] - marks["forward_end"], loss=loss, wait=self.drain())
        if self.off is not None:
            after = self.off.stats()
            step.peak_saved = after.peak_resident_bytes
            step.written = after.written_bytes - before.written_bytes
            step.read = after.read_bytes - before.read_bytes
            step.unique = after.unique_bytes - before.unique_bytes
            step.stall = after.stall_seconds - before.stall_seconds
        return step

    def measure_step(self, tokens, targets, block_bytes: int, sampler: RssSampler) -> tuple[int, Timeline, int | None]:
        """An untimed step recording saved bytes over time; returns (peak, timeline, RSS growth).

        Without an offloader the bytes are counted by a :class:`SavedMeter` (for the recompute
        modes with what checkpointing holds: each block's input, and ``block_bytes`` while a
        block is recomputed); with one, they are the offloader's ``peak_resident_bytes``.
        """
        marks: dict[str, float] = {}
        sampler.start()
        record = getattr(self.off, "record_timeline", None)
        if self.off is not None:
            self.off.reset_peak()
            points = record(True) if record else []
            t0 = time.perf_counter()
            self.forward_backward(tokens, targets, marks)
            end = time.perf_counter()
            self.drain()
            if record:
                record(False)
            peak = self.off.stats().peak_resident_bytes
            points = [(t - t0, b) for t, b in points if t >= t0]
        else:
            meter = SavedMeter(self.model, recompute_block_bytes=block_bytes if self.model.recompute else 0)
            t0 = meter.t0
            try:
                with meter:
                    self.forward_backward(tokens, targets, marks)
            finally:
                meter.close()
            end = time.perf_counter()
            peak = meter.peak
            points = [(t - t0, b) for t, b in meter.timeline]
        growth = sampler.stop()
        timeline = Timeline(points=[(0.0, points[0][1] if points else 0)] + points,
                            forward_end=marks["forward_end"] - t0,
                            backward_end=marks["backward_end"] - t0, step_end=end - t0)
        return peak, timeline, growth

    def close(self) -> None:
        if self.off is not None:
            self.off.close()
