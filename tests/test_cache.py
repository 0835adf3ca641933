"""Dedup by storage: one write per storage, views rebuilt as views, no false matches."""

import gc

import torch

import ssdtrain
from ssdtrain.engine.cache import Entry, StorageIndex, byte_span, byte_view, rebuild, Ref


class SaveMany(torch.autograd.Function):
    """Saves one tensor k times, plus views of it, the way real ops save inputs and outputs."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        ctx.save_for_backward(*([x] * k), x[1:], x.t(), x.view(torch.int32))
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        saved = ctx.saved_tensors
        k = ctx.k
        x, tail, xt, as_int = saved[0], saved[k], saved[k + 1], saved[k + 2]
        assert all(torch.equal(s, x) for s in saved[:k])
        assert torch.equal(tail, x[1:]) and torch.equal(xt, x.t()) and torch.equal(as_int, x.view(torch.int32))
        # views come back as views of one buffer
        assert tail.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        return g * x.sum(), None


def test_saved_k_times_written_once_read_once(off_dir):
    off = ssdtrain.Offloader(path=str(off_dir), min_bytes=0, when_full="wait")  # every step writes (no budget)
    x0 = torch.randn(256, 256, requires_grad=True)
    for i in range(2):
        before = off.stats()
        # A micro-batch scope: its last save is written too (``with off:`` would keep it in
        # memory for backward, Note [the last save waits]), so the write path is exercised.
        with off.microbatch(i):
            y = x0 * 2  # non-leaf: offloadable
            out = SaveMany.apply(y, 5)
        off.wait()
        out.sum().backward()
        after = off.stats()
        nbytes = y.numel() * y.element_size()
        assert after.unique_bytes - before.unique_bytes == nbytes  # one entry for all 8 saves
        assert after.written_bytes - before.written_bytes == nbytes
        assert after.read_bytes - before.read_bytes <= nbytes  # at most one read for all 8 saves
        assert after.reads - before.reads <= 1
    s = off.stats()
    assert s.written_bytes == 2 * nbytes  # once per step, though saved 8 times each step
    assert s.saved_bytes > 2 * 7 * nbytes
    off.close()


def test_fused_qkv_split_is_one_entry(off_dir):
    off = ssdtrain.Offloader(path=str(off_dir), min_bytes=0)
    lin = torch.nn.Linear(64, 192)
    x = torch.randn(2, 4, 32, 64)
    with off:
        q, k, v = lin(x).split(64, dim=-1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    off.wait()
    qkv_bytes = 2 * 4 * 32 * 192 * 4
    # q, k and v are saved separately but share one storage: written once as a whole.
    assert off.stats().written_bytes <= qkv_bytes + 2 * 4 * 32 * 64 * 4 * 2 + 4 * 2 * 4 * 32 * 4
    out.sum().backward()
    off.close()


class Scale(torch.autograd.Function):
    """y = x * x.sum(): saves x; its backward reads x back."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x.sum()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.sum() + (g * x).sum()


def test_freed_address_reuse_is_not_a_match(off_dir):
    """Note [a storage is not its address]: a new tensor whose memory (data pointer) is where a
    freed saved tensor's was must get its own entry, and backward must see its own values."""
    ROUNDS = 120  # glibc reuses the address in roughly one round of ten to one of two

    def run(off):
        leaf = torch.ones(4096, requires_grad=True)
        hits = 0
        with off if off is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            outs = []
            for i in range(ROUNDS):
                a = leaf * float(i)           # a fresh activation, saved by Scale
                ptr = a.data_ptr()
                outs.append(Scale.apply(a))
                if off is not None:
                    off.wait()                # written and released: only the file holds it now
                del a                         # its memory goes back to the allocator
                # A new activation at that very address: keep drawing (holding the misses, so the
                # allocator must hand out other blocks) until one lands there.
                held = []
                for _ in range(256):
                    b = leaf * float(i + 100)
                    if b.data_ptr() == ptr:
                        hits += 1
                        break
                    held.append(b)
                outs.append(Scale.apply(b))
                del b, held
        torch.stack([o.sum() for o in outs]).sum().backward()
        return leaf.grad, hits

    expected, _ = run(None)
    off = ssdtrain.Offloader(path=str(off_dir), min_bytes=0)
    got, hits = run(off)
    assert hits >= 5, f"the allocator reused an address only {hits} times in {ROUNDS}; the case was not exercised"
    assert off.stats().unique_bytes == 2 * ROUNDS * 4096 * 4  # no save matched a stale entry
    assert torch.equal(got, expected)
    off.close()


def test_weak_reference_pins_the_storage_identity():
    """Why the index is keyed by the storage object: while an entry's weak reference lives, no
    new storage can take its key, and a dead storage is recognised as such."""
    index = StorageIndex()
    t = torch.randn(1024)
    e = Entry(0, t, 0, 4096, scope=None, layer=None)
    index.add(e)
    assert index.find(t, 0, 4096) is e
    e.release_memory()
    del t
    gc.collect()
    assert e.storage_ref.expired()
    for _ in range(200):
        cand = torch.randn(1024)
        assert cand.untyped_storage()._cdata != e.key
        assert index.find(cand, 0, 4096) is None


def test_version_is_part_of_identity():
    index = StorageIndex()
    t = torch.randn(64)
    e = Entry(0, t, 0, 256, scope=None, layer=None)
    index.add(e)
    t.add_(1)
    assert index.find(t, 0, 256) is None  # modified since: a different copy of the bytes


def test_rebuild_geometry_roundtrip():
    base = torch.arange(4 * 6 * 8, dtype=torch.float32).reshape(4, 6, 8)
    views = [base, base.transpose(0, 2), base[1:, ::2, 3:], base[..., 0].expand(5, 4, 6),
             base.view(torch.complex64), base.view(torch.int16)[:, :, 1::3]]
    storage = base.untyped_storage()
    for lo in (0, 16):
        e = Entry(0, base, lo, storage.nbytes(), scope=None, layer=None)
        copy = byte_view(storage, lo, storage.nbytes() - lo, base.device).clone()
        for v in views:
            vlo, _ = byte_span(v)
            if vlo < lo:
                continue
            r = rebuild(copy, Ref(e, v, []))
            assert r.dtype == v.dtype and r.shape == v.shape and r.stride() == v.stride()
            assert torch.equal(r, v)


def test_byte_span_of_a_contiguous_view_is_its_elements():
    """The contiguous shortcut (one call on pack's path) reaches the bytes the strides reach."""
    base = torch.arange(4 * 6 * 8, dtype=torch.float32).reshape(4, 6, 8)
    views = [base, base[1:], base[2, 1:3], base[:, 1:2, :], base.unsqueeze(1), base[1:2].transpose(0, 1),
             base.view(torch.complex64)[1], base.view(torch.int16)[3, 5], base[..., 1:], base.transpose(0, 2),
             base[0, 0, 0:1].expand(5), base.reshape(-1)[7:8], base.as_strided((2, 1, 3), (3, 99, 1), 5)]
    for v in views:
        size = v.element_size()
        lo = v.storage_offset() * size
        reach = sum((n - 1) * s for n, s in zip(v.shape, v.stride()))
        assert byte_span(v) == (lo, lo + (reach + 1) * size), (v.shape, v.stride())
    assert any(v.is_contiguous() for v in views) and not all(v.is_contiguous() for v in views)
