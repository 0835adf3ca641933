"""Note [a save is copied only after its op returned] (``writer.py``): an op may write a tensor it
saved after saving it, without bumping its version (``rrelu_with_noise`` fills ``noise``); no
save's bytes are copied before the op that saved it returned (issue 52)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ssdtrain
from tests._manual_store import ManualStore


class HandOverStore(ManualStore):
    """Takes a save's bytes the moment the engine hands its write over (as a copy at pack does),
    so that a write handed over while its op still runs copies what the op had not written yet."""

    def submit_write(self, extent, src, *, checksum=False, ready=None):
        fut = super().submit_write(extent, src.clone(), checksum=checksum, ready=ready)
        self.complete_write(len(self.pending_writes) - 1)
        return fut


def _rrelu_grad(off, x, *, wait):
    with off:
        y = F.rrelu(x * 1.0, 0.0, 1.0, training=True)
        if wait:
            off.wait()
    (g,) = torch.autograd.grad(y.sum(), x)
    return g


def test_rrelu_noise_is_copied_after_rrelu_filled_it():
    """rrelu saves ``noise`` (empty) and then its input, and only then fills ``noise``: with every
    save copied the moment the engine lets it go, its gradient (1 everywhere, for a positive
    input) came back as whatever the empty buffer held (before the fix: every element wrong)."""
    store = HandOverStore()
    off = ssdtrain.Offloader(store=store, min_bytes=0)
    x = (torch.rand(1 << 16, dtype=torch.float64) + 0.1).requires_grad_()
    g = _rrelu_grad(off, x, wait=True)
    assert store.written >= 2 * x.nbytes, "rrelu's saves were not written: the test proves nothing"
    assert int((g != 1).sum()) == 0
    off.close()


def test_the_next_save_of_the_same_op_does_not_release_a_save():
    """The last save waits for the next one (Note [the last save waits]); a next save of the same
    op (rrelu's input, after its noise) leaves both waiting; the next op's save releases them."""
    store = HandOverStore()
    off = ssdtrain.Offloader(store=store, min_bytes=0)
    x = (torch.rand(1 << 12, dtype=torch.float64) + 0.1).requires_grad_()
    with off:
        h = x * 1.0
        y = F.rrelu(h, 0.0, 1.0, training=True)
        assert store.written == 0, "a save was written while the op that saved it could still run"
        z = y * y  # another op's saves: rrelu has returned
        assert store.written == 2 * x.nbytes  # noise and input; y itself waits as the last save
    (g,) = torch.autograd.grad(z.sum(), x)
    assert torch.equal(g, 2 * y.detach() * (y.detach() > 0))  # rrelu's slope is 1 where x > 0
    off.close()


@pytest.mark.parametrize("n", [1 << 20, 1 << 24])
@pytest.mark.parametrize("setting", ["default", "wait"])
def test_rrelu_gradients_are_exact_with_files(setting, n, tmp_path):
    """The issue's snippet: the real file store, its I/O threads racing rrelu's kernel (before the
    fix, 85k to all 1M elements wrong in most rounds). 1M float64 elements, 20 rounds; 16M, 3."""
    rounds = 20 if n == 1 << 20 else 3
    kw = dict(min_bytes=0, late_writes=True, when_full="wait") if setting == "wait" else {}
    off = ssdtrain.Offloader(path=str(tmp_path), **kw)
    wrong = []
    for _ in range(rounds):
        x = (torch.rand(n, dtype=torch.float64) + 0.1).requires_grad_()
        wrong.append(int((_rrelu_grad(off, x, wait=setting == "wait") != 1).sum()))
    s = off.stats()
    off.close()
    assert wrong == [0] * rounds
    if setting == "wait":
        assert s.written_bytes >= rounds * 2 * n * 8, "the saves were not written: the test proves nothing"


def test_when_full_wait_does_not_wait_for_the_running_ops_own_saves(tmp_path):
    """``when_full="wait"`` with room for one save: the op's second save cannot wait for its first
    one's write (which may not start before the op returned); it goes past the cap instead."""
    off = ssdtrain.Offloader(path=str(tmp_path), min_bytes=0, when_full="wait", max_inflight_bytes="64KiB")
    x = (torch.rand(1 << 13, dtype=torch.float64) + 0.1).requires_grad_()  # 64 KiB
    g = _rrelu_grad(off, x, wait=True)
    assert int((g != 1).sum()) == 0
    off.close()
