"""Shared harness: run a training step with and without an offloader and compare bit for bit."""

from __future__ import annotations

from collections.abc import Callable

import torch

import ssdtrain


def step(model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor], off: ssdtrain.Offloader | None, *,
         seed: int = 1234, wait: bool = False, inputs: list[torch.Tensor] = ()) -> tuple[torch.Tensor, list]:
    """One forward/backward; returns the loss and every gradient (parameters, then inputs)."""
    model.zero_grad(set_to_none=True)
    for x in inputs:
        x.grad = None
    torch.manual_seed(seed)
    if off is None:
        loss = loss_fn()
    else:
        with off:
            loss = loss_fn()
            if wait:
                # Every write lands before backward begins (after it, adaptive keep would cancel
                # what is still queued: on a busy machine that can be everything), so backward
                # reads everything back.
                off.wait()
    loss.backward()
    grads = [p.grad for p in model.parameters()] + [x.grad for x in inputs]
    return loss.detach(), [None if g is None else g.clone() for g in grads]


def assert_same(a: tuple, b: tuple) -> None:
    la, ga = a
    lb, gb = b
    assert torch.equal(la, lb), f"loss differs: {la} vs {lb}"
    assert len(ga) == len(gb)
    for i, (x, y) in enumerate(zip(ga, gb)):
        assert (x is None) == (y is None), f"gradient {i}: one is None"
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), f"gradient {i} differs (max abs {(x - y).abs().max()})"


def check_equivalent(model, loss_fn, off_dir, *, steps: int = 2, inputs=(), expect_io: bool = True, **overrides):
    """Baseline vs offloaded, ``steps`` times with one Offloader (alternating ``wait``); returns stats."""
    inputs = list(inputs)
    base = step(model, loss_fn, None, inputs=inputs)
    # late_writes: every save is offered to the drive, so that the paths under test do I/O whatever
    # this machine's forward and drive are doing right now (Note [write what leaves before the
    # peak] would keep what the drive could not finish in time; tests/test_peak.py tests it).
    cfg = dict(path=str(off_dir), min_bytes=0, late_writes=True)
    cfg.update(overrides)
    off = ssdtrain.Offloader(model, **cfg)
    try:
        for i in range(steps):
            got = step(model, loss_fn, off, wait=i % 2 == 1, inputs=inputs)
            assert_same(base, got)
        off.wait()  # writes of freed entries still in flight give their extents back when done
        stats = off.stats()
        if expect_io:
            assert stats.written_bytes > 0, "nothing was offloaded: the test would prove nothing"
            assert stats.read_bytes > 0, "nothing was read back: the test would prove nothing"
        assert stats.live_entries == 0 and stats.live_disk_bytes == 0, (
            f"entries or extents leaked: {stats.live_entries} entries, {stats.live_disk_bytes} bytes on disk")
    finally:
        off.close()
    assert list(off_dir.iterdir()) == [], "files left behind"
    return stats


def exact_steps(model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor], off: ssdtrain.Offloader,
                steps: int = 3) -> object:
    """``steps`` steps through ``off`` (every other one waiting for its writes before backward),
    each's loss and gradients equal to a step without it; then ``off`` is waited for, closed, and
    its stats returned."""
    base = step(model, loss_fn, None)
    try:
        for i in range(steps):
            assert_same(base, step(model, loss_fn, off, wait=i % 2 == 0))
        off.wait()
        return off.stats()
    finally:
        off.close()
