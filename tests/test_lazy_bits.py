"""Note [lazy bits travel with the save] and what pack keeps as it is: conjugate and negative views,
quantized tensors, autocast's weight casts, and Note [a new save sees the bytes as they are now]."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ssdtrain


class SaveAndCheck(torch.autograd.Function):
    """Saves ``v`` (whatever its lazy bits) and, in backward, compares what comes back with the
    value ``v`` had, as a plain tensor, and with its bits."""

    @staticmethod
    def forward(ctx, x, v):
        ctx.save_for_backward(v)
        ctx.expected = v.resolve_conj().resolve_neg().clone()
        ctx.bits = (v.is_conj(), v.is_neg(), v.dtype, v.shape, v.stride())
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        (v,) = ctx.saved_tensors
        assert (v.is_conj(), v.is_neg(), v.dtype, v.shape, v.stride()) == ctx.bits
        assert torch.equal(v.resolve_conj().resolve_neg(), ctx.expected)
        return g * 1.0, None


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.complex64, torch.complex128,
          torch.int32, torch.uint8]


@settings(max_examples=40)
@given(dtype=st.sampled_from(DTYPES), conj=st.booleans(), neg=st.booleans(),
       view=st.sampled_from(["whole", "slice", "transpose", "imag"]), written=st.booleans())
def test_every_lazy_bit_and_view_comes_back(tmp_path_factory, dtype, conj, neg, view, written):
    d = tmp_path_factory.mktemp("off")
    base = (torch.randn(64, 48, dtype=torch.complex64) if dtype.is_complex else torch.randn(64, 48)).to(dtype) \
        if dtype.is_floating_point or dtype.is_complex else torch.randint(0, 100, (64, 48), dtype=dtype)
    x = torch.randn(3, requires_grad=True)
    # Kept: a min_bytes above the tensor; written: every byte goes, and wait() lands it first.
    off = ssdtrain.Offloader(path=str(d), min_bytes=0 if written else "1GiB", when_full="wait")
    with off:
        t = base * 1  # a fresh non-leaf storage, as an op's output would be
        if conj and dtype.is_complex:
            t = t.conj()
        if view == "slice":
            t = t[3:40:2]
        elif view == "transpose":
            t = t.t()
        elif view == "imag" and dtype.is_complex:
            t = t.imag  # of a conjugate view: a negative view
        if neg and not t.is_conj() and not dtype.is_complex and dtype.is_floating_point:
            t = torch._neg_view(t)
        out = SaveAndCheck.apply(x, t)
        off.wait()
    out.sum().backward()
    s = off.stats()
    assert (s.written_bytes > 0) == written and (s.read_bytes > 0) == written
    off.close()


def test_conjugate_gradient_is_exact(off_dir):
    """The issue's case: (c * c.conj()).real.sum() with c = x * w, w a complex64 parameter."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(256, 256, dtype=torch.complex64))
    x = torch.randn(256, 256, dtype=torch.complex64)

    def grad(off):
        w.grad = None
        if off is None:
            c = x * w
            (c * c.conj()).real.sum().backward()
        else:
            with off:
                c = x * w
                loss = (c * c.conj()).real.sum()
            loss.backward()
        return w.grad.clone()

    expected = grad(None)
    for kept in (True, False):  # the kept path rebuilt views too
        off = ssdtrain.Offloader(path=str(off_dir), min_bytes="1GiB" if kept else 0)
        assert torch.equal(grad(off), expected)
        off.close()


def test_mH_and_adjoint_save_their_bits(off_dir):
    torch.manual_seed(0)
    a = torch.randn(32, 32, dtype=torch.complex128, requires_grad=True)
    b = torch.randn(32, 32, dtype=torch.complex128)

    def grads(off):
        a.grad = None
        ctx = off if off is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with ctx:
            h = a * 2
            loss = (h.mH @ b).abs().sum() + (h.adjoint() @ h).real.sum()
        loss.backward()
        return a.grad.clone()

    expected = grads(None)
    off = ssdtrain.Offloader(path=str(off_dir), min_bytes=0, when_full="wait")
    assert torch.equal(grads(off), expected)
    off.close()


class SaveQuantized(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        q = torch.quantize_per_tensor(x.detach() * 1, 0.1, 0, torch.qint8)
        ctx.save_for_backward(q)
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        (q,) = ctx.saved_tensors
        return g * q.dequantize()


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_quantized_tensors_are_kept_as_they_are(off_dir):
    x = torch.randn(512, 512, requires_grad=True)
    SaveQuantized.apply(x).sum().backward()
    expected, x.grad = x.grad, None
    off = ssdtrain.Offloader(path=str(off_dir), min_bytes=0)
    with off:
        out = SaveQuantized.apply(x)
    out.sum().backward()
    assert torch.equal(x.grad, expected)
    off.close()


def test_autocast_weight_casts_stay_in_memory(off_dir):
    """Autocast's cached low-precision copy of a weight is not an activation: never written."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 512)
    x = torch.randn(8, 512)
    off = ssdtrain.Offloader(lin, path=str(off_dir), min_bytes=0, when_full="wait")
    with off, torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    s = off.stats()
    weight_bytes = 512 * 512 * 2
    assert s.saved_bytes < weight_bytes  # the bf16 weight (512 KiB) was not packed as an activation
    y.float().sum().backward()
    off.close()


def test_a_new_save_after_an_unseen_write_sees_the_new_bytes(off_dir):
    """Note [a new save sees the bytes as they are now]: ``.data`` writes bump no version; a
    save of the storage made after its bytes left for the drive must not get the old bytes."""
    x = torch.ones(256, 256, requires_grad=True)
    off = ssdtrain.Offloader(path=str(off_dir), min_bytes=0, when_full="wait")
    with off:
        h = x * 2                  # h = 2
        a = h.sin()                # saves h
        off.wait()                 # h is on the drive and gone from memory
        h.data.mul_(3)             # h = 6, unseen by autograd (no version bump)
        b = h.cos()                # a new save of h: must see 6
    (a.sum() + b.sum()).backward()
    two, six = torch.full((256, 256), 2.0), torch.full((256, 256), 6.0)
    # sin's save was written before the change: it comes back as saved (2), as documented;
    # cos's save came after: 6. Matching cos's save to the written entry would give sin(2).
    assert torch.allclose(x.grad, (two.cos() - six.sin()) * 2, rtol=1e-6, atol=0)
    assert not torch.allclose(x.grad, (two.cos() - two.sin()) * 2, rtol=1e-3, atol=0)
    off.close()


def test_keep_modules_saves_nothing_inside_them(off_dir):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256))
    x = torch.randn(64, 256)
    for keep in ([model[1]], ["1"]):
        off = ssdtrain.Offloader(model, path=str(off_dir), min_bytes=0, keep_modules=keep, when_full="wait")
        with off:
            loss = model(x).sum()
            off.wait()
        s = off.stats()
        loss.backward()
        # The GELU's input (64 KiB) stays; the two Linear layers' inputs are written.
        assert s.written_bytes == 2 * 64 * 256 * 4
        off.close()
    with pytest.raises(ValueError, match="keep_modules: no submodule 'nope'"):
        ssdtrain.Offloader(model, path=str(off_dir), keep_modules=["nope"])


def test_offload_disabled_is_a_no_op_with_the_same_surface(off_dir):
    off = ssdtrain.offload(None, enabled=False, path=str(off_dir))
    x = torch.randn(64, 64, requires_grad=True)
    with off:
        y = (x * 2).exp()
    with off.microbatch(0):
        pass
    off.prefetch(0)
    off.wait()
    y.sum().backward()
    assert off.stats().written_bytes == 0
    off.close()
    with pytest.raises(ValueError, match="min_bytes"):
        ssdtrain.offload(None, enabled=False, min_bytes=-1)  # settings are still checked
    assert list(off_dir.iterdir()) == []


def test_a_with_around_the_whole_loop_starts_a_step_per_forward(off_dir):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Tanh()) for _ in range(4)])
    x = torch.randn(64, 128)
    expected = []
    for _ in range(3):
        model.zero_grad()
        model(x).sum().backward()
        expected.append([p.grad.clone() for p in model.parameters()])
    got = []
    with ssdtrain.Offloader(model, path=str(off_dir), min_bytes=0) as off:
        for _ in range(3):
            model.zero_grad()
            model(x).sum().backward()
            got.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(expected, got):
        assert all(torch.equal(p, q) for p, q in zip(a, b))
    off.wait()
    s = off.stats()
    assert len({k for k in off._scopes.by_id}) <= 1 and s.live_entries == 0 and s.saved_bytes > 0
    off.close()


def test_empty_steps_leave_no_scope(off_dir):
    off = ssdtrain.Offloader(path=str(off_dir))
    for i in range(50):
        with off:
            pass
        with off.microbatch(i):
            pass
    assert off._scopes.by_id == {}
    off.close()
