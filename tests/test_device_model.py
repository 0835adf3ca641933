"""The modelled GPU (ssdtrain/device/model.py, model_streams.py, model_ops.py, rates.py): its
timeline, its costs, its memory counts, and the races it must catch.

Rates here are powers of two with no host costs unless a test says otherwise, so that the
timeline's arithmetic is exact.
"""

import dataclasses

import pytest
import torch

from ssdtrain.device.model import ModelledGPU, ModelledRace
from ssdtrain.device.model_ops import ModelledCompute
from ssdtrain.device.rates import H100, H200, Rates

EXACT = Rates(flops_per_s=2.0**30, hbm_bytes_per_s=2.0**30, d2h_bytes_per_s=2.0**20, h2d_bytes_per_s=2.0**20,
              pageable=0.5, launch_s=0.0, copy_issue_s=0.0, event_s=0.0, poll_s=0.0, pack_s=0.0, unpack_s=0.0)


def gpu(**kw) -> ModelledGPU:
    return ModelledGPU(EXACT, trace=True, **kw)


def spans(g: ModelledGPU, prefix: str) -> list[tuple[str, float, float]]:
    return [(s, a, b) for s, what, a, b in g.timeline if what.startswith(prefix)]


def offload(g: ModelledGPU, t: torch.Tensor, out):
    """Copies device ``t`` to a new pinned buffer on stream ``out``, after the compute stream's work."""
    pin = g.pinned_empty(t.nbytes).view(t.dtype).view(t.shape)
    out.wait_event(g.compute.record_event())
    g.copy(pin, t, out)
    return pin, out.record_event()


def test_presets_are_valid_and_validation_names_the_field():
    assert H200.d2h_bytes_per_s == 54.5e9 and H100.d2h_bytes_per_s == 54.7e9
    with pytest.raises(ValueError, match="Rates.hbm_bytes_per_s"):
        dataclasses.replace(H200, hbm_bytes_per_s=0)
    with pytest.raises(ValueError, match="Rates.pageable"):
        dataclasses.replace(H200, pageable=2)


def test_matmul_is_charged_its_flops_at_the_peak_rate():
    g = ModelledGPU(dataclasses.replace(EXACT, hbm_bytes_per_s=2.0**60), trace=True)
    m, n, k = 64, 32, 16
    with ModelledCompute(g):
        a, b = torch.ones(m, k), torch.ones(k, n)
        a @ b
    [(_, start, end)] = spans(g, "aten.mm")
    assert end - start == 2 * m * n * k / 2.0**30


def test_elementwise_op_is_charged_its_bytes_at_the_hbm_rate():
    g = gpu()
    with ModelledCompute(g):
        x = torch.ones(1024)
        x + x
    [(_, start, end)] = spans(g, "aten.add")
    assert end - start == 3 * 1024 * 4 / 2.0**30  # two reads of x, one write


def test_a_copy_queued_behind_compute_starts_after_it():
    g, = [gpu()]
    out = g.new_stream("out")
    with ModelledCompute(g):
        x = torch.ones(256, 256)
        y = x @ x
    offload(g, y, out)
    (_, _, mm_end), = spans(g, "aten.mm")
    (stream, start, end), = spans(g, "copy d2h")
    assert stream == "out" and start == mm_end and end == mm_end + y.nbytes / 2.0**20


def test_a_waited_event_delays_the_waiting_stream_and_sync_moves_the_host():
    g = gpu()
    side = g.new_stream("side")
    with ModelledCompute(g):
        x = torch.ones(1 << 16)
    pin, landed = offload(g, x, side)
    (_, _, ones_end), = spans(g, "aten.ones")
    copy_end = ones_end + 4 * (1 << 16) / 2.0**20
    assert landed.time == copy_end and g.host_now == 0 and not landed.query()
    g.compute.wait_event(landed)
    with ModelledCompute(g):
        x.mul_(2)
    (_, start, _), = spans(g, "aten.mul_")
    assert start == copy_end
    landed.synchronize()
    assert g.host_now == copy_end and landed.query()
    g.host(1.0)
    assert g.host_now == copy_end + 1.0


def test_the_same_program_gives_the_same_timeline():
    def run(seed: int, jitter: float):
        g = ModelledGPU(H200, seed, jitter=jitter, trace=True)
        out = g.new_stream("out")
        with ModelledCompute(g):
            x = torch.ones(64, 64)
            for _ in range(3):
                x = torch.tanh(x @ x)
                offload(g, x, out)
        g.synchronize()
        return g.timeline, g.host_now

    assert run(0, 0.0) == run(0, 0.0)
    assert run(7, 0.5) == run(7, 0.5) != run(8, 0.5)


def test_allocated_and_peak_follow_a_tensors_life():
    g = gpu()
    with ModelledCompute(g):
        a = torch.ones(1024)
        b = a * 2
        view = b[10:]
        assert g.allocated() == g.peak() == 8192
        del b
        assert g.allocated() == 8192  # the view keeps its storage
        del view, a
    assert g.allocated() == 0 and g.peak() == 8192
    g.reset_peak()
    assert g.peak() == 0
    e = g.empty(16)
    assert g.allocated() == 64 and e.isnan().all()  # uninitialised device memory is poison
    pin = g.pinned_empty(100)
    assert g.pinned_bytes() == 100 and g.kind(pin) == "pinned" and g.allocated() == 64


def test_a_copy_destination_is_poison_until_seen_done():
    g = gpu()
    out = g.new_stream("out")
    with ModelledCompute(g):
        x = torch.arange(8, dtype=torch.float32)
    pin, landed = offload(g, x, out)
    assert pin.isnan().all()
    landed.synchronize()
    assert torch.equal(pin, torch.arange(8, dtype=torch.float32))
    assert g.races == []


def test_an_integer_destination_reads_the_poison_pattern():
    g = gpu()
    with ModelledCompute(g):
        x = torch.arange(4, dtype=torch.int32)
    pin, _ = offload(g, x, g.new_stream("out"))
    assert torch.equal(pin.view(torch.uint8), torch.full((16,), 0x5A, dtype=torch.uint8))


def test_a_blocking_copy_makes_the_host_wait():
    g = gpu()
    with ModelledCompute(g):
        x = torch.ones(1 << 10)
    pin = g.pinned_empty(x.nbytes).view(torch.float32)
    g.copy(pin, x, non_blocking=False)
    (_, _, ones_end), = spans(g, "aten.ones")
    assert g.host_now == ones_end + 4096 / 2.0**20 and torch.equal(pin, torch.ones(1 << 10))
    host = torch.empty(1 << 10)  # not pinned: half the rate here, and the host waits
    g.copy(host, x)
    assert g.host_now == ones_end + 3 * 4096 / 2.0**20 and torch.equal(host, torch.ones(1 << 10))


def released_copy(g: ModelledGPU):
    """A device buffer offloaded to pinned memory and dropped before the compute stream waited
    for the copy; the host then sees the copy end. Returns the pinned copy."""
    with ModelledCompute(g):
        x = torch.ones(1 << 12)
    pin, done = offload(g, x, g.new_stream("out"))
    del x  # the compute stream never waited for the copy
    assert g.races == []  # nothing has read what the copy carried yet
    done.synchronize()
    return pin


def test_releasing_a_source_before_its_copy_ended_is_recorded_when_its_copy_is_read():
    # Note [a copy of released memory matters when read]
    g = gpu()
    pin = released_copy(g)
    with ModelledCompute(g):
        total = pin.sum()  # a host op reads the copy's bytes
    assert len(g.races) == 1 and "released" in g.races[0] and total.isnan()


def test_a_copy_of_released_memory_that_no_one_reads_is_no_race():
    # A dead save's copy to the pool, its extent never read (the soak's seed 1513).
    g = gpu()
    pin = released_copy(g)
    with ModelledCompute(g):
        y = torch.full((1 << 12,), 3.0)
    g.copy(pin, y, g.compute, non_blocking=False)  # the extent's next copy in writes over it
    with ModelledCompute(g):
        assert pin.sum().item() == 3.0 * (1 << 12)
    assert g.races == []


def test_with_strict_a_race_raises_at_the_next_call():
    g = gpu(strict=True)
    pin = released_copy(g)
    with ModelledCompute(g):
        pin.sum()
    with pytest.raises(ModelledRace, match="released"):
        g.host(0.0)
    g.host(0.0)  # raised once


def test_the_right_order_records_nothing_and_gives_the_right_gradient():
    assert _round_trip(early=False) == ([], True)


def test_a_wait_one_event_early_is_caught_and_poisons_the_result():
    races, right = _round_trip(early=True)
    assert not right and any("reads a buffer before copy h2d" in r for r in races)


def _round_trip(early: bool) -> tuple[list[str], bool]:
    """Forward saves ``h``, offloads it and drops it; backward reads it back into a fresh buffer
    on the copy-in stream and the compute stream uses it after waiting for an event recorded
    after the copy (or, ``early``, for one recorded just before it)."""
    g = gpu()
    out, back = g.new_stream("out"), g.new_stream("in")
    w = torch.full((8, 8), 0.5, requires_grad=True)
    g.adopt(w)
    with ModelledCompute(g):
        h = torch.tanh(torch.ones(8, 8) @ w.detach())
        pin, landed = offload(g, h, out)
        g.compute.wait_event(landed)  # before h dies: the release is ordered after the copy
        del h
        buf = g.empty(8, 8)
        back.wait_event(g.compute.record_event())  # the buffer's allocation point
        before = back.record_event()
        g.copy(buf, pin, back)
        g.record_stream(buf, back)
        after = back.record_event()
        g.compute.wait_event(before if early else after)
        loss = (buf.detach().requires_grad_() * w).sum()
        loss.backward()
    expected = torch.tanh(torch.ones(8, 8) @ torch.full((8, 8), 0.5))
    return g.races, torch.equal(w.grad, expected)


def test_a_copy_that_does_not_wait_for_its_producer_is_recorded():
    g = gpu()
    side, out = g.new_stream("side"), g.new_stream("out")
    with ModelledCompute(g):
        x = torch.ones(16)
        with g.stream(side):
            y = x * 3  # produced on the side stream
    pin = g.pinned_empty(y.nbytes).view(torch.float32)
    out.wait_event(g.compute.record_event())  # the wrong producer
    g.copy(pin, y, out)
    out.synchronize()
    assert any("written on side" in r for r in g.races) and pin.isnan().all()


def test_a_byte_view_made_with_set_writes_nothing():
    # The engine's byte view of a save (``empty(0).set_(storage, ...)``) after its producer fence:
    # re-pointing a tensor is no kernel, so a copy ordered after the producer alone is no race.
    g = gpu()
    out = g.new_stream("out")
    with ModelledCompute(g):
        x = torch.ones(16) * 2
        out.wait_event(g.compute.record_event())  # the producer fence
        view = torch.empty(0, dtype=torch.uint8).set_(x.untyped_storage(), 0, (x.nbytes,), (1,))
    pin = g.pinned_empty(x.nbytes)
    g.copy(pin, view, out)
    out.synchronize()
    assert g.races == [] and torch.equal(pin.view(torch.float32), torch.full((16,), 2.0))


def test_overwriting_a_source_a_copy_still_reads_is_recorded():
    g = gpu()
    with ModelledCompute(g):
        x = torch.ones(16)
    pin, landed = offload(g, x, g.new_stream("out"))
    with ModelledCompute(g):
        x.fill_(5.0)  # the compute stream did not wait for the copy
    landed.synchronize()
    assert any("overwrites" in r for r in g.races) and pin.isnan().all()


def test_copy_under_the_mode_and_item_wait_on_the_host():
    g = gpu()
    out = g.new_stream("out")
    with ModelledCompute(g):
        x = torch.full((1 << 10,), 2.0)
        pin = g.pinned_empty(x.nbytes).view(torch.float32)
        out.wait_event(g.compute.record_event())
        with g.stream(out):
            pin.copy_(x, non_blocking=True)  # a copy_ between device and host is a modelled copy
        assert g.host_now == 0 and g.races == []
        assert pin.isnan().all()  # the host reads before it synchronised: poison, and recorded
        assert g.races and all(r.startswith("host op") for r in g.races)
        total = x.sum().item()
    assert total == 2048.0 and g.host_now > 0
