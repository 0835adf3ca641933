"""Gradients on a GPU with offloading are ``torch.equal`` to those without: each backend, fp32 and
bf16, several steps, micro-batches in either backward order, a second stream, and slow streams
on both sides of the I/O (``torch.cuda._sleep``)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from _gpu import BACKENDS

import ssdtrain
from ssdtrain.tools.selftest import exact_gradients

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_exact_gradients(backend, dtype, tmp_path):
    name, setup = backend
    detail = exact_gradients(name, str(tmp_path), device="cuda", dtype=dtype, steps=3, setup=setup)
    if setup is not contextlib.nullcontext:
        assert "compat" in detail, detail  # kvikio's compat mode: staged through pinned memory


class _Sleep(torch.autograd.Function):
    """Holds the current stream for ``ms`` in forward and in backward: what comes after it on
    that stream (the producers of saved tensors; backward's consumers) runs late."""

    @staticmethod
    def forward(ctx, x, sleep, ms):
        ctx.sleep, ctx.ms = sleep, ms
        sleep(ms)
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        ctx.sleep(ctx.ms)
        return grad * 1, None, None


class _Net(torch.nn.Module):
    """Three blocks; the middle one optionally on a second stream; sleeps between blocks."""

    def __init__(self, dtype, sleep, *, second_stream: bool, ms: float) -> None:
        super().__init__()
        from ssdtrain.tools.selftest import TinyTransformer

        self.body = TinyTransformer(d=128, heads=4, layers=3).to(CUDA, dtype)
        self.sleep, self.ms = sleep, ms
        self.side = torch.cuda.Stream() if second_stream else None

    def forward(self, x):
        blocks = self.body.blocks
        x = blocks[0](_Sleep.apply(x, self.sleep, self.ms))
        if self.side is not None:
            main = torch.cuda.current_stream()
            self.side.wait_stream(main)
            with torch.cuda.stream(self.side):
                x = blocks[1](_Sleep.apply(x, self.sleep, self.ms))
            main.wait_stream(self.side)
            x.record_stream(main)
        else:
            x = blocks[1](_Sleep.apply(x, self.sleep, self.ms))
        x = blocks[2](_Sleep.apply(x, self.sleep, self.ms))
        return self.body.norm(x)


def _run(model, xs, off, *, order, wait: bool):
    """One step over micro-batches ``xs``: forwards in order, backwards in ``order``."""
    model.zero_grad(set_to_none=True)
    losses = []
    for i, x in enumerate(xs):
        torch.manual_seed(100 + i)
        ctx = off.microbatch(i) if off is not None else contextlib.nullcontext()
        with ctx:
            losses.append(model(x).float().square().mean())
    if off is not None and wait:
        off.wait()
    for i in order:
        if off is not None:
            off.prefetch(i)
        losses[i].backward()
    torch.cuda.synchronize()
    return [p.grad.clone() for p in model.parameters()]


def _exact_over_steps(model, xs, order, make_offloader):
    """Three steps with the offloader ``make_offloader()`` makes (writes waited for before
    backward in every other one), each ``torch.equal`` to a step without it, once two steps
    without it agreed; every live entry and extent is gone after ``wait()``. Returns the stats."""
    want = _run(model, xs, None, order=order, wait=False)
    again = _run(model, xs, None, order=order, wait=False)
    assert all(torch.equal(a, b) for a, b in zip(want, again)), "not deterministic without offloading"
    off = make_offloader()
    try:
        for step in range(3):
            got = _run(model, xs, off, order=order, wait=step % 2 == 0)
            for i, (a, b) in enumerate(zip(want, got)):
                assert torch.equal(a, b), f"step {step}: gradient {i} differs (max abs {(a - b).abs().max()})"
        off.wait()
        s = off.stats()
        assert s.written_bytes > 0 and s.read_bytes > 0, "nothing went through the drive"
        assert s.live_entries == 0 and s.live_disk_bytes == 0
        return s
    finally:
        off.close()


@pytest.mark.parametrize("order", [(0,), (1, 0), (0, 1)], ids=["one", "reverse", "forward-order"])
@pytest.mark.parametrize("second_stream", [False, True], ids=["one-stream", "two-streams"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_slow_streams_steps_and_microbatches(backend, dtype, second_stream, order, tmp_path, sleep):
    # Note [write waits for the producer]: producers run 20 ms after pack saw them.
    # Note [reload waits for the allocation point], Note [reload buffers belong to their consumer
    # stream]: backward's kernels (on one or two streams) run late behind sleeps while reload
    # buffers are allocated and freed on the host.
    name, setup = backend
    torch.manual_seed(0)
    model = _Net(dtype, sleep, second_stream=second_stream, ms=20)
    xs = [torch.randn(8, 64, 128, device=CUDA, dtype=dtype) for _ in range(max(order) + 1)]

    def make():
        with setup():
            return ssdtrain.Offloader(model, path=str(tmp_path), backend=name, min_bytes=0)

    _exact_over_steps(model, xs, order, make)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_small_saves_beside_offloaded_ones(backend, tmp_path, sleep):
    # Note [a small save skips the cache] on a GPU: min_bytes between the norms' statistics (2 KiB)
    # and the activations (128 KiB), so one step holds both kinds; two streams, sleeps, two
    # micro-batches backward in reverse order.
    name, setup = backend
    torch.manual_seed(0)
    model = _Net(torch.bfloat16, sleep, second_stream=True, ms=20)
    xs = [torch.randn(8, 64, 128, device=CUDA, dtype=torch.bfloat16) for _ in range(2)]
    smalls = []

    def make():
        with setup():
            off = ssdtrain.Offloader(model, path=str(tmp_path), backend=name, min_bytes=16 << 10)
        real_add = off._cache.small.add
        off._cache.small.add = lambda t, *a: smalls.append(t.device) or real_add(t, *a)
        return off

    s = _exact_over_steps(model, xs, (1, 0), make)
    assert smalls and all(d.type == "cuda" for d in smalls)
    assert s.resident_bytes == 0


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_offloading_lowers_device_memory(backend, tmp_path):
    # What offloading is for: after forward (and its writes), less device memory is held.
    name, setup = backend
    torch.manual_seed(0)
    from ssdtrain.tools.selftest import TinyTransformer

    model = TinyTransformer(d=256, heads=8, layers=4, p=0.0).to(CUDA)
    x = torch.randn(16, 256, 256, device=CUDA)

    def after_forward(off) -> int:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        with off if off is not None else contextlib.nullcontext():
            loss = model(x).square().mean()
            if off is not None:
                off.wait()  # inside: what is still queued when the block ends is kept
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        loss.backward()
        model.zero_grad(set_to_none=True)
        return held

    without = after_forward(None)
    with setup():
        off = ssdtrain.Offloader(model, path=str(tmp_path), backend=name, min_bytes=0)
    try:
        held = after_forward(off)
    finally:
        off.close()
    assert held < 0.5 * without, f"forward still holds {held} of {without} bytes"


def test_two_gpus_each_on_its_own_device(tmp_path):
    # Note [I/O threads set their device]: tensors on the second GPU go through I/O threads that
    # enter that device; the first GPU gets no work and no context from them.
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    dev = torch.device("cuda", 1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).to(dev)
    x = torch.randn(512, 256, device=dev)
    model(x).square().mean().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with torch.cuda.device(dev):
        off = ssdtrain.Offloader(model, path=str(tmp_path), backend="posix", min_bytes=0)
        try:
            with off:
                loss = model(x).square().mean()
                off.wait()  # inside: what is still queued when the block ends is kept
            loss.backward()
        finally:
            off.close()
    assert all(torch.equal(a, p.grad) for a, p in zip(want, model.parameters()))
