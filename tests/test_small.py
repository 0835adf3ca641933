"""Note [a small save skips the cache]: a save whose storage is under ``min_bytes`` is held as a
``Small`` (its alias and version), not an entry. Gradients, in-place detection and every byte
counter are as they were through the entries; only the training thread's work is less."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ssdtrain
from ssdtrain.engine.cache import Small, SmallSaves
from ssdtrain.engine.stats import Counters

from _equiv import assert_same, step

INPLACE = "modified by an inplace operation"


class Block(nn.Module):
    """Attention, norms, dropout, views and a bf16 branch: the saves a decoder block makes,
    many of them small (norm statistics, the attention's log-sum-exp, dropout masks)."""

    def __init__(self, h: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.out = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)
        x = x + F.dropout(self.out(a.transpose(1, 2).reshape(b, s, h)), 0.1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            u = F.gelu(self.up(self.norm2(x)))
        return x + self.down(u.float())


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(3)])


def _loss_fn(model, x):
    return lambda: model(x).square().mean()


def _stats_of_one_step(model, x, tmp_path, *, small: bool, min_bytes: int, wait: bool = False):
    off = ssdtrain.Offloader(model, path=str(tmp_path), min_bytes=min_bytes, backend="posix")
    if not small:
        off._small_bytes = 0  # every save through an entry: the engine before the Note
    entries = []
    with off:
        loss = _loss_fn(model, x)()
        entries.append(len(off._cache.entries))
        if wait:
            off.wait()
    loss.backward()
    del loss
    gc.collect()
    off.wait()
    s = off.stats()
    off.close()
    return s, entries[0]


@pytest.mark.parametrize("min_bytes", [1 << 30, 16 << 10], ids=["all_small", "some_small"])
def test_small_saves_are_exact_and_counted_as_entries_were(tmp_path, min_bytes):
    model = _model()
    x = torch.randn(4, 32, 64)
    base = step(model, _loss_fn(model, x), None)
    for small in (True, False):
        off = ssdtrain.Offloader(model, path=str(tmp_path / str(small)), min_bytes=min_bytes, backend="posix")
        if not small:
            off._small_bytes = 0
        for wait in (False, True, False):
            assert_same(base, step(model, _loss_fn(model, x), off, wait=wait))
        off.close()
    fast, fast_entries = _stats_of_one_step(model, x, tmp_path / "a", small=True, min_bytes=min_bytes, wait=True)
    slow, slow_entries = _stats_of_one_step(model, x, tmp_path / "b", small=False, min_bytes=min_bytes, wait=True)
    for field in ("saved_bytes", "unique_bytes", "kept_bytes", "written_bytes", "read_bytes"):
        assert getattr(fast, field) == getattr(slow, field), (field, fast, slow)
    # The peak depends on when writes finish against the safe points that drop their memory
    # (and reads never go above it: Note [reads never raise the peak]), so it is bounded, not equal.
    for s in (fast, slow):
        assert s.kept_bytes <= s.peak_resident_bytes <= s.unique_bytes, s
    assert fast.resident_bytes == slow.resident_bytes == 0 and fast.live_entries == 0
    if min_bytes == 1 << 30:
        assert fast_entries == 0 < slow_entries and fast.written_bytes == 0  # no entry at all
    else:
        assert 0 < fast_entries < slow_entries and fast.written_bytes > 0    # small ones only skip


def test_a_small_save_changed_in_place_raises_as_pytorch_does(tmp_path):
    off = ssdtrain.Offloader(path=str(tmp_path))  # default min_bytes: 1 MiB
    x = torch.randn(64, 64, requires_grad=True)
    with off:
        y = (x * 2).sigmoid()  # sigmoid saves its output, 16 KiB: a Small
        assert not off._cache.entries and off._cache.small.rows
        y.mul_(2)
        loss = y.sum()
    with pytest.raises(RuntimeError, match=INPLACE + r": \[cpu tensor of shape \(64, 64\)\] is at version 1"):
        loss.backward()
    off.close()


def test_small_saves_come_back_in_a_second_backward(tmp_path):
    off = ssdtrain.Offloader(path=str(tmp_path))
    grads = []
    for hooks in (None, off):
        x = torch.randn(32, 32, requires_grad=True)
        torch.manual_seed(0)
        x.data.copy_(torch.randn(32, 32))
        with hooks if hooks is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            loss = (torch.tanh(x) * torch.sigmoid(x) @ x).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
    del loss
    gc.collect()
    assert off.stats().resident_bytes == 0 and not off._cache.small.rows
    off.close()


def test_a_storage_saved_twice_counts_once_until_its_last_save_dies():
    counters = Counters()
    saves = SmallSaves(counters)
    t = torch.randn(16, 16)
    a = saves.add(t, t.untyped_storage(), None)
    b = saves.add(t.t(), t.untyped_storage(), None)  # a view of the same storage
    assert type(a) is Small and counters.total.resident_bytes == counters.total.unique_bytes == 16 * 16 * 4
    assert counters.total.saved_bytes == 2 * 16 * 16 * 4
    del a
    saves.settle()
    assert counters.total.resident_bytes == 1024 and saves.rows
    del b
    saves.settle()
    assert counters.total.resident_bytes == 0 and not saves.rows and saves.live_bytes == 0


def test_a_death_an_interrupt_lost_is_healed():
    # Note [an interrupt never unbalances a count]: a death filed but cut short before it was
    # settled leaves its storage counted; once the storage is gone, heal() (wait()'s recount)
    # and the next save of whatever storage took its address drop the stale row.
    counters = Counters()
    saves = SmallSaves(counters)
    t = torch.randn(8, 8)
    s = saves.add(t, t.untyped_storage(), None)
    s.dead = None  # its death will not be filed
    key = s.key
    del s, t
    saves.settle()
    assert key in saves.rows and counters.total.resident_bytes == 256
    saves.heal()
    assert not saves.rows and counters.total.resident_bytes == 0
    # The stale row is found at the next save of a storage with the same key, and replaced.
    u = torch.randn(4, 4)
    gone = torch.randn(8, 8)
    stale = saves.add(gone, gone.untyped_storage(), None)
    stale.dead = None
    row = saves.rows.pop(stale.key)
    del stale, gone
    saves.rows[u.untyped_storage()._cdata] = row  # as if ``u`` had been allocated where it was
    assert row[0].expired()
    saves.add(u, u.untyped_storage(), None)
    assert counters.total.resident_bytes == 64 and saves.rows[u.untyped_storage()._cdata][1] == 64


def test_a_dtensor_with_a_small_shard_comes_back_exact(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available() or dist.is_initialized():
        pytest.skip("needs a fresh gloo process group")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        a0 = distribute_tensor(torch.randn(16, 32), mesh, [Shard(1)])
        grads = []
        for off in (None, ssdtrain.Offloader(path=str(tmp_path / "off"))):
            a = a0.detach().requires_grad_()
            with off if off is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                loss = (torch.tanh(a) * torch.sigmoid(a)).sum()
                if off is not None:
                    assert off._cache.small.rows and not off._cache.entries  # its shard is a Small
            loss.backward()
            grads.append(a.grad.to_local())
            if off is not None:
                off.close()
        assert torch.equal(grads[0], grads[1])
    finally:
        dist.destroy_process_group()
