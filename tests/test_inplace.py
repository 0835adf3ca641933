"""Note [in-place after save]: backward never trains on a value modified after it was saved."""

import time

import pytest
import torch

import ssdtrain
import ssdtrain.store.posix as posix

INPLACE = "modified by an inplace operation"


def _plain_raises():
    x = torch.randn(1024, requires_grad=True)
    y = (x * 2).sigmoid()
    y.mul_(2)
    with pytest.raises(RuntimeError, match=INPLACE):
        y.sum().backward()


def test_pytorch_itself_raises():
    _plain_raises()  # the behaviour we must match


@pytest.mark.parametrize("wait", [False, True])
def test_modified_while_alive_raises(off_dir, wait):
    off = ssdtrain.Offloader(path=str(off_dir), min_bytes=0)
    x = torch.randn(64, 1024, requires_grad=True)
    with off:
        y = (x * 2).sigmoid()  # sigmoid saves its output y
        if wait:
            off.wait()         # y is on storage now, its memory dropped by us
        y.mul_(2)
        loss = y.sum()
    with pytest.raises(RuntimeError, match=INPLACE):
        loss.backward()
    off.close()


def test_modification_racing_a_slow_write_raises(off_dir, monkeypatch):
    """The write is still in flight when the tensor is modified: never trust those bytes."""
    real = posix._pwrite

    def slow(fd, buf, offset):
        time.sleep(0.2)
        return real(fd, buf, offset)

    monkeypatch.setattr(posix, "_pwrite", slow)
    monkeypatch.setenv("SSDTRAIN_IO_ENGINE", "threads")  # the ring does not go through the seam
    off = ssdtrain.Offloader(path=str(off_dir), min_bytes=0, backend="posix")
    x = torch.randn(64, 1024, requires_grad=True)
    with off:
        y = (x * 2).sigmoid()
        y.mul_(3)        # while the write of y is queued or running
        z = y.sum()
        del y            # only the offloader's own reference can tell now
    time.sleep(0.5)      # the write completes; the next safe point sees the new version
    with pytest.raises(RuntimeError, match=INPLACE):
        z.backward()
    off.close()


def test_modified_then_dropped_sees_saved_value_or_raises(off_dir):
    """With the tensor gone, backward must see the value as saved (or raise), never the new one."""
    torch.manual_seed(0)
    x = torch.randn(64, 1024, requires_grad=True)
    expected = torch.autograd.grad((x * 2).sigmoid().sum(), x)[0]
    off = ssdtrain.Offloader(path=str(off_dir), min_bytes=0)
    for wait in (True, False):
        with off:
            y = (x * 2).sigmoid()
            loss = y.sum()
            if wait:
                off.wait()
            y.mul_(5)
            del y
        try:
            (g,) = torch.autograd.grad(loss, x)
        except RuntimeError as e:
            assert INPLACE in str(e)
        else:
            assert torch.equal(g, expected)
    off.close()


def test_dedup_does_not_cross_an_inplace_change(off_dir):
    """Saved, modified in place, saved again: two copies, each with its own bytes."""
    off = ssdtrain.Offloader(path=str(off_dir), min_bytes=0)
    x = torch.randn(4096, requires_grad=True)

    def f():
        h = x * 1.5
        a = h * x            # saves h (version 0)
        h.add_(1)            # h is saved by mul: this alone would fail backward...
        return a, h

    with off:
        h = x * 1.5
        a = torch.exp(h)     # exp saves its output, not h
        h.add_(1)            # fine: h itself was not saved
        b = h * x            # saves h at version 1 (and x, a leaf)
        loss = (a + b).sum()
    off.wait()
    loss.backward()
    ref_x = x.detach().clone().requires_grad_()
    hh = ref_x * 1.5
    aa = torch.exp(hh)
    hh.add_(1)
    ((aa + hh * ref_x).sum()).backward()
    assert torch.equal(x.grad, ref_x.grad)
    off.close()
