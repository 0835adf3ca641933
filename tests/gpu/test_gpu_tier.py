"""The host tier on a GPU: exact gradients through pinned host memory (fp32, bf16; slow streams,
micro-batches backward in reverse), spills to the drive when the tier is full, a failing drive
behind a full tier, and the device peak lowered in stream order (Note [a tier copy is released in
stream order])."""

from __future__ import annotations

import pytest
import torch

import ssdtrain
from test_gpu_equivalence import CUDA, _exact_over_steps, _Net

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _net(dtype, sleep, second_stream, n):
    torch.manual_seed(0)
    model = _Net(dtype, sleep, second_stream=second_stream, ms=20)
    xs = [torch.randn(8, 64, 128, device=CUDA, dtype=dtype) for _ in range(n)]
    return model, xs


@pytest.mark.parametrize("order", [(0,), (1, 0)], ids=["one", "reverse"])
@pytest.mark.parametrize("second_stream", [False, True], ids=["one-stream", "two-streams"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tier_exact(dtype, second_stream, order, tmp_path, sleep):
    model, xs = _net(dtype, sleep, second_stream, max(order) + 1)

    def make():
        return ssdtrain.Offloader(model, path=str(tmp_path), min_bytes=0, host_bytes="64MiB")

    s = _exact_over_steps(model, xs, order, make)
    assert s.host_copied_bytes > 0 and s.host_read_bytes > 0
    assert s.host_tier_peak_bytes <= s.host_tier_pinned_bytes <= 64 << 20
    # The drive took only what the tier could not (a full pool, or a slab still being pinned).
    assert sum(s.written_bytes_by_path.values()) <= s.spilled_bytes


@pytest.mark.parametrize("copies", ["runtime", "torch"])
def test_tier_copies_through_the_runtime_or_torch_are_exact(copies, tmp_path, sleep, monkeypatch):
    # Note [the copy thread issues copies without the GIL], Note [reads back are issued without
    # the GIL too]: the direct calls, both ways, are what runs here (torch's wheels load
    # libcudart), and torch's way, the fallback, is exact as well.
    from ssdtrain.device import copies as device_copies
    if copies == "torch":
        monkeypatch.setattr(device_copies, "_runtime", False)
    model, xs = _net(torch.bfloat16, sleep, True, 2)

    def make():
        return ssdtrain.Offloader(model, path=str(tmp_path), min_bytes=0, host_bytes="64MiB")

    s = _exact_over_steps(model, xs, (1, 0), make)
    assert s.host_copied_bytes > 0
    assert (device_copies._runtime is not False) == (copies == "runtime"), device_copies._runtime


def test_tier_copies_made_on_the_copy_threads_are_exact(tmp_path, sleep):
    # Note [copies are made where they are handed over]: the other tests make the copies where
    # they are handed over (the training thread's and autograd's side streams, the default); the
    # copy threads (torch's fallback, the overhead stage's comparison) are ordered by the same fences.
    model, xs = _net(torch.bfloat16, sleep, True, 2)

    def make():
        off = ssdtrain.Offloader(model, path=str(tmp_path), min_bytes=0, host_bytes="64MiB")
        off._tier.inline_copies(False)
        return off

    s = _exact_over_steps(model, xs, (1, 0), make)
    assert s.host_copied_bytes > 0 and s.host_read_bytes > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tier_full_spills_to_the_drive(dtype, tmp_path, sleep):
    model, xs = _net(dtype, sleep, False, 2)

    def make():
        return ssdtrain.Offloader(model, path=str(tmp_path), min_bytes=0, host_bytes="256KiB")

    s = _exact_over_steps(model, xs, (1, 0), make)
    assert s.spilled_bytes > 0 and sum(s.written_bytes_by_path.values()) > 0
    assert s.host_tier_peak_bytes <= 256 << 10


def test_tier_full_and_a_failing_drive(tmp_path, sleep, monkeypatch):
    from ssdtrain.store import posix

    def broken(fd, data, offset):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(posix, "_pwrite", broken)
    model, xs = _net(torch.float32, sleep, False, 1)
    from test_gpu_equivalence import _run
    want = _run(model, xs, None, order=(0,), wait=False)
    off = ssdtrain.Offloader(model, path=str(tmp_path), min_bytes=0, host_bytes="256KiB", on_error="keep")
    try:
        with pytest.warns(RuntimeWarning, match="a write failed"):
            got = _run(model, xs, off, order=(0,), wait=True)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        s = off.stats()
        assert s.failed_writes > 0 and s.host_copied_bytes > 0
    finally:
        off.close()


def _slow_layers():
    """12 layers of 2048 at 4096 rows, bf16, and a step of them that sleeps between layers: the
    step's peak above its start and the weights' gradients."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(2048, 2048, device=CUDA, dtype=torch.bfloat16) for _ in range(12))
    x = torch.randn(4096, 2048, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    return layers, x


def _slow_step(layers, x, off, sleep):
    for p in layers.parameters():
        p.grad = None
    x.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    with off if off is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        y = x
        for layer in layers:
            sleep(5)
            y = torch.nn.functional.gelu(layer(y))
        loss = y.float().square().mean()
    loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start, [p.grad.clone() for p in layers.parameters()]


SAVED = 12 * 2 * 4096 * 2048 * 2  # each layer saves its input and its output's pre-activation


def test_tier_lowers_the_device_peak(tmp_path, sleep):
    """A slow forward (sleeps between layers): once the copy clock has learned the copy rate and
    forward's time, the saves are released in stream order before forward ends, and the step's
    device peak falls by most of what they hold."""
    layers, x = _slow_layers()
    base_peak, want = _slow_step(layers, x, None, sleep)
    off = ssdtrain.Offloader(layers, path=str(tmp_path), host_bytes="2GiB")
    try:
        for _ in range(40):  # until the clock has both rates (the copy rate is measured in the background)
            _slow_step(layers, x, off, sleep)
            off.wait()
            if off._tier.clock.ratio is not None:
                break
        assert off._tier.clock.ratio is not None, "the copy clock never learned its rates"
        peak, got = _slow_step(layers, x, off, sleep)
        s = off.stats()
    finally:
        off.close()
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert base_peak - peak >= 0.25 * SAVED, (base_peak, peak, SAVED)
    assert s.host_tier_peak_bytes <= 2 << 30


def test_no_step_keeps_everything_where_there_is_no_room(tmp_path, sleep, monkeypatch):
    """Note [the reference forward needs room]: with no room above the last peak for what the
    tier took off it, no forward is measured with no copy: every step's peak stays low (the tier
    copies what it can, due by the forward before), a warning says so once, gradients exact."""
    from ssdtrain.host import copy_clock

    monkeypatch.setattr(ssdtrain.device.measure, "room_above_peak", lambda *args: 0)
    # These copies (7 ms in a 60 ms forward) are cheap: no forward would be made to copy nothing
    # (the test below). Here every forward's copies count as dear, so the room decides.
    monkeypatch.setattr(copy_clock, "CHEAP_SHARE", 0.0)
    layers, x = _slow_layers()
    base_peak, want = _slow_step(layers, x, None, sleep)
    off = ssdtrain.Offloader(layers, path=str(tmp_path), host_bytes="2GiB")
    peaks = []
    try:
        with pytest.warns(RuntimeWarning, match="no room to measure a forward"):
            for _ in range(40):
                peak, got = _slow_step(layers, x, off, sleep)
                off.wait()
                peaks.append(peak)
                if off._tier.clock.deferred >= 4:
                    break
        clock = off._tier.clock
        assert clock.deferred >= 4 and clock.reference is None and clock.limit is None
        assert clock.ratio is not None  # due positions from the forward before: released in stream order
    finally:
        off.close()
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    # The last three steps (due positions known) copied: none kept all on the device.
    assert max(peaks[-3:]) <= base_peak - 0.25 * SAVED, (base_peak, peaks)


def test_cheap_copies_never_make_a_forward_keep_everything(tmp_path, sleep):
    """Note [a forward whose copies are cheap is its own reference]: the slow layers' copies take
    about 7 ms of a 60 ms forward, so a forward that copied them all is the reference: no step
    keeps everything on the device (at a length that only trains with the tier, such a step ran
    out of memory), every step's peak falls, gradients exact."""
    layers, x = _slow_layers()
    base_peak, want = _slow_step(layers, x, None, sleep)
    off = ssdtrain.Offloader(layers, path=str(tmp_path), host_bytes="2GiB")
    peaks, copied = [], []
    try:
        for _ in range(6):
            before = off.stats().host_copied_bytes
            peak, got = _slow_step(layers, x, off, sleep)
            off.wait()
            peaks.append(peak)
            copied.append(off.stats().host_copied_bytes - before)
        clock = off._tier.clock
        assert clock.reference is not None and clock.deferred == 0, (clock.reference, clock.deferred)
    finally:
        off.close()
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert min(copied) >= 0.5 * SAVED, copied
    assert max(peaks) <= base_peak - 0.25 * SAVED, (base_peak, peaks)


def test_room_above_peak_follows_the_peak_and_the_fraction():
    from ssdtrain.device import measure

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = measure.room_above_peak(CUDA)
    t = torch.empty(256 << 20, dtype=torch.uint8, device=CUDA)
    after = measure.room_above_peak(CUDA)
    assert (200 << 20) <= before - after <= (300 << 20), (before, after)
    total = torch.cuda.get_device_properties(CUDA).total_memory
    try:
        torch.cuda.set_per_process_memory_fraction((torch.cuda.max_memory_allocated() + (1 << 30)) / total, 0)
        assert measure.room_above_peak(CUDA) <= (1 << 30) + (1 << 20)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)  # an index: torch 2.11 refuses 'cuda'
    del t


def test_probe_measures_the_host_tiers_copy_rates():
    from ssdtrain.tools import probe

    r = probe.host_rates(64 << 20)
    assert r["device"] == torch.cuda.get_device_name()
    # PCIe 3.0 x16 and up carry well over 5 GB/s each way; both at once, no more than one alone (x1.2).
    assert r["d2h_gbps"] > 5 and r["h2d_gbps"] > 5
    assert 1 < r["both_ways_gbps_each"] <= 1.2 * max(r["d2h_gbps"], r["h2d_gbps"])
    assert "device to host" in probe.format_host(r)


def test_a_fresh_offloaders_first_step_lowers_the_peak(tmp_path, sleep):
    """Note [the first step's saves find the pool pinned]: a fresh Offloader's first step already
    copies to the pool (its first slab pinned at the first save, not in the background while that
    step's saves went to the drive): the first step's peak falls too, gradients exact. A user at
    a length only the tier makes fit does not run out of memory on step 1."""
    layers, x = _slow_layers()
    base_peak, want = _slow_step(layers, x, None, sleep)
    off = ssdtrain.Offloader(layers, path=str(tmp_path), host_bytes="2GiB")
    try:
        peak, got = _slow_step(layers, x, off, sleep)
        off.wait()
        s = off.stats()
    finally:
        off.close()
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert s.host_copied_bytes >= 0.5 * SAVED, (s.host_copied_bytes, s.spilled_bytes)
    assert peak <= base_peak - 0.25 * SAVED, (base_peak, peak)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_checkpoints_beyond_host_bytes_spill_to_the_drive_exactly(dtype, tmp_path):
    """recompute+offload on the bench's GPT whose block inputs are four times ``host_bytes``
    (issue 50, item 4; its CPU twin is in tests/test_tier.py): exact over three steps, the tier
    full, the drive taking the rest, and what went where in ``stats()``. Deterministic algorithms
    on: without them two runs of this GPT without offloading differ on a GPU (H200, 2026-11-28:
    every gradient in fp32), so there would be nothing exact to compare with."""
    from ssdtrain.bench.models import GPT, GPTConfig

    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _spill_exactly(dtype, tmp_path, GPT, GPTConfig)
    finally:
        torch.use_deterministic_algorithms(was)


def _spill_exactly(dtype, tmp_path, GPT, GPTConfig):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=1024, seq=2048, layers=16, hidden=256, heads=4, loss_chunk=512)
    model = GPT(cfg, recompute=True).to(CUDA, dtype)
    tok = torch.randint(0, 1024, (2, 2048), device=CUDA)
    checkpoints = cfg.layers * 2 * 2048 * 256 * dtype.itemsize

    def run(off, wait):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        with off if off is not None else torch.enable_grad():
            loss = model(tok, tok)
            if wait and off is not None:
                off.wait()
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    want = run(None, False)
    again = run(None, False)
    assert all(torch.equal(a, b) for a, b in zip(want, again)), "not deterministic without offloading"
    host = checkpoints // 4
    off = ssdtrain.Offloader(model, path=str(tmp_path), min_bytes=0, host_bytes=host)
    try:
        for i in range(3):
            got = run(off, i % 2 == 0)
            assert all(torch.equal(a, b) for a, b in zip(want, got)), f"step {i} differs"
        s = off.stats()
    finally:
        off.close()
    assert s.host_tier_peak_bytes <= host and s.host_copied_bytes > 0
    assert s.spilled_bytes > 0 and sum(s.written_bytes_by_path.values()) > 0
    print(f"spilled {s.spilled_bytes >> 20} MiB, host tier {s.host_copied_bytes >> 20} MiB, "
          f"read waits {s.read_stall_seconds * 1e3:.1f} ms")
