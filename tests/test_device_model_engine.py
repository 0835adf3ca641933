"""The engine's GPU path on the modelled GPU (``ssdtrain.device.model.modelled``): the seam answers
for the model (Note [the seam answers for the modelled GPU] in ``ssdtrain/device/cuda.py``), and an
Offloader with the host tier on trains the bench's GPT exactly, in stream order, deterministically.
"""

import pytest
import torch

import ssdtrain
from ssdtrain.bench.models import GPT, GPTConfig
from ssdtrain.device import copies, measure
from ssdtrain.device import cuda as seam
from ssdtrain.device.model import ModelledGPU, modelled
from ssdtrain.device.model_ops import ModelledCompute
from ssdtrain.device.rates import H100

CFG = GPTConfig(vocab=128, seq=32, layers=2, hidden=64, heads=4)
HOST_BYTES = 8 << 20  # under the 64 MiB the tier's rate probe takes: no rate, every copy due at once


def step(*, offload: bool, recompute: bool = False, seed: int = 0, host_bytes: int = HOST_BYTES):
    """One training step of a tiny GPT on a modelled H100: the GPU, the loss, the gradients and the
    offloader's stats (``None`` without offloading), with what the pool held after backward."""
    torch.manual_seed(0)
    model = GPT(CFG, recompute=recompute)
    x, y = torch.randint(0, CFG.vocab, (2, CFG.seq)), torch.randint(0, CFG.vocab, (2, CFG.seq))
    gpu = ModelledGPU(H100, seed=seed, jitter=0.1, trace=True)
    stats = pool_left = None
    with modelled(gpu):
        gpu.adopt(*model.parameters(), x, y)
        off = ssdtrain.Offloader(model, min_bytes=0, backend="memory", host_bytes=host_bytes) if offload else None
        with ModelledCompute(gpu):
            if off is not None:
                with off:
                    loss = model(x, y)
            else:
                loss = model(x, y)
            loss.backward()
        if off is not None:
            off.wait()
            stats = off.stats()
            pool_left = stats.host_tier_bytes
            off.close()
        gpu.synchronize()
    return gpu, loss.detach(), [p.grad for p in model.parameters()], stats, pool_left


def test_the_switch_is_scoped_and_restores_the_real_seam():
    gpu = ModelledGPU(H100)
    t = torch.ones(4)
    assert seam.modelled_gpu() is None and not seam.is_cuda(t) and seam.producer_stream(t) is None
    with pytest.raises(KeyError):
        with modelled(gpu):
            gpu.adopt(t)
            assert seam.modelled_gpu() is gpu and seam.is_cuda(t) and not seam.is_cuda(torch.ones(4))
            assert seam.current_stream(t.device) is gpu.compute and seam.producer_stream(t) is gpu.compute
            assert seam.gpu_device(t.device) and measure.allocated(t.device) == 16
            assert gpu.kind(seam.pinned_empty(64)) == "pinned"
            inner = ModelledGPU(H100)
            with modelled(inner):
                assert seam.modelled_gpu() is inner
            assert seam.modelled_gpu() is gpu
            raise KeyError  # the switch is restored on the way out of an error too
    assert seam.modelled_gpu() is None and not seam.is_cuda(t) and not seam.gpu_device(t.device)


def test_seam_fences_and_copies_order_on_the_model():
    gpu = ModelledGPU(H100)
    with modelled(gpu), ModelledCompute(gpu):
        x = torch.ones(1024) * 2
        pinned = seam.pinned_empty(x.nbytes).view(torch.float32)
        fence = copies.queue_copies([pinned], [x], [seam.fence_on(seam.producer_stream(x))])
        assert fence.stream is not gpu.compute  # the copy thread's side stream
        fence()  # the host waits: the copy is seen done
        assert torch.equal(pinned, torch.full((1024,), 2.0)) and not gpu.races
        assert copies.queue_to_host([pinned.data_ptr()], [x], [None]) is None  # no raw addresses here


@pytest.mark.parametrize("recompute", [False, True])
def test_gpt_with_the_host_tier_equals_the_model_without_ssdtrain(recompute):
    gpu0, loss0, grads0, _, _ = step(offload=False, recompute=recompute)
    gpu, loss, grads, stats, pool_left = step(offload=True, recompute=recompute)
    assert torch.equal(loss, loss0) and torch.isfinite(loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads0))
    assert gpu.races == [] and gpu0.races == []
    assert stats.host_copied_bytes > 0 and stats.host_read_bytes == stats.host_copied_bytes
    assert pool_left == 0 and gpu.pinned_bytes() == 0  # nothing left in the pool, and the pool is gone


def test_what_the_pool_cannot_hold_spills_to_the_drive_exactly():
    # The memory backend stands for the drive: its I/O threads copy through the seam
    # (copy_on_side_stream), concurrently, so only the result is checked here, not the timeline.
    _, loss0, grads0, _, _ = step(offload=False)
    gpu, loss, grads, stats, pool_left = step(offload=True, host_bytes=64 << 10)
    assert stats.spilled_bytes > 0 and stats.host_copied_bytes > 0 and stats.read_bytes > 0
    assert torch.equal(loss, loss0) and all(torch.equal(a, b) for a, b in zip(grads, grads0))
    assert gpu.races == [] and pool_left == 0


def test_the_tier_lowers_the_modelled_peak():
    gpu0, *_ = step(offload=False)
    gpu, _, _, stats, _ = step(offload=True)
    assert stats.host_copied_bytes > 0
    assert gpu.peak() < gpu0.peak()  # copies released device memory before forward's end


def test_a_release_one_wait_early_is_caught(monkeypatch):
    # The compute stream no longer waits for a copy before its memory goes (or before a reload is read).
    monkeypatch.setattr(copies.OrderOnce, "__call__", lambda self, fence, stream: None)
    gpu0, _, grads0, _, _ = step(offload=False)
    try:
        gpu, _, grads, stats, _ = step(offload=True)
    except IndexError as e:  # the poison reached an index (the loss's targets, read back too early)
        assert "out of bounds" in str(e)
        return
    assert stats.host_copied_bytes > 0
    assert gpu.races, "a missing wait passed silently"
    assert any("released" in r for r in gpu.races) or any("reads a buffer" in r for r in gpu.races)
    assert not all(torch.equal(a, b) for a, b in zip(grads, grads0))  # poison reached the gradients


def test_the_same_seed_gives_the_same_timeline():
    a, *_ = step(offload=True, seed=3)
    b, *_ = step(offload=True, seed=3)
    assert a.host_now == b.host_now and a.timeline == b.timeline and a.peak() == b.peak()
    c, *_ = step(offload=True, seed=4)
    assert c.timeline != a.timeline  # the jitter follows the seed
