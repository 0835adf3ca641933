"""Autograd's unpack order is not the reverse of the pack order (torch PR 198016 documents it as
unspecified): read-ahead and release must not depend on it (issue 49). Note [backward that jumps
down the pack order] in ``schedule.py`` says what the read-ahead does then."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ssdtrain

N = 4096  # features: a save of a (4, N) fp32 activation is 64 KiB


def _branch(seed: int, depth: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(N, N // 8), nn.Tanh(), nn.Linear(N // 8, N), nn.LayerNorm(N))
                           for _ in range(depth)]).double()


def _offloader(tmp_path, window: int = 512 << 10) -> ssdtrain.Offloader:
    # Every save written (wait() inside forward), a window of a few saves: what backward needs and
    # the read-ahead did not read is a miss.
    return ssdtrain.Offloader(path=str(tmp_path), min_bytes=0, prefetch_bytes=window, host_bytes=0)


def _grads(params) -> list[torch.Tensor]:
    return [p.grad.clone() for p in params]


def _reset(params) -> None:
    for p in params:
        p.grad = None


def test_two_backward_calls_in_pack_order(tmp_path):
    """Branch A packed first, branch B after it; backward runs A's first (a call of its own), then
    B's: A's saves are needed first, and they lie below every save of B in the pack order. The
    read-ahead, which started at the top (B), follows backward down into A."""
    a, b = _branch(0, 6), _branch(1, 6)
    params = [*a.parameters(), *b.parameters()]
    x0 = torch.randn(4, N, dtype=torch.float64)

    def step(off):
        x = x0.clone().requires_grad_()
        ctx = off if off is not None else torch.enable_grad()
        with ctx:
            ya, yb = a(x * 1.0), b(x * 1.0)
            if off is not None:
                off.wait()
        ya.square().sum().backward()
        hits = off.stats().prefetch_hits if off is not None else 0
        yb.square().sum().backward()
        return _grads(params) + [x.grad.clone()], hits

    want, _ = step(None)
    _reset(params)
    off = _offloader(tmp_path)
    got, hits_a = step(off)
    s = off.stats()
    off.close()
    assert s.written_bytes > 0 and s.read_bytes > 0
    assert all(torch.equal(w, g) for w, g in zip(want, got)), "gradients differ"
    # 6 blocks of A save about 24 tensors it reads back; read in pack order from the top, all of
    # them would be misses (the window full of B's saves, which backward does not need yet).
    assert hits_a >= 18, f"backward of A read {hits_a} saves ahead: the read-ahead did not follow it"
    assert s.prefetch_hits > hits_a, "B's backward read nothing ahead"


def test_grad_of_a_subset_leaves_saves_never_unpacked(tmp_path):
    """``torch.autograd.grad`` for one head of two: the other head's saves, at the top of the pack
    order, are never unpacked. Gradients exact, the trunk and head A still read ahead, and every
    entry released when the graph dies."""
    trunk, ha, hb = _branch(0, 4), _branch(1, 3), _branch(2, 3)
    x0 = torch.randn(4, N, dtype=torch.float64)
    wanted = [*trunk.parameters(), *ha.parameters()]

    def step(off):
        x = x0.clone().requires_grad_()
        with off if off is not None else torch.enable_grad():
            h = trunk(x * 1.0)
            loss = ha(h).square().sum() + hb(h).square().sum()
            if off is not None:
                off.wait()
        return torch.autograd.grad(loss, wanted + [x])

    want = step(None)
    off = _offloader(tmp_path)
    got = step(off)
    s = off.stats()
    assert all(torch.equal(w, g) for w, g in zip(want, got)), "gradients differ"
    assert s.prefetch_hits >= 12, f"only {s.prefetch_hits} saves read ahead"
    assert s.live_entries == 0 and s.live_disk_bytes == 0 and s.resident_bytes == 0
    off.close()


class _SavesMany(torch.autograd.Function):
    """One node with several large saves, unpacked in the order saved (``ctx.saved_tensors``):
    within a node, backward unpacks in pack order."""

    @staticmethod
    def forward(ctx, x):
        parts = [torch.tanh(x + i) for i in range(6)]
        ctx.save_for_backward(*parts)
        return sum(p * p for p in parts)

    @staticmethod
    def backward(ctx, g):
        parts = ctx.saved_tensors
        return sum(2 * p * (1 - p * p) * g for p in parts)


@pytest.mark.parametrize("repeat", [1, 3])
def test_a_node_unpacks_its_saves_in_the_order_saved(tmp_path, repeat):
    x0 = torch.randn(4, N, dtype=torch.float64)

    def step(off):
        x = x0.clone().requires_grad_()
        with off if off is not None else torch.enable_grad():
            y = x * 1.0
            for _ in range(repeat):
                y = _SavesMany.apply(y) / 6
            if off is not None:
                off.wait()
        (g,) = torch.autograd.grad(y.sum(), x)
        return g

    want = step(None)
    off = _offloader(tmp_path)
    got = step(off)
    s = off.stats()
    off.close()
    assert s.read_bytes > 0
    assert torch.equal(want, got)
